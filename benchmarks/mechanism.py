"""Which heads matter: attribution patching (AtP, AtP*) against activation patching, cost and agreement.

Run from the repository root, alone on the machine (it times)::

    .venv/bin/python benchmarks/mechanism.py            # SmolLM2, 20 IOI + 20 Brown pairs, Qwen 1.5B on 8
    .venv/bin/python benchmarks/mechanism.py --quick    # SmolLM2, 4 + 4 pairs, no Qwen 1.5B
    .venv/bin/python benchmarks/mechanism.py --smoke    # a tiny random Llama, seconds; figures mean nothing

Figures (the last line printed is one JSON object):

* ``atp_speedup``: cached activation patching of every head (``method="cached"``) on ``--pairs`` IOI pairs over
  AtP* (QK fix and GradDrop: per pair one clean forward pass, then 1 + L copies of the corrupted run side by side
  and one backward pass over them)
  on the same pairs. Target >= 20. ``atp_speedup_no_graddrop``: over AtP* without GradDrop (one backward pass),
  ``atp_plain_speedup``: over AtP.
* ``atp_spearman_ioi`` / ``atp_star_spearman_ioi`` (and ``_brown``): Spearman of every head's mean estimated share
  recovered against cached patching's, over all heads (target for AtP* on IOI >= 0.8); ``..._top20_overlap``: the
  share of the 20 heads with the largest |real| mean share among the estimate's 20 largest.
* ``atp_qwen1_5b_s`` and ``atp_qwen1_5b_peak_rss_mb``: AtP* over every head of Qwen2.5-Coder 1.5B on 8 IOI
  pairs (its own process, so the peak RSS is its own); ``null`` with a note when the model is not installed
  (``cd /work/main && make install-qwen1.5b``). Skipped under ``--quick``.

* ``qk_sum_max_abs_err``, ``qk_over_capture`` and the other ``qk_`` figures: QK attribution's exactness and cost, from
  ``benchmarks/mechanism_qk.py`` (see its docstring; it also runs alone).
* ``atp_star_corrects_ioi`` / ``_brown``: up to three heads where AtP* corrects AtP (AtP off the real mean share by
  more than 0.05, AtP* by less than half as much).
* ``qk_example``: QK attribution of the head with the largest real IOI effect, from the last position to the
  indirect object's name in the first pair; a full-size run also draws ``docs/img/mechanism_atp.png`` (estimate
  against real patching, every head) and ``docs/img/mechanism_qk.png`` (that head's QK table).

``main`` runs the figure functions of :data:`FIGURES` in turn, each adding its keys to one dict; another part of the
same benchmark is one more function there.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attribution import tiny_model
from bench_json import add_smoke_flag, cpu_name, emit
from extract import CpuWatch

import attnscope
from attnscope.experiments.atp import attribution_patching
from attnscope.experiments.faithfulness import spearman
from attnscope.experiments.patching import PatchingResult, activation_patching
from attnscope.experiments.tasks import brown_patch_pairs, ioi_pairs

QWEN_PAIRS = 8
TOP = 20
IMAGES = Path(__file__).resolve().parent.parent / "docs" / "img"
RUNS: dict[str, tuple[list[Any], dict[str, PatchingResult]]] = {}  # task -> (pairs, runs by method) of this run


def agreement(estimate: PatchingResult, real: PatchingResult, name: str) -> dict[str, float]:
    """Spearman of the mean shares over all heads, and the top-20 overlap by magnitude."""
    guess, truth = estimate.intervals["heads"][0].ravel(), real.intervals["heads"][0].ravel()
    finite = np.isfinite(guess) & np.isfinite(truth)
    guess, truth = guess[finite], truth[finite]
    top = min(TOP, len(truth))
    overlap = len(set(np.argsort(-np.abs(guess))[:top]) & set(np.argsort(-np.abs(truth))[:top])) / top
    return {f"{name}_spearman": round(spearman(guess, truth), 4), f"{name}_top20_overlap": round(overlap, 3)}


def corrections(runs: dict[str, PatchingResult], most: int = 3) -> list[dict[str, Any]]:
    """Heads where AtP* corrects AtP: AtP off the real mean share by more than 0.05, AtP* off by less than half as
    much; the ``most`` largest corrections, ``{layer, head, real, atp, atp_star}``."""
    real, plain, star = (runs[name].intervals["heads"][0] for name in ("cached", "atp", "atp_star"))
    plain_error, star_error = np.abs(plain - real), np.abs(star - real)
    fixed = np.nan_to_num((plain_error > 0.05) & (star_error < plain_error / 2), nan=False)
    order = [cell for cell in np.argsort(-(plain_error - star_error), axis=None) if fixed.flat[cell]][:most]
    return [{"layer": int(layer), "head": int(head), "real": round(float(real[layer, head]), 3),
             "atp": round(float(plain[layer, head]), 3), "atp_star": round(float(star[layer, head]), 3)}
            for layer, head in (np.unravel_index(cell, real.shape) for cell in order)]


def compare(loaded: Any, pairs: list[Any], task: str, timed: bool) -> dict[str, Any]:
    """Cached patching, AtP and AtP* (and without GradDrop) on ``pairs``; their agreement, and with ``timed`` the
    seconds of each (after a one-pair warm-up). The runs stay in :data:`RUNS` for the pages' figures."""
    if timed:
        activation_patching(loaded, pairs[:1], method="cached", n_resamples=0)
        attribution_patching(loaded, pairs[:1], n_resamples=0)
    watch = CpuWatch()
    runs = {"cached": activation_patching(loaded, pairs, method="cached", n_resamples=0),
            "atp_star": attribution_patching(loaded, pairs, method="atp*", n_resamples=0),
            "atp_star_no_graddrop": attribution_patching(loaded, pairs, method="atp*", grad_drop=False, n_resamples=0),
            "atp": attribution_patching(loaded, pairs, method="atp", n_resamples=0)}
    busy = watch.other_share()
    RUNS[task] = (pairs, runs)
    figures: dict[str, Any] = {f"{task}_pairs": len(pairs)}
    for name in ("atp", "atp_star", "atp_star_no_graddrop"):
        figures.update(agreement(runs[name], runs["cached"], f"{name}_{task}"))
    figures[f"atp_star_corrects_{task}"] = corrections(runs)
    seconds = {name: run.seconds for name, run in runs.items()}
    print(f"  {task}: {len(pairs)} pairs; seconds {', '.join(f'{k} {v:.1f}' for k, v in seconds.items())}; "
          f"other processes {busy:.0%} of the cpus", flush=True)
    if timed:
        figures.update({"patch_cached_s": round(seconds["cached"], 2), "atp_star_s": round(seconds["atp_star"], 2),
                        "atp_star_no_graddrop_s": round(seconds["atp_star_no_graddrop"], 2),
                        "atp_s": round(seconds["atp"], 2),
                        "atp_speedup": round(seconds["cached"] / seconds["atp_star"], 2),
                        "atp_speedup_no_graddrop": round(seconds["cached"] / seconds["atp_star_no_graddrop"], 2),
                        "atp_plain_speedup": round(seconds["cached"] / seconds["atp"], 2),
                        "heads": int(np.prod(runs["cached"].heads.shape[1:])),
                        "other_cpu_share": round(busy, 3)})
    return figures


def rename(figures: dict[str, Any]) -> dict[str, Any]:
    """``atp_star_ioi_spearman`` -> ``atp_star_spearman_ioi`` (the issue's names)."""
    out = {}
    for key, value in figures.items():
        for task in ("ioi", "brown"):
            for measure in ("spearman", "top20_overlap"):
                if key.endswith(f"_{task}_{measure}"):
                    key = f"{key[: -len(task) - len(measure) - 2]}_{measure}_{task}"
        out[key] = value
    return out


def atp_figures(loaded: Any, args: argparse.Namespace) -> dict[str, Any]:
    figures = compare(loaded, ioi_pairs(loaded, args.pairs), "ioi", timed=True)
    figures.update(compare(loaded, brown_patch_pairs(loaded, args.pairs), "brown", timed=False))
    return rename(figures)


def qwen_figures(loaded: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Qwen 1.5B in a child process (its peak RSS its own); skipped under --quick and --smoke."""
    if args.quick or args.smoke:
        return {"atp_qwen1_5b_s": None, "atp_qwen1_5b_note": "skipped (--quick / --smoke)"}
    from attnscope.models.registry import ALIASES

    alias = ALIASES["qwen1.5b"]
    if not (alias.installed or alias.buildable):
        return {"atp_qwen1_5b_s": None, "atp_qwen1_5b_note": f"qwen1.5b is not installed ({alias.install})"}
    done = subprocess.run([sys.executable, __file__, "--qwen-only"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"atp_qwen1_5b_s": None, "atp_qwen1_5b_note": " ".join(done.stderr.strip().splitlines()[-1:])}
    return json.loads(done.stdout.strip().splitlines()[-1])


def qwen_only() -> int:
    loaded = attnscope.load_model("qwen1.5b")
    pairs = ioi_pairs(loaded, QWEN_PAIRS)
    start = time.perf_counter()
    result = attribution_patching(loaded, pairs, method="atp*", n_resamples=0)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    print(json.dumps({"atp_qwen1_5b_s": round(seconds, 1), "atp_qwen1_5b_pairs": len(pairs),
                      "atp_qwen1_5b_heads": int(np.prod(result.heads.shape[1:])),
                      "atp_qwen1_5b_peak_rss_mb": round(peak)}))
    return 0


def draw_estimates(path: Path) -> None:
    """Estimate against real patching, one dot per head (mean share recovered over the pairs), AtP and AtP* side by
    side, one panel per task: ``path`` (PNG)."""
    from attnscope.analysis.figures import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, len(RUNS), figsize=(4.6 * len(RUNS), 4.2), squeeze=False)
    for ax, (task, (pairs, runs)) in zip(axes[0], RUNS.items()):
        real = runs["cached"].intervals["heads"][0].ravel()
        for name, colour, label in (("atp", "#9e9e9e", "AtP"), ("atp_star", "#c62828", "AtP*")):
            ax.scatter(real, runs[name].intervals["heads"][0].ravel(), s=9, c=colour, alpha=0.7, label=label)
        low, high = float(np.nanmin(real)), float(np.nanmax(real))
        ax.plot([low, high], [low, high], color="black", linewidth=0.8, linestyle="--")
        ax.set(title=f"{'IOI' if task == 'ioi' else 'Brown'}: {len(pairs)} pairs, every head",
               xlabel="real patching (cached): share recovered", ylabel="estimate: share recovered")
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def qk_example(loaded: Any, path: Path) -> dict[str, Any]:
    """Why the head that matters most in IOI (largest mean share by real patching) attends from the last position
    to the indirect object's name in the first pair's clean prompt: its QK table, drawn to ``path``."""
    from attnscope.attribution.qk import qk_attribution

    pairs, runs = RUNS["ioi"]
    shares = np.nan_to_num(runs["cached"].intervals["heads"][0], nan=-np.inf)
    layer, head = (int(i) for i in np.unravel_index(np.argmax(shares), shares.shape))
    pair = pairs[0]
    ids = loaded.tokenizer(pair.clean)["input_ids"]
    name = loaded.tokenizer(pair.target, add_special_tokens=False)["input_ids"][0]
    key = ids.index(name)
    table = qk_attribution(loaded, ids, layer, head, len(ids) - 1, key)
    fig = table.plot()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return {"qk_example": {"layer": layer, "head": head, "text": pair.clean, "query": len(ids) - 1, "key": key,
                           "key_token": loaded.tokenizer.decode([name]), "score": round(float(table.score), 4),
                           "top_pairs": [(q, k, round(v, 4)) for q, k, v in table.top_pairs(5)]}}


def pictures(loaded: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The pages' two pictures (docs/img/mechanism_atp.png, mechanism_qk.png), from a full-size run only."""
    if args.smoke or args.quick or args.pairs != 20 or "ioi" not in RUNS:
        return {}
    draw_estimates(IMAGES / "mechanism_atp.png")
    return qk_example(loaded, IMAGES / "mechanism_qk.png")


def qk_part(loaded: Any, args: argparse.Namespace) -> dict[str, Any]:
    """QK attribution's figures (``benchmarks/mechanism_qk.py``), in the same line."""
    from mechanism_qk import qk_figures

    return qk_figures(quick=args.quick, smoke=args.smoke)


FIGURES: list[Callable[[Any, argparse.Namespace], dict[str, Any]]] = [atp_figures, pictures, qk_part, qwen_figures]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="AtP / AtP* against activation patching (one JSON line last)")
    parser.add_argument("--pairs", type=int, default=20, help="IOI and Brown pairs each (default: 20)")
    parser.add_argument("--quick", action="store_true", help="4 pairs each, no Qwen 1.5B")
    parser.add_argument("--qwen-only", action="store_true", help=argparse.SUPPRESS)
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.qwen_only:
        return qwen_only()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder:
        loaded = tiny_model(Path(folder)) if args.smoke else attnscope.load_model("smollm2")
    if args.smoke or args.quick:
        args.pairs = 2 if args.smoke else 4
    print(f"attnscope {attnscope.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{cpu_name()}, load average {load_before:.2f}; model {loaded.name}", flush=True)
    figures: dict[str, Any] = {"model": loaded.name, "torch_threads": torch.get_num_threads(),
                               "load_avg_before": round(load_before, 2)}
    for measure in FIGURES:
        figures.update(measure(loaded, args))
    figures["load_avg_after"] = round(os.getloadavg()[0], 2)
    print(f"atp_speedup {figures.get('atp_speedup')} (target >= 20), atp_star_spearman_ioi "
          f"{figures.get('atp_star_spearman_ioi')} (target >= 0.8), qk_sum_max_abs_err "
          f"{figures.get('qk_sum_max_abs_err')} (target <= 1e-4), qk_over_capture {figures.get('qk_over_capture')} "
          "(target <= 3)")
    emit("mechanism", figures, keep=not (args.smoke or args.quick) and args.pairs == 20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
