"""Single-head ablation sweep of the default model: prefix-cached, layer-batched sweep vs the naive loop.

Run from the repository root::

    .venv/bin/python benchmarks/ablate.py              # all 72 heads of minilm on 256 Brown sentences
    .venv/bin/python benchmarks/ablate.py --quick      # 64 sentences

Both variants compute the same thing: the metric ``cosine`` (cosine similarity of each sentence's
mean-pooled embedding to the intact model's) for every single head of all-MiniLM-L6-v2 (6 layers x
12 heads) zero-ablated, on the SAME length-sorted batches (``--batch-size``, default 32) of the
first N sentences of :func:`attnscope.data.brown_sentences`, under ``torch.inference_mode``:

(a) sweep   ``run_sweep(..., cached=True)``: the intact model runs once per batch while every block's
            input is kept; the 12 variants of layer L then run blocks L..5 side by side, a few variants
            per batch (up to ``sweeps.TOKEN_BUDGET`` tokens). Work: 6 + 12 * (6 + 5 + ... + 1) = 258
            block-batches instead of 6 + 432.
(b) naive   ``run_sweep(..., cached=False)``: one full forward pass per variant and batch (72 x 6 blocks),
            plus the intact pass for the baseline (6 blocks), as in (a).

Each is warmed up on one batch first, then timed once (wall-clock ``time.perf_counter`` around the
whole sweep, bootstrap off). ``max_abs_diff`` is the largest absolute difference between (a) and (b)
over every per-sentence cosine of every variant (72 x N numbers). The machine may be shared: the JSON
reports the load average and the share of the cpus other processes used during each timed run
(``other_cpu_share``); rerun when those are high.

The last line printed is one JSON object. Targets: ratio = sweep_s / naive_s <= 0.65 (the block count
alone gives 258 / 438 = 0.59), max_abs_diff <= 1e-5.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_json import add_smoke_flag, emit
from extract import CpuWatch

import attnscope
from attnscope.data import brown_sentences
from attnscope.experiments import prepare_metric, run_sweep


def timed_sweep(loaded: Any, task: Any, cached: bool) -> tuple[float, float, Any]:
    watch = CpuWatch()
    start = time.perf_counter()
    result = run_sweep(loaded, task, "heads", cached=cached, n_resamples=0, progress=False)
    return time.perf_counter() - start, watch.other_share(), result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="cached+batched ablation sweep vs naive loop (one JSON line last)")
    parser.add_argument("--sentences", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="64 sentences")
    parser.add_argument("--batch-size", type=int, default=32)
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.sentences, args.batch_size = 4, 4
    n = 64 if args.quick else args.sentences
    load_before = os.getloadavg()[0]
    loaded = attnscope.load_model("minilm")
    task = prepare_metric("cosine", loaded, brown_sentences(n), batch_size=args.batch_size)
    warm = prepare_metric("cosine", loaded, brown_sentences(args.batch_size), batch_size=args.batch_size)
    print(f"attnscope {attnscope.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {load_before:.2f}; {n} sentences in {len(task.batches)} batches", flush=True)
    for cached in (True, False):
        run_sweep(loaded, warm, "heads", layers=[5], cached=cached, n_resamples=0, progress=False)

    sweep_s, sweep_busy, sweep = timed_sweep(loaded, task, cached=True)
    print(f"  sweep (cached, batched) {sweep_s:8.1f} s  (other processes: {sweep_busy:.0%} of the cpus)", flush=True)
    naive_s, naive_busy, naive = timed_sweep(loaded, task, cached=False)
    print(f"  naive loop              {naive_s:8.1f} s  (other processes: {naive_busy:.0%} of the cpus)", flush=True)
    assert sweep.cached and not naive.cached

    heads = int(np.isfinite(sweep.delta).sum())
    result = {
        "heads": heads,
        "examples": n,
        "sweep_s": round(sweep_s, 2),
        "naive_s": round(naive_s, 2),
        "ratio": round(sweep_s / naive_s, 4),
        "max_abs_diff": float(f"{np.abs(sweep.variant_stats - naive.variant_stats).max():.3g}"),
        "max_abs_diff_metric": float(f"{np.nanmax(np.abs(sweep.value - naive.value)):.3g}"),
        "batch_size": args.batch_size,
        "torch_threads": torch.get_num_threads(),
        "load_avg_before": round(load_before, 2),
        "load_avg_after": round(os.getloadavg()[0], 2),
        "other_cpu_share": {"sweep": round(sweep_busy, 3), "naive": round(naive_busy, 3)},
    }
    print(f"ratio {result['ratio']:.3f} (target <= 0.65), max abs diff {result['max_abs_diff']:.3g} (<= 1e-5)")
    emit("ablate", result, keep=not (args.quick or args.smoke) and args.sentences == 256)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
