"""KV budgets (issue 49): how much cache the head scores save at the answers of full attention.

Run from the repository root::

    .venv/bin/python benchmarks/kv_budget.py --threads 2          # Qwen2.5 0.5B, 8,192-token haystacks (1 h)
    .venv/bin/python benchmarks/kv_budget.py --threads 2 --record # the same, kept in docs/bench/kv_budget.json
    .venv/bin/python benchmarks/kv_budget.py --quick    # SmolLM2 at 512 tokens, 2 trials, 5 random draws (minutes)
    .venv/bin/python benchmarks/kv_budget.py --smoke    # SmolLM2 at 256 tokens, 1 trial, shares 0 and 1

Figures (the last line printed is one JSON object; layers and KV heads 0-indexed). The curve is
:func:`attnscope.experiments.kv_curve.kv_budget_curve` with the real budgeted cache (``apply="cache"``), bytes counted,
the heads ranked by the model's shipped head list (:func:`attnscope.data.head_list`: retrieval and locality scores
measured on other haystacks and needles than the curve's, so no choice is fitted to the trials it is judged on).
Every run of the curve is kept in ``benchmarks/runs/kv_budget_runs_<size>.jsonl`` as it ends: a run that stops (the
session ends, the machine is needed) is started again with the same command and reads back what was done; the
generation figures below are always measured anew, so a curve run under load can be finished by a run alone. Kept
runs are read back whatever code made them: after changing the code a curve runs, give ``--fresh``.

* ``kv_saving_at_95``: full attention's KV bytes over the budget's at the smallest share of full KV heads (chosen by
  retrieval score) whose needle accuracy is at least 95% of full attention's; with the share, the bytes, and the
  accuracy of random heads at the same share (mean of the draws, Student-t 95% interval). Target >= 1.5 on Qwen2.5
  0.5B at 8,192 tokens. ``kv_saving_at_95_by_choice``: the same for every choice.
* ``budget_equals_mask``: ``attnscope.generate`` with the budgeted cache gives the same tokens as with the same keys
  masked on a full cache, and rows within 1e-5, for the retrieval budgets at the measured share (below) and at the
  grid's smallest, and a uniform budget at share 0.5 (windows per head); ``budget_equals_mask_detail`` the largest
  row difference of each.
* ``peak_rss_saving_8k``: peak RSS (``VmHWM``, reset before each run; the model's weights included) of full
  generation over budgeted generation at ``rss_context_tokens`` tokens of context, the budget of
  ``kv_saving_at_95``'s share (where it streams some head; else the grid's smallest share: ``generation.budget_share``), (8,192 at full
  size; 2,048 on --quick, 512 on --smoke), the prompt prefilled in chunks of 512 (128 on --smoke) so that no
  ``[head, T, T]`` block hides the cache. transformers' own ``generate`` with attnscope's attention and no capture.
* ``tok_s_ratio``: budgeted generation's decode tokens/s over full generation's at the same context, runs
  interleaved (full, budgeted, ...), medians. Timings: only a quiet machine's mean anything; memory figures and
  accuracies are valid under load.
* ``generation``: both runs' medians (tokens/s, peak MB, cache bytes held at the end) and the cache's saving.
* ``curve``: the table (share, choice, accuracy, loss, KV bytes, saving, peak RSS).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_json

from bench_json import RUNS, add_smoke_flag, emit, sized_run

import attnscope
from attnscope.analysis.head_functions import frame_rows
from attnscope.capture.generate import cache_keyword, returned_cache
from attnscope.capture.kv_budget import KVBudget, KVLayout, budgeted_cache, kv_layout
from attnscope.data import document, head_list
from attnscope.experiments.kv_curve import CHOICES, CurveSettings, KVCurve, kv_budget_curve, masked, uniform_budget
from attnscope.experiments.needles import DEFAULT_DOCUMENT
from attnscope.memory import peak_mb, reset_peak

SIZES: dict[str, dict[str, Any]] = {
    "smoke": {"model": "smollm2", "settings": CurveSettings(
        shares=(0.0, 1.0), choices=("retrieval", "random"), draws=1, sink=4, window=16, lengths=(256,), depths=(0.9,),
        needles=("passkey-1",), new_tokens=16, loss_pieces=1),
        "equal_tokens": 96, "equal_new_tokens": 4, "context": 512, "new_tokens": 8, "chunk": 128, "rounds": 1},
    "quick": {"model": "smollm2", "settings": CurveSettings(
        shares=(0.0, 0.25, 0.5, 1.0), draws=5, sink=4, window=64, lengths=(512,), depths=(0.5,),
        needles=("passkey-1", "passkey-2"), new_tokens=16, loss_pieces=2),
        "equal_tokens": 256, "equal_new_tokens": 16, "context": 2048, "new_tokens": 32, "chunk": 512, "rounds": 2},
    # Sized for 2 CPU cores: a needle trial at 8,192 tokens takes about a minute there, and the grid runs 3 trials
    # under each of 2 x 8 inner budgets (an hour), so the loss is taken on one 2,048-token piece per budget.
    "full": {"model": "qwen0.5b", "settings": CurveSettings(
        shares=(0.0, 0.125, 0.25, 1.0), draws=5, sink=4, window=64, lengths=(8192,),
        depths=(0.1, 0.5, 0.9), needles=("passkey-1",), loss_pieces=1, loss_tokens=2048),
        "equal_tokens": 512, "equal_new_tokens": 32, "context": 8192, "new_tokens": 64, "chunk": 512, "rounds": 3},
}
ACCURACY_KEPT = 0.95  # of full attention's needle accuracy
SCORES = "the shipped head list attnscope.data.head_list({!r})"


def kept_runs(which: str, fresh: bool, name: str = "kv_budget") -> Path | None:
    """The file a curve keeps its runs in, ``benchmarks/runs/<name>_runs_<which>.jsonl`` (none for ``--smoke``),
    emptied first when ``fresh``."""
    if which == "smoke":
        return None
    path = RUNS / f"{name}_runs_{which}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    if fresh:
        path.unlink(missing_ok=True)
    elif path.is_file():
        print(f"  reading back the runs kept in {path} (--fresh runs them again)", flush=True)
    return path


def saving_at(curve: KVCurve, choice: str) -> dict[str, Any] | None:
    """The smallest share whose ``choice`` keeps >= 95% of full attention's accuracy (1: only trials the full model
    answered count), its bytes and saving; None when no share of the grid does."""
    frame = curve.to_frame()
    rows = frame[(frame["choice"] == choice) & (frame["accuracy"] >= ACCURACY_KEPT)].sort_values("share")
    if rows.empty:
        return None
    row = rows.iloc[0]
    return {"share": float(row["share"]), "kv_bytes": int(row["kv_bytes"]), "saving": float(row["kv_saving"]),
            "accuracy": float(row["accuracy"])}


def random_at(curve: KVCurve, share: float) -> list[float | None] | None:
    """Random heads' accuracy at ``share``: ``[mean, low, high]`` (None without random draws; bounds None for one
    draw)."""
    frame = curve.to_frame()
    rows = frame[(frame["choice"] == "random") & (frame["share"] == share)]
    if rows.empty:
        return None
    row = rows.iloc[0]
    return [None if math.isnan(value) else float(value)
            for value in (row["accuracy"], row["accuracy_low"], row["accuracy_high"])]


def budget_of_record(layout: KVLayout, record: dict[str, Any], sink: int, window: int) -> KVBudget:
    """The :class:`KVBudget` a curve's record ran: its streaming heads ``[layer, kv_head, window]``, the rest full."""
    full = np.zeros((layout.n_layers, layout.n_kv_heads), dtype=bool)
    full[layout.global_layers] = True
    recent = np.zeros(full.shape, dtype=int)
    for layer, head, recent_keys in record["streaming"]:
        full[layer, head], recent[layer, head] = False, recent_keys
    streamed = recent[~full & (recent > 0)]
    return KVBudget(full, sink, int(streamed.min()) if streamed.size else window, layout.windows, recent)


def measured_share(curve: KVCurve, at_95: dict[str, Any] | None) -> float:
    """The share whose retrieval budget generation is measured at: that of ``kv_saving_at_95`` where it streams some
    head, else the grid's smallest (a grid too coarse to find a saving still measures one)."""
    if at_95 is not None and at_95["share"] < 1.0:
        return float(at_95["share"])
    return float(min(curve.settings.shares))


def record_at(curve: KVCurve, share: float, choice: str) -> dict[str, Any]:
    return next(r for r in curve.records if r["share"] == share and r["choice"] == choice and r["draw"] == 0)


def text_of(loaded: Any, tokens: int) -> list[int]:
    """The first ``tokens`` tokens of the needles' haystack document."""
    ids = loaded.tokenizer(document(DEFAULT_DOCUMENT), add_special_tokens=False)["input_ids"]
    if len(ids) < tokens:
        raise SystemExit(f"the document holds {len(ids)} tokens, {tokens} asked for")
    return ids[:tokens]


def budget_equals_mask(loaded: Any, budgets: dict[str, KVBudget], tokens: int, new_tokens: int) -> dict[str, Any]:
    """The budgeted cache's generation against the same keys masked on a full cache (:func:`masked`), for each of
    ``budgets``: same tokens, and rows within 1e-5 (the largest difference reported)."""
    prompt = loaded.tokenizer.decode(text_of(loaded, tokens))
    layout = kv_layout(loaded)
    found: dict[str, Any] = {}
    for name, budget in budgets.items():
        cached = attnscope.generate(loaded, prompt, max_new_tokens=new_tokens, kv_budget=budget, prompt_rows=False)
        with masked(loaded, layout, budget):
            reference = attnscope.generate(loaded, prompt, max_new_tokens=new_tokens, prompt_rows=False)
        difference = float(np.abs(cached.arrays["rows"] - reference.arrays["rows"]).max())
        found[name] = {"tokens_equal": cached.token_ids.tolist() == reference.token_ids.tolist(),
                       "rows_max_difference": difference}
    equal = all(f["tokens_equal"] and f["rows_max_difference"] <= 1e-5 for f in found.values())
    return {"equal": equal, "prompt_tokens": cached.prompt_length, "new_tokens": new_tokens,
            "budgets": found}


class _StepClock:
    """A streamer that notes when each generated token arrives (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def generation_run(loaded: Any, ids: list[int], new_tokens: int, chunk: int, budget: KVBudget | None) -> dict[str, Any]:
    """transformers' ``generate`` (attnscope's attention, no capture) after ``ids`` with a budgeted cache or a plain
    one, the prompt prefilled in chunks of ``chunk`` tokens: its tokens, decode tokens/s, peak RSS, cache bytes."""
    cache = None if budget is None else budgeted_cache(loaded, budget)
    given = {} if cache is None else {cache_keyword(loaded.model.forward): cache}
    clock = _StepClock()
    input_ids = torch.tensor([ids])
    gc.collect()
    reset_peak()
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = loaded.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                    max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                    use_cache=True, prefill_chunk_size=chunk, streamer=clock,
                                    pad_token_id=loaded.tokenizer.pad_token_id, return_dict_in_generate=True, **given)
    peak = peak_mb()
    held = cache.stored_bytes() if cache is not None else sum(
        layer.keys.numel() * layer.keys.element_size() * 2 for layer in returned_cache(out)[1].layers)
    decode = clock.times[-1] - clock.times[1]  # from the first generated token to the last
    return {"tokens": out.sequences[0].tolist(), "tok_s": (len(clock.times) - 2) / decode, "peak_mb": peak,
            "cache_bytes": int(held)}


def generation_figures(loaded: Any, budget: KVBudget, context: int, new_tokens: int, chunk: int,
                       rounds: int) -> dict[str, Any]:
    """Peak RSS and decode speed of budgeted against full generation at ``context`` tokens, interleaved
    (full, budgeted, full, budgeted, ...): the medians over ``rounds`` pairs, and whether the tokens agree."""
    ids = text_of(loaded, context)
    runs: dict[str, list[dict[str, Any]]] = {"full": [], "budgeted": []}
    for _ in range(rounds):
        runs["full"].append(generation_run(loaded, ids, new_tokens, chunk, None))
        runs["budgeted"].append(generation_run(loaded, ids, new_tokens, chunk, budget))
    median = {name: {key: float(np.median([r[key] for r in found])) for key in ("tok_s", "peak_mb", "cache_bytes")}
              for name, found in runs.items()}
    return {"context_tokens": context, "new_tokens": new_tokens, "prefill_chunk": chunk, "rounds": rounds,
            "full": median["full"], "budgeted": median["budgeted"], "budget_share": budget.share,
            "peak_rss_saving": median["full"]["peak_mb"] / median["budgeted"]["peak_mb"],
            "cache_saving": median["full"]["cache_bytes"] / median["budgeted"]["cache_bytes"],
            "tok_s_ratio": median["budgeted"]["tok_s"] / median["full"]["tok_s"],
            "same_tokens_as_full": runs["full"][0]["tokens"] == runs["budgeted"][0]["tokens"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="KV budgets: saving at 95% of full attention's needle accuracy "
                                                 "(one JSON line last)")
    parser.add_argument("--quick", action="store_true", help="SmolLM2 at 512 tokens, 2 trials (minutes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--fresh", action="store_true",
                        help="run every point again (default: read back the runs kept in benchmarks/runs/ by an earlier run "
                             "of the same size that stopped or finished; give it after changing code the curve runs)")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    which, load_before = sized_run(args)
    size = SIZES[which]
    loaded = attnscope.load_model(size["model"])
    settings = size["settings"]
    runs = kept_runs(which, args.fresh)
    curve = kv_budget_curve(loaded, head_list(size["model"]), settings, apply="cache", progress=True, runs=runs)
    at_95 = saving_at(curve, "retrieval")
    if at_95 is not None:
        at_95["random_accuracy"] = random_at(curve, at_95["share"])
    layout = kv_layout(loaded)
    share = measured_share(curve, at_95)
    budget = budget_of_record(layout, record_at(curve, share, "retrieval"), settings.sink, settings.window)
    smallest = min(settings.shares)  # the budget that streams most, and one with windows per head
    checked = {f"retrieval_{share:g}": budget,
               f"retrieval_{smallest:g}": budget_of_record(layout, record_at(curve, smallest, "retrieval"),
                                                           settings.sink, settings.window),
               "uniform_0.5": uniform_budget(layout, 0.5, settings.sink, settings.window, size["equal_tokens"])}
    print(f"  budgeted cache against the mask ({', '.join(checked)})", flush=True)
    equal = budget_equals_mask(loaded, checked, size["equal_tokens"], size["equal_new_tokens"])
    print(f"  generation at {size['context']} tokens, budgeted against full, interleaved", flush=True)
    generation = generation_figures(loaded, budget, size["context"], size["new_tokens"], size["chunk"],
                                    size["rounds"])
    figures: dict[str, Any] = {
        "size": which, "model": loaded.name, "settings": asdict(settings), "scores": SCORES.format(size["model"]),
        "kv_tokens": curve.kv_tokens, "needle_trials": curve.trials, "needle_trials_asked": curve.asked,
        "baseline_loss": curve.baseline_loss,
        "kv_saving_at_95": at_95,
        "kv_saving_at_95_by_choice": {choice: saving_at(curve, choice) for choice in CHOICES
                                      if choice in curve.settings.choices},
        "budget_equals_mask": equal["equal"], "budget_equals_mask_detail": equal,
        "peak_rss_saving_8k": generation["peak_rss_saving"], "tok_s_ratio": generation["tok_s_ratio"],
        "generation": generation, "rss_context_tokens": size["context"],
        "curve": frame_rows(curve.to_frame()),
        "targets": {"kv_saving_at_95": ">= 1.5", "budget_equals_mask": "true", "tok_s_ratio": ">= 1.0"},
        "applied_as": "the budgeted cache (BudgetedCache); bytes counted",
        "torch_threads": args.threads, "load_avg_before": round(load_before, 2),
        "load_avg_after": round(os.getloadavg()[0], 2), "indexing": "layers and KV heads are 0-indexed"}
    print(f"  saving at 95%: {at_95}; equal to the mask: {equal['equal']}; at {size['context']} tokens peak RSS "
          f"{generation['peak_rss_saving']:.3f}x, tok/s {generation['tok_s_ratio']:.3f}x", flush=True)
    emit("kv_budget", figures, keep=which == "full")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
