"""Make the published head-function lists (issue 48): every registered head score of each model, on two disjoint
sets of evidence, written as data files, pictures and a summary (one command).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/head_lists.py                      # the four models, shipped files
    OMP_NUM_THREADS=1 .venv/bin/python scripts/head_lists.py --models smollm2      # one model
    OMP_NUM_THREADS=1 .venv/bin/python scripts/head_lists.py --quick --models smollm2   # tiny grid, ./head-lists-quick/
    OMP_NUM_THREADS=1 .venv/bin/python scripts/head_lists.py --scores receiver     # one score again, the rest kept

For each model, every score of the registry (:func:`attnscope.analysis.head_functions.head_functions`: induction,
previous-token, duplicate-token, echo, locality / streaming window, receiver, retrieval) is computed twice, on the
evidence sets of :data:`SETS` (A and B share no needle, haystack, document or random seed). It writes, per model:

* ``<out>/<alias>.csv``: one row per (layer, head), 0-indexed: ``layer, head, kv_head, window`` (the layer's sliding
  window, 0 = global), each score pooled over both sets (:func:`pooled_columns`), then each score on set A
  (``<score>_a``) and on set B (``<score>_b``);
* ``<out>/<alias>_kv.csv``: one row per (layer, KV head): ``<score>_max`` and ``<score>_mean`` of the pooled scores over
  the KV group's query heads (a cache is kept per KV head);
* ``<out>/<alias>.json``: the model, the sets and the grid, the trials (answers, which counted), each score's stability
  (Spearman's rank correlation between sets A and B over heads), the share of heads with retrieval > 0.1 (Wu et al.
  2024), the top heads per score, per-layer notes (sliding windows), date, CPU, attnscope version, licence;
* ``<img>/head_lists_<alias>.png``: a layers x heads grid per score (pooled).

The models must be in the local cache (``attnscope`` aliases); nothing is downloaded. Each model is loaded alone and
freed before the next (Qwen2.5 1.5B takes ~7 GB as float32).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass, replace
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # cpu_name

from bench_json import cpu_name

import attnscope
from attnscope.analysis.head_functions import HeadScores, get_head_function, head_functions, smallest_windows
from attnscope.analysis.retrieval import RETRIEVAL_THRESHOLD
from attnscope.errors import AttnscopeError
from attnscope.experiments.head_functions import HeadScoreSettings, check_bounds, check_settings, needle_grid
from attnscope.experiments.needles import NeedleTrials, needle_trials
from attnscope.progress import say_slow_step

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("smollm2", "gemma3", "qwen0.5b", "qwen1.5b")  # smallest first: Qwen2.5 1.5B last, alone
OUT = ROOT / "src" / "attnscope" / "data" / "head_lists"
IMG = ROOT / "docs" / "img"
QUICK_OUT = Path("head-lists-quick")
LICENCE = ("attnscope's own measurements, under attnscope's licence (LICENSE); the models measured are under the "
           "Apache License 2.0 (SmolLM2, the Qwen2.5 models) or the Gemma Terms of Use (Gemma 3); no model weights "
           "or outputs are redistributed beyond the answers quoted in the trials")
TOP = 5  # heads listed per score in the summary
FLOAT_FORMAT = "%.6g"  # six significant digits in the CSV files


@dataclass(frozen=True)
class EvidenceSet:
    """One set of evidence: its needles hidden in ``needle_document``, locality and receiver scores on ``documents``,
    repeated random tokens drawn from ``seed``. The two sets share none of them."""

    name: str
    needles: tuple[str, ...]
    needle_document: str
    documents: tuple[str, ...]
    seed: int

    def settings(self, grid: dict[str, Any]) -> HeadScoreSettings:
        return HeadScoreSettings(needles=self.needles, needle_document=self.needle_document, documents=self.documents,
                                 seed=self.seed, **grid)


# two pass keys and two sentences in each set, so that a score's difference between sets is not a needle kind's
SETS = (
    EvidenceSet("a", ("passkey-1", "passkey-2", "sentence-1", "sentence-2"), "sotu-1946-harry-s-truman",
                ("sotu-1912-william-h-taft",), 0),
    EvidenceSet("b", ("passkey-3", "passkey-4", "sentence-3", "sentence-4"), "moby-dick-054", ("moby-dick-032",), 1),
)
# the grid per model, sized to a ~15 min run on 2 cores shared with other work (one needle trial of 1,024 tokens:
# SmolLM2 7 s, Gemma 3 8 s, Qwen2.5 0.5B 19 s, measured here with scripts/needle_trials.py at a load of ~1.5; at a load
# of ~6 SmolLM2's whole run took 16 min)
FULL_GRID: dict[str, Any] = {"needle_lengths": (1024,), "needle_depths": (0.1, 0.5, 0.9), "max_tokens": 2048,
                             "sequences": 4, "period": 64, "repeats": 3}  # 3 copies: echo sums two, unlike duplicate
GRIDS: dict[str, dict[str, Any]] = {
    "smollm2": FULL_GRID, "gemma3": FULL_GRID, "qwen0.5b": {**FULL_GRID, "needle_depths": (0.1, 0.9)},
    "qwen1.5b": {**FULL_GRID, "needle_depths": (0.5,), "max_tokens": 1024},  # ~3x Qwen2.5 0.5B per token
}
QUICK_GRID: dict[str, Any] = {"needle_lengths": (256,), "needle_depths": (0.5,), "max_tokens": 256, "sequences": 2,
                              "period": 32, "windows": (16, 64, 128)}


def grid_for(alias: str, quick: bool) -> dict[str, Any]:
    return QUICK_GRID if quick else GRIDS.get(alias, FULL_GRID)


def set_settings(alias: str, quick: bool) -> list[HeadScoreSettings]:
    """Each set's settings for ``alias`` (quick: one needle per set)."""
    sets = [replace(found, needles=found.needles[:1]) if quick else found for found in SETS]
    return [found.settings(grid_for(alias, quick)) for found in sets]


# ---- running ---------------------------------------------------------------------------------------------------
def score_names() -> list[str]:
    return [function.name for function in head_functions()]


def set_scores(loaded: Any, settings: HeadScoreSettings) -> tuple[HeadScores, NeedleTrials]:
    """Every registered score on one set: the needle scores from the trials (kept, for their answers), the rest by
    :func:`attnscope.head_scores`."""
    names = score_names()
    needle_names = [name for name in names if get_head_function(name).task == "needles"]
    found = attnscope.head_scores(loaded, [name for name in names if name not in needle_names], settings,
                                  progress=True)
    trials = needle_trials(loaded, **needle_grid(settings), progress=True)
    columns = dict(found.scores)
    for name in needle_names:
        columns.update(get_head_function(name).compute(trials))
    return replace(found, scores=columns), trials


POOLING = ("the mean of sets A and B, except streaming_window_k*, the smallest window of the mean locality grid, "
           "and retrieval, the mean over every counted trial of both sets")


def pooled_columns(per_set: list[HeadScores], trials: list[NeedleTrials]) -> dict[str, np.ndarray]:
    """The scores over both sets' evidence together, as one run on their union would give them: the mean of the
    sets' columns (each set has as many sequences and documents), except the smallest streaming window, taken again
    from the mean locality grid, and retrieval, the mean over every counted trial of both sets."""
    first = per_set[0]
    pooled = {name: np.mean([found.scores[name] for found in per_set], axis=0) for name in first.scores}
    pairs = first.settings["sinks"], first.settings["windows"]
    grid = np.stack([pooled[f"locality_k{k}_w{w}"] for k in pairs[0] for w in pairs[1]], axis=-1)
    pair_list = [(k, w) for k in pairs[0] for w in pairs[1]]
    for sink in pairs[0]:
        pooled[f"streaming_window_k{sink}"] = smallest_windows(grid, pair_list, sink, first.settings["share"])
    every = [trial for found in trials for trial in found.trials]
    counted = [trial.scores for trial in every if trial.counted]
    pooled["retrieval"] = np.mean(counted, axis=0) if counted else np.full(first.shape, np.nan)
    return pooled


def stability(per_set: list[HeadScores]) -> dict[str, dict[str, Any]]:
    """Per score: Spearman's rank correlation between sets A and B over the heads where both are finite (ties get
    their mean rank), and how many heads that is; rho is None where fewer than 3 heads or a constant column."""
    import pandas as pd

    found = {}
    for name in per_set[0].scores:
        a, b = (as_written(found_set.scores[name].ravel()) for found_set in per_set)
        both = np.isfinite(a) & np.isfinite(b)
        rho = pd.Series(a[both]).corr(pd.Series(b[both]), method="spearman") if both.sum() >= 3 else float("nan")
        found[name] = {"rho": None if np.isnan(rho) else round(float(rho), 4), "heads": int(both.sum())}
    return found


def as_written(values: np.ndarray) -> np.ndarray:
    """``values`` as the CSV files keep them (:data:`FLOAT_FORMAT`): ranks computed from them are the ranks a reader
    of the files gets (heads whose scores differ by rounding noise alone are tied, not ordered by it)."""
    return np.array([float(FLOAT_FORMAT % value) for value in values])


def share_above(values: np.ndarray, threshold: float) -> float:
    """The share of all heads whose score exceeds ``threshold`` (NaN counts as not above)."""
    return float(np.mean(np.nan_to_num(values, nan=-np.inf) > threshold))


# ---- writing ---------------------------------------------------------------------------------------------------
def head_frame(pooled: HeadScores, per_set: list[HeadScores]) -> Any:
    """One row per (layer, head): the model's facts, the pooled scores, then each set's."""
    frame = pooled.to_frame("head").drop(columns="note")
    for found, evidence in zip(per_set, SETS):
        for name, values in found.scores.items():
            frame[f"{name}_{evidence.name}"] = values.ravel()
    return frame


def trial_rows(trials: list[NeedleTrials]) -> list[dict[str, Any]]:
    return [{"set": evidence.name, **row} for found, evidence in zip(trials, SETS)
            for row in found.trials_frame().to_dict(orient="records")]


def summary(alias: str, pooled: HeadScores, per_set: list[HeadScores], trials: list[NeedleTrials],
            settings: list[HeadScoreSettings], seconds: float) -> dict[str, Any]:
    n_layers, n_heads = pooled.shape
    notes = {str(layer): pooled.note(layer) for layer in range(n_layers) if pooled.note(layer)}
    retrieval = {"threshold": RETRIEVAL_THRESHOLD, "share_above": round(share_above(pooled.scores["retrieval"],
                                                                                      RETRIEVAL_THRESHOLD), 4),
                 **{f"share_above_{evidence.name}": round(share_above(found.scores["retrieval"],
                                                                      RETRIEVAL_THRESHOLD), 4)
                    for found, evidence in zip(per_set, SETS)}}
    return {
        "alias": alias, "model": pooled.model, "layers": n_layers, "heads": n_heads, "kv_heads": pooled.n_kv_heads,
        "windows": list(pooled.windows), "learned_sinks": pooled.learned_sinks, "layer_notes": notes,
        "indexing": "layers and heads are 0-indexed",
        "sets": {evidence.name: {"needles": list(evidence.needles), "needle_document": evidence.needle_document,
                                 "documents": list(evidence.documents), "seed": evidence.seed,
                                 "settings": found.describe()}
                 for evidence, found in zip(SETS, settings)},
        "pooling": POOLING,
        "stability": stability(per_set), "retrieval": retrieval,
        "trials": {"total": sum(len(found.trials) for found in trials),
                   "counted": sum(found.n_counted for found in trials),
                   **{f"counted_{evidence.name}": found.n_counted for found, evidence in zip(trials, SETS)},
                   "rule": "a trial counts when its answer holds the needle's answer (attnscope.experiments.needles)",
                   "rows": trial_rows(trials)},
        "top": {name: top_heads(pooled, name) for name in pooled.scores},
        "date": date.today().isoformat(), "cpu": cpu_name(), "seconds": round(seconds, 1),
        "attnscope": attnscope.__version__, "command": "python scripts/head_lists.py --models " + alias,
        "licence": LICENCE,
    }


def top_heads(scores: HeadScores, name: str) -> list[list[Any]]:
    """The :data:`TOP` heads of column ``name``, ``[layer, head, value]``: largest first, except a smallest window,
    where the most local heads (smallest first) lead; NaN (no window keeps the share) never listed."""
    values = scores.scores[name]
    if not name.startswith("streaming_window"):
        return [[layer, head, round(value, 4)] for layer, head, value in scores.ranked(name, TOP)]
    order = np.argsort(np.nan_to_num(values, nan=np.inf).ravel(), kind="stable")[:TOP]
    rows = [(int(i // values.shape[1]), int(i % values.shape[1]), float(values.ravel()[i])) for i in order]
    return [[layer, head, value] for layer, head, value in rows if np.isfinite(value)]


PICTURED = ("induction", "previous_token", "duplicate_token", "echo", "retrieval", "receiver", "locality_k4_w64",
            "streaming_window_k4")


def write_model(alias: str, out: Path, img: Path, pooled: HeadScores, per_set: list[HeadScores],
                info: dict[str, Any]) -> list[Path]:
    from attnscope.present.figures import plot_head_scores, save_figure

    out.mkdir(parents=True, exist_ok=True)
    img.mkdir(parents=True, exist_ok=True)
    written = [out / f"{alias}.csv", out / f"{alias}_kv.csv", out / f"{alias}.json", img / f"head_lists_{alias}.png"]
    head_frame(pooled, per_set).to_csv(written[0], index=False, float_format=FLOAT_FORMAT)
    pooled.to_frame("kv_head").drop(columns="note").to_csv(written[1], index=False, float_format=FLOAT_FORMAT)
    written[2].write_text(json.dumps(info, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    pictured = [name for name in PICTURED if name in pooled.scores]
    save_figure(plot_head_scores(pooled, pictured), written[3])
    return written


def run_model(alias: str, quick: bool, out: Path, img: Path) -> dict[str, Any]:
    started = time.perf_counter()
    say_slow_step(f"head lists: loading {alias}")
    loaded = attnscope.load_model(alias)
    settings = set_settings(alias, quick)
    for found in settings:
        check_settings(loaded, score_names(), found)  # every prompt built and checked before the first trial
    per_set, trials = [], []
    for found, evidence in zip(settings, SETS):
        say_slow_step(f"head lists: {alias}, set {evidence.name.upper()}")
        scores, needles = set_scores(loaded, found)
        per_set.append(scores)
        trials.append(needles)
    pooled = replace(per_set[0], scores=pooled_columns(per_set, trials), settings={})
    info = summary(alias, pooled, per_set, trials, settings, time.perf_counter() - started)
    for path in write_model(alias, out, img, pooled, per_set, info):
        print(f"  wrote {path}", file=sys.stderr)
    return info


# scores whose pooled column is the plain mean of the sets' and that need no needle trial: --scores may re-run them
RESCORABLE = ("induction", "previous_token", "duplicate_token", "echo", "receiver")


def kept_columns(table: Path, shape: tuple[int, int]) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """A written ``<alias>.csv`` read back: its pooled columns and each set's (:func:`head_frame`), ``[layer, head]``,
    in the file's order."""
    import pandas as pd

    frame = pd.read_csv(table).sort_values(["layer", "head"])
    facts = ("layer", "head", "kv_head", "window")
    suffixes = tuple(f"_{evidence.name}" for evidence in SETS)
    pooled = [name for name in frame.columns if name not in facts and not name.endswith(suffixes)]
    column = {name: frame[name].to_numpy(dtype=float).reshape(shape) for name in frame.columns if name not in facts}
    return ({name: column[name] for name in pooled},
            [{name: column[name + suffix] for name in pooled} for suffix in suffixes])


def rescore_model(alias: str, names: list[str], out: Path, img: Path) -> dict[str, Any]:
    """Re-run only the scores ``names`` of :data:`RESCORABLE` on both sets; every other column, the trials and the
    rest of the summary are read back from the files already in ``out``, which are then written again."""
    started = time.perf_counter()
    say_slow_step(f"head lists: loading {alias} (scores {', '.join(names)} only)")
    loaded = attnscope.load_model(alias)
    info = json.loads((out / f"{alias}.json").read_text(encoding="utf-8"))
    pooled_kept, sets_kept = kept_columns(out / f"{alias}.csv", (info["layers"], info["heads"]))
    per_set = []
    for found, evidence, kept in zip(set_settings(alias, quick=False), SETS, sets_kept):
        say_slow_step(f"head lists: {alias}, set {evidence.name.upper()}")
        fresh = attnscope.head_scores(loaded, names, found, progress=True)
        per_set.append(replace(fresh, scores={name: fresh.scores.get(name, kept[name]) for name in kept}))
    pooled = replace(per_set[0], scores={name: np.mean([found.scores[name] for found in per_set], axis=0)
                                         if name in names else pooled_kept[name] for name in pooled_kept}, settings={})
    info["stability"].update({name: found for name, found in stability(per_set).items() if name in names})
    info["top"].update({name: top_heads(pooled, name) for name in names})
    info["rescored"] = {"scores": names, "date": date.today().isoformat(), "cpu": cpu_name(),
                        "seconds": round(time.perf_counter() - started, 1), "attnscope": attnscope.__version__,
                        "command": f"python scripts/head_lists.py --models {alias} --scores {' '.join(names)}"}
    for path in write_model(alias, out, img, pooled, per_set, info):
        print(f"  wrote {path}", file=sys.stderr)
    return info


def headline(info: dict[str, Any]) -> dict[str, Any]:
    """What is printed per model: counted trials, the retrieval share, stability and the top heads."""
    return {"alias": info["alias"], "counted": f"{info['trials']['counted']} of {info['trials']['total']}",
            "retrieval_share_above_0.1": info["retrieval"]["share_above"],
            "rho": {name: found["rho"] for name, found in info["stability"].items()},
            "top3": {name: heads[:3] for name, heads in info["top"].items()}, "seconds": info["seconds"]}


def check_premises(models: list[str], out: Path, img: Path, scores: list[str] | None = None) -> None:
    """What needs no model, before the first one loads: the grids, that the outputs can be written, and for
    ``scores`` (a partial re-run) that each can be re-run alone and each model's files are there to keep."""
    from attnscope.models.registry import ALIASES

    for name in scores or ():
        if name not in RESCORABLE:
            raise AttnscopeError(f"--scores re-runs only {', '.join(RESCORABLE)} (got {name!r}); the others need "
                                 "the whole run")
    for alias in models:
        if alias not in ALIASES:  # the lists are of built-in models, named by their aliases
            raise AttnscopeError(f"unknown model alias {alias!r}; choose from {', '.join(ALIASES)}")
        for path in (out / f"{alias}.csv", out / f"{alias}.json") if scores else ():
            if not path.is_file():
                raise AttnscopeError(f"--scores keeps the other columns of {path}, which does not exist")
        for found in set_settings(alias, quick=False):
            check_bounds(score_names(), found)
    for folder in (out, img):
        if folder.exists() and not folder.is_dir():
            raise AttnscopeError(f"{folder} exists and is not a folder")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), help=f"aliases (default: {' '.join(MODELS)})")
    parser.add_argument("--quick", action="store_true", help=f"a tiny grid (one needle per set, short inputs), "
                        f"written to {QUICK_OUT}/ unless --out/--img say otherwise: checks the command runs")
    parser.add_argument("--out", type=Path, help=f"where the data files go (default: {OUT.relative_to(ROOT)})")
    parser.add_argument("--img", type=Path, help=f"where the pictures go (default: {IMG.relative_to(ROOT)})")
    parser.add_argument("--scores", nargs="+", metavar="SCORE", help=f"re-run only these scores (of "
                        f"{', '.join(RESCORABLE)}) on both sets, keeping every other column, the trials and the "
                        "summary of the files already in --out")
    args = parser.parse_args(argv)
    out = args.out or (QUICK_OUT if args.quick else OUT)
    img = args.img or (QUICK_OUT if args.quick else IMG)
    try:
        if args.scores and args.quick:
            raise AttnscopeError("--scores re-runs the full grid's scores: it cannot be --quick")
        check_premises(args.models, out, img, args.scores)
        for alias in args.models:
            info = rescore_model(alias, args.scores, out, img) if args.scores else run_model(alias, args.quick, out, img)
            print(json.dumps(headline(info)), flush=True)
            gc.collect()  # the model goes before the next loads
    except AttnscopeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
