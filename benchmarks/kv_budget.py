"""KV budgets (issue 49): how much cache the head scores save at the answers of full attention.

Run from the repository root::

    .venv/bin/python benchmarks/kv_budget.py            # Qwen2.5 0.5B, 8,192-token haystacks (hours on 2 cores)
    .venv/bin/python benchmarks/kv_budget.py --record   # the same, kept in docs/bench/kv_budget.json
    .venv/bin/python benchmarks/kv_budget.py --quick    # SmolLM2 at 512 tokens, 2 trials, 5 random draws (minutes)
    .venv/bin/python benchmarks/kv_budget.py --smoke    # SmolLM2 at 256 tokens, 1 trial, shares 0 and 1

Figures (the last line printed is one JSON object; layers and KV heads 0-indexed). The curve is
:func:`attnscope.experiments.kv_curve.kv_budget_curve`: budgets applied as a mask on a full cache (what the budgeted cache
must equal), bytes counted.

* ``kv_saving_at_95``: full attention's KV bytes over the budget's at the smallest share of full KV heads (chosen by
  retrieval score) whose needle accuracy is at least 95% of full attention's; with the share, the bytes, and the
  accuracy of random heads at the same share (mean of the draws, Student-t 95% interval). Target >= 1.5 on Qwen2.5
  0.5B at 8,192 tokens. ``kv_saving_at_95_by_choice``: the same for every choice.
* ``budget_equals_mask``: the budgeted cache (``attnscope.capture.kv_budget``) generates what masking the same keys
  does. Null until that module exists: :func:`budget_equals_mask` is the slot to wire.
* ``peak_rss_saving_8k``, ``tok_s_ratio``: peak memory and speed of budgeted against full generation at 8,192 tokens;
  they need the real cache: null until it exists. Timings: only a quiet machine's mean anything.
* ``curve``: the table (share, choice, accuracy, loss, KV bytes, saving). Accuracies and losses are valid under load.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_json

from bench_json import add_smoke_flag, emit, sized_run

import attnscope
from attnscope.analysis.head_functions import frame_rows
from attnscope.experiments.kv_curve import CHOICES, CurveSettings, KVCurve, kv_budget_curve

SIZES: dict[str, dict[str, Any]] = {
    "smoke": {"model": "smollm2", "settings": CurveSettings(
        shares=(0.0, 1.0), choices=("retrieval", "random"), draws=1, sink=4, window=16, lengths=(256,), depths=(0.9,),
        needles=("passkey-1",), new_tokens=16, loss_pieces=1)},
    "quick": {"model": "smollm2", "settings": CurveSettings(
        shares=(0.0, 0.25, 0.5, 1.0), draws=5, sink=4, window=64, lengths=(512,), depths=(0.5,),
        needles=("passkey-1", "passkey-2"), new_tokens=16, loss_pieces=2)},
    "full": {"model": "qwen0.5b", "settings": CurveSettings(
        shares=(0.0, 0.125, 0.25, 0.375, 0.5, 0.75, 1.0), draws=5, sink=4, window=64, lengths=(8192,),
        depths=(0.1, 0.5, 0.9), needles=("passkey-1", "passkey-2", "sentence-1"), loss_pieces=4)},
}
ACCURACY_KEPT = 0.95  # of full attention's needle accuracy


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


def budget_equals_mask(loaded: Any, curve: KVCurve) -> bool | None:
    """Slot: the budgeted cache's tokens and rows against the mask's, at the curve's budgets. Null while
    ``attnscope.capture.kv_budget`` (the cache) is not importable; the lead wires the comparison when it is."""
    if importlib.util.find_spec("attnscope.capture.kv_budget") is None:
        return None
    return None  # wired with the cache: generate under BudgetedCache and under masked(), compare tokens and rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="KV budgets: saving at 95% of full attention's needle accuracy "
                                                 "(one JSON line last)")
    parser.add_argument("--quick", action="store_true", help="SmolLM2 at 512 tokens, 2 trials (minutes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    which, load_before = sized_run(args)
    size = SIZES[which]
    loaded = attnscope.load_model(size["model"])
    curve = kv_budget_curve(loaded, None, size["settings"], progress=True)
    at_95 = saving_at(curve, "retrieval")
    if at_95 is not None:
        at_95["random_accuracy"] = random_at(curve, at_95["share"])
    figures: dict[str, Any] = {
        "size": which, "model": loaded.name, "kv_tokens": curve.kv_tokens, "needle_trials": curve.trials,
        "kv_saving_at_95": at_95,
        "kv_saving_at_95_by_choice": {choice: saving_at(curve, choice) for choice in CHOICES
                                      if choice in curve.settings.choices},
        "budget_equals_mask": budget_equals_mask(loaded, curve), "peak_rss_saving_8k": None, "tok_s_ratio": None,
        "curve": frame_rows(curve.to_frame()),
        "targets": {"kv_saving_at_95": ">= 1.5", "budget_equals_mask": "true", "tok_s_ratio": ">= 1.0"},
        "applied_as": "a mask on a full cache (SinkWindow); bytes counted",
        "torch_threads": args.threads, "load_avg_before": round(load_before, 2),
        "load_avg_after": round(os.getloadavg()[0], 2), "indexing": "layers and KV heads are 0-indexed"}
    print(f"  saving at 95%: {at_95}", flush=True)
    emit("kv_budget", figures, keep=which == "full")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
