"""Head-function scores (issue 48): right, cheap beside generation, bounded in memory, and checked by masking.

Run from the repository root::

    .venv/bin/python benchmarks/head_functions.py            # full size (tens of minutes alone on 2 cores)
    .venv/bin/python benchmarks/head_functions.py --record   # the same, kept in docs/bench/head_functions.json
    .venv/bin/python benchmarks/head_functions.py --quick    # SmolLM2 small, Gemma 3 at 4,096 tokens (minutes)
    .venv/bin/python benchmarks/head_functions.py --smoke    # a tiny random Llama, seconds

Figures (the last line printed is one JSON object; layers and heads 0-indexed):

* ``equal_to_naive_max_abs_err``: the largest difference between ``head_scores`` (induction, previous-token,
  duplicate-token, echo, locality) and loops over transformers' eager ``output_attentions=True`` rows of the same
  inputs (the tests' references), and between one needle trial's retrieval scores and the rule applied to the eager
  rows of its sequence, teacher-forced; on SmolLM2 (a short input). Target <= 1e-6. Receiver scores are checked
  against sentence averages in the tests, not here.
* ``scoring_over_generate``: needle trials (``run_trial``: attnscope's generation keeping decode-step rows, then
  the retrieval rule) over the same prompts answered by the model's plain greedy ``generate``, interleaved (the
  order alternates per trial); the ratio of the summed wall-clock seconds. Target <= 1.3. A timing: only a run on a
  quiet machine means anything.
* ``peak_mb_32k``: the process's peak resident memory (``VmHWM``, reset before the run as benchmarks/long.py does;
  the model's weights included) while ``head_scores`` computes locality and receiver scores on a 32,768-token
  document and the repeated-token scores at their default size, Gemma 3 270M. Target <= 8,192. (The repeated-token
  scores are computed from whole records of their sequences, 2 x 64 tokens by default: a 32,768-token repeated
  sequence would need planned capture of their diagonals, which is not built.)
* ``mask_top_k_drop`` / ``mask_random_k_drop``: the induction check (:func:`attnscope.experiments.head_masking.
  check_score`) on SmolLM2: for each k, the change of the loss on the repeated half (nats per token, masked - intact)
  with the top-k induction heads zero-ablated, and with k random heads (mean of 5 draws), each ``[change, ci_low,
  ci_high]`` (paired bootstrap 95%). Accuracies, not timings: valid under load.
* ``lists_models``: the aliases of the models whose head-function lists ship with attnscope
  (:func:`attnscope.data.head_lists`, the data files ``scripts/head_lists.py`` wrote), read, not recomputed.
* ``mask_checks``: per model whose list ships with masking checks (``scripts/head_checks.py``: induction, streaming and
  retrieval, top k against k random heads over 5 draws), ``{alias: {check: {k: {"top" | "random" | "bottom":
  [change, ci_low, ci_high]}}}}``, read from the lists' summaries, not recomputed (tens of minutes per model).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_json, attribution (the tiny model), long (peak)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' naive references

from attribution import tiny_model
from bench_json import add_smoke_flag, emit, sized_run
from long import peak_mb, reset_peak

import attnscope
from attnscope import HeadScoreSettings, head_scores
from attnscope.analysis.retrieval import retrieval_score
from attnscope.data import head_list_summary, head_lists
from attnscope.experiments.head_masking import check_score
from attnscope.experiments.needles import needle_prompt, run_trial
from attnscope.experiments.random_tokens import repeated_random_tokens
from tests.test_generate import eager_attention
from tests.test_head_functions import naive_locality, naive_repeated
from tests.test_needles import eager_top_keys

REPEATED_SCORES = ("induction", "previous_token", "duplicate_token", "echo")
LONG_DOCUMENT = "sotu-1981-jimmy-carter"  # the longest shipped address: 33,558 words, past 32,768 tokens
SIZES: dict[str, dict[str, Any]] = {
    "smoke": {"model": "tiny", "needle_tokens": 120, "new_tokens": 6, "trials": (("passkey-1", 0.5),),
              "peak_model": "tiny", "peak_tokens": 256, "ks": (1,), "mask_sequences": 4, "resamples": 50},
    "quick": {"model": "smollm2", "needle_tokens": 512, "new_tokens": 14,
              "trials": (("passkey-1", 0.5), ("passkey-2", 0.2)), "peak_model": "gemma3", "peak_tokens": 4096,
              "ks": (3,), "mask_sequences": 8, "resamples": 1000},
    "full": {"model": "smollm2", "needle_tokens": 1024, "new_tokens": 14,
             "trials": tuple((needle, depth) for needle in ("passkey-1", "passkey-2") for depth in (0.1, 0.5, 0.9)),
             "peak_model": "gemma3", "peak_tokens": 32768, "ks": (1, 3, 10), "mask_sequences": 32, "resamples": 1000},
}


def load(alias: str, folder: Path) -> Any:
    return tiny_model(folder) if alias == "tiny" else attnscope.load_model(alias)


# ---- equal to naive ---------------------------------------------------------------------------------------------
def repeated_error(loaded: Any) -> float:
    """Largest |head_scores - loops over eager rows| of the four repeated-token scores."""
    settings = HeadScoreSettings(period=12, repeats=3, sequences=2, seed=1)
    found = head_scores(loaded, REPEATED_SCORES, settings)
    sequences = repeated_random_tokens(loaded, settings.period, repeats=settings.repeats, sequences=settings.sequences,
                                       seed=settings.seed)
    prefix = len(sequences[0]) - settings.period * settings.repeats  # a BOS where the tokenizer has one
    naive = [naive_repeated(list(eager_attention(loaded, np.array(ids))), settings.period, settings.repeats, prefix)
             for ids in sequences]
    return max(float(np.abs(found.scores[name] - np.mean([one[name] for one in naive], axis=0)).max())
               for name in REPEATED_SCORES)


def locality_error(loaded: Any) -> float:
    """Largest |locality from planned capture - 1 minus the evicted mass of the eager rows|."""
    settings = HeadScoreSettings(documents=(LONG_DOCUMENT,), max_tokens=96, sinks=(0, 4), windows=(4, 16), chunk=17)
    found = head_scores(loaded, ["locality"], settings)
    ids = first_tokens(loaded, 96)
    eager = list(eager_attention(loaded, np.asarray(ids)))
    queries = np.arange(len(ids))
    return max(float(np.abs(found.scores[f"locality_k{k}_w{w}"] - naive_locality(eager, k, w, queries)).max())
               for k, w in settings.pairs)


def first_tokens(loaded: Any, n: int) -> list[int]:
    """The ids head_scores runs for the long document cut at ``n`` tokens (special tokens included)."""
    from attnscope.capture.extract import extract
    from attnscope.capture.plan import CapturePlan
    from attnscope.data import document
    from attnscope.experiments.head_functions import cut_quietly

    with cut_quietly():
        record = extract(loaded, document(LONG_DOCUMENT), plan=CapturePlan(attention=False, statistics=True),
                         max_length=n)
    return [int(i) for i in record.token_ids]


def retrieval_error(loaded: Any, size: dict[str, Any]) -> float:
    """Largest |one trial's retrieval scores - the rule on the eager rows of its sequence, teacher-forced|."""
    prompt = needle_prompt(loaded, "passkey-1", length=min(160, size["needle_tokens"]), depth=0.5)
    trial = run_trial(loaded, prompt, max_new_tokens=size["new_tokens"])
    eager = eager_top_keys(loaded, trial.token_ids, len(prompt.ids))
    reference = retrieval_score(eager, trial.token_ids, len(prompt.ids), prompt.answer_span)
    return float(np.abs(trial.scores - reference).max())


# ---- scoring over generate --------------------------------------------------------------------------------------
def plain_generate(loaded: Any, ids: tuple[int, ...], new_tokens: int) -> None:
    with torch.inference_mode():
        loaded.model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False)


def scoring_over_generate(loaded: Any, size: dict[str, Any]) -> dict[str, Any]:
    """Summed seconds of the trials with scoring over plain generate, the two interleaved (alternating first)."""
    prompts = [needle_prompt(loaded, needle_id, length=size["needle_tokens"], depth=depth)
               for needle_id, depth in size["trials"]]
    run_trial(loaded, prompts[0], max_new_tokens=2)  # warm-up of both paths
    plain_generate(loaded, prompts[0].ids, 2)
    scored_s = plain_s = 0.0
    answered = 0
    for index, prompt in enumerate(prompts):
        for scored in ((True, False) if index % 2 == 0 else (False, True)):
            start = time.perf_counter()
            if scored:
                answered += run_trial(loaded, prompt, max_new_tokens=size["new_tokens"]).counted
            else:
                plain_generate(loaded, prompt.ids, size["new_tokens"])
            seconds = time.perf_counter() - start
            scored_s, plain_s = (scored_s + seconds, plain_s) if scored else (scored_s, plain_s + seconds)
    return {"scoring_over_generate": round(scored_s / plain_s, 3), "scored_trials_s": round(scored_s, 2),
            "plain_generate_s": round(plain_s, 2), "needle_trials": len(prompts), "needle_answered": answered,
            "needle_tokens": size["needle_tokens"]}


# ---- memory ----------------------------------------------------------------------------------------------------
def peak_at(loaded: Any, tokens: int) -> dict[str, Any]:
    """Peak RSS (MB) while every non-retrieval score runs, the documents cut at ``tokens``."""
    settings = HeadScoreSettings(documents=(LONG_DOCUMENT,), max_tokens=tokens)
    names = [*REPEATED_SCORES, "locality", "receiver"]
    gc.collect()
    reset_peak()
    start = time.perf_counter()
    head_scores(loaded, names, settings)
    return {"peak_mb": round(peak_mb(), 1), "peak_tokens": tokens, "peak_scores": names,
            "peak_s": round(time.perf_counter() - start, 1)}


# ---- masking ---------------------------------------------------------------------------------------------------
def masking_drops(loaded: Any, size: dict[str, Any]) -> dict[str, Any]:
    """The induction check: loss change per k for the top-k heads and k random heads, with intervals."""
    scores = head_scores(loaded, ["induction"], HeadScoreSettings(period=32, sequences=4)).scores["induction"]
    check = check_score(loaded, "induction", scores, ks=size["ks"], draws=5, n_resamples=size["resamples"],
                        metric_options={"length": 32, "n": size["mask_sequences"]})
    rows = {(row["k"], row["heads"]): row for row in check.summary()}
    triple = lambda row: [round(row[key], 4) for key in ("change", "ci_low", "ci_high")]
    return {"mask_top_k_drop": {str(k): triple(rows[k, "top"]) for k in size["ks"]},
            "mask_random_k_drop": {str(k): triple(rows[k, "random"]) for k in size["ks"]},
            "mask_baseline_loss": round(check.baseline, 4), "mask_metric": check.metric,
            "mask_top_heads": check.sets[f"top {max(size['ks'])}"]}


def recorded_checks() -> dict[str, dict[str, dict[str, dict[str, list[float]]]]]:
    """The masking checks kept in the shipped lists' summaries: per model, check and k, each set's change and interval."""
    found: dict[str, dict[str, dict[str, dict[str, list[float]]]]] = {}
    for alias in head_lists():
        for name, check in head_list_summary(alias).get("checks", {}).items():
            for row in check["summary"]:
                if " - " not in row["heads"]:
                    found.setdefault(alias, {}).setdefault(name, {}).setdefault(str(row["k"]), {})[row["heads"]] = [
                        round(row["change"], 4), round(row["ci_low"], 4), round(row["ci_high"], 4)]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="head-function scores: accuracy, cost, memory, masking (one JSON "
                                                 "line last)")
    parser.add_argument("--quick", action="store_true", help="SmolLM2 at small sizes, Gemma 3 at 4,096 tokens")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    which, load_before = sized_run(args)
    size = SIZES[which]
    figures: dict[str, Any] = {"size": which}
    with tempfile.TemporaryDirectory() as folder:
        loaded = load(size["peak_model"], Path(folder) / "peak")  # first: the other model is not in memory yet
        peak = peak_at(loaded, size["peak_tokens"])
        figures.update(peak, peak_model=loaded.name)
        if size["peak_tokens"] == 32768:
            figures["peak_mb_32k"] = peak["peak_mb"]
        print(f"  peak {peak['peak_mb']:.0f} MB at {size['peak_tokens']} tokens ({loaded.name})", flush=True)
        del loaded
        gc.collect()
        loaded = load(size["model"], Path(folder) / "model")
    errors = {"repeated": repeated_error(loaded), "locality": locality_error(loaded),
              "retrieval": retrieval_error(loaded, size)}
    figures.update(equal_to_naive_max_abs_err=max(errors.values()), naive_errors=errors, model=loaded.name)
    print(f"  equal to naive: {errors}", flush=True)
    figures.update(scoring_over_generate(loaded, size))
    print(f"  scoring over generate: {figures['scoring_over_generate']}", flush=True)
    figures.update(masking_drops(loaded, size))
    print(f"  masking: top {figures['mask_top_k_drop']}, random {figures['mask_random_k_drop']}", flush=True)
    figures["lists_models"] = list(head_lists())
    figures["mask_checks"] = recorded_checks()
    figures.update(targets={"equal_to_naive_max_abs_err": "<= 1e-6", "scoring_over_generate": "<= 1.3",
                            "peak_mb_32k": "<= 8192"}, torch_threads=args.threads,
                   load_avg_before=round(load_before, 2), load_avg_after=round(os.getloadavg()[0], 2),
                   indexing="layers and heads are 0-indexed")
    emit("head_functions", figures, keep=which == "full")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
