"""Is a route faithful? ``attnscope routes --evaluate`` at its default size, kept for docs/routes.md.

Run from the repository root::

    .venv/bin/python benchmarks/routes_check.py                # SmolLM2, 8 prompts per task, minutes alone
    .venv/bin/python benchmarks/routes_check.py --record       # the same, kept in docs/bench/routes_check.json
    .venv/bin/python benchmarks/routes_check.py --smoke        # a tiny random Llama, seconds

Figures (the last line printed is one JSON object; see :mod:`attnscope.experiments.routes_check`): per task
(``brown``, ``ioi``), the Spearman rho of each head score (route, route flow, direct logit attribution) with each
head's effect alone mean-ablated and their top-20 overlap, and the Spearman rho of each token score (route, route
flow, the last layer's attention, attention rollout, ALTI) with erasure; means over prompts with bootstrap 95%
intervals. These are accuracies, not timings: a run under load gives the same numbers. Writes
``docs/img/routes_check.png`` (not with ``--smoke``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attribution import check_model
from bench_json import add_smoke_flag, emit

from attnscope.experiments.routes_check import DEFAULT_PROMPTS, check_routes
from attnscope.present.figures import plot_routes_check, save_figure

IMAGE = Path(__file__).resolve().parent.parent / "docs" / "img" / "routes_check.png"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="route scores against patching and erasure (one JSON line last)")
    parser.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS, help=f"prompts per task (default: {DEFAULT_PROMPTS})")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1; the batches are small)")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    loaded, load_before = check_model(args.smoke, args.threads)
    # the tiny model's tokenizer (MiniLM's) keeps [CLS] when a Brown prompt is decoded: IOI alone gives token scores
    check = check_routes(loaded, tasks=("ioi",) if args.smoke else ("brown", "ioi"), n_prompts=3 if args.smoke else
                         args.prompts, n_resamples=100 if args.smoke else 1000, progress=not args.smoke)
    data = check.to_dict()
    for task, result in data["tasks"].items():
        heads = ", ".join(f"{name} {row['spearman'][0]:+.2f}" for name, row in result["heads"].items())
        tokens = ", ".join(f"{name} {row['spearman'][0]:+.2f}" for name, row in result["tokens"].items()
                           if row["spearman"][0] is not None)
        print(f"  {task}: heads vs patching {heads}; tokens vs erasure {tokens}", flush=True)
    if not args.smoke:
        save_figure(plot_routes_check(data), IMAGE)
    figures = {key: value for key, value in data.items() if key != "per_prompt"}
    figures.update(prompts=args.prompts, torch_threads=args.threads, load_avg_before=round(load_before, 2),
                   load_avg_after=round(os.getloadavg()[0], 2))
    emit("routes_check", figures, keep=not args.smoke and args.prompts == DEFAULT_PROMPTS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
