"""KV budgets on the four models of the head lists (issue 49, item 3): needle accuracy and loss against the share of
full KV heads, for heads chosen by retrieval score, streaming score, at random and uniformly.

Run from the repository root::

    .venv/bin/python benchmarks/kv_curves.py --threads 2            # smollm2, gemma3, qwen0.5b, qwen1.5b (hours)
    .venv/bin/python benchmarks/kv_curves.py --threads 2 --record   # the same, kept in docs/bench/kv_curves.json
    .venv/bin/python benchmarks/kv_curves.py --models smollm2       # some of them
    .venv/bin/python benchmarks/kv_curves.py --smoke                # SmolLM2 at 256 tokens, shares 0 and 1
    .venv/bin/python benchmarks/kv_curves.py --redraw               # the recorded curves' plots again (no model)

Each model's curve is :func:`attnscope.experiments.kv_curve.kv_budget_curve` with the budgeted cache, its heads
ranked by the model's shipped head list (:func:`attnscope.data.head_list`), at ``2048``-token haystacks (a needle trial
of Qwen2.5 1.5B takes about half a minute there on 2 cores; ``benchmarks/kv_budget.py`` measures Qwen2.5 0.5B at
8,192). Gemma 3's local layers keep their own window and are never chosen: only its global layers' KV heads are.
Every run is kept in ``benchmarks/runs/kv_curves_<alias>_runs_<size>.jsonl`` as it ends, so the same command started again
reads back what was done (``--fresh`` runs it all again). With ``--record`` each curve is drawn to
``docs/img/kv_curve_<alias>.png``; ``--redraw`` draws those plots again from the tables docs/bench/kv_curves.json holds
(after a change to how a curve is drawn: no model runs, nothing recorded changes).

Figures (the last line printed is one JSON object; layers and KV heads 0-indexed): ``models``, per alias, the curve
(``table``: share, choice, accuracy, loss, KV bytes, saving, peak RSS; its settings and facts), ``saving_at_95`` per
choice (the smallest share keeping 95% of full attention's needle accuracy, its saving; None where no share of the
grid does), or ``refused``: the one line that says why a model has no curve (it answered no trial with full
attention). No timings: accuracies, losses, bytes and peaks are valid under load.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_json, kv_budget

from bench_json import DOCS_BENCH, add_smoke_flag, cpu_name, emit, sized_run
from kv_budget import kept_runs, saving_at

import attnscope
from attnscope.data import head_list
from attnscope.errors import AttnscopeError
from attnscope.experiments.kv_curve import CHOICES, CurveSettings, curve_title, kv_budget_curve, plot_curve

MODELS = ("smollm2", "gemma3", "qwen0.5b", "qwen1.5b")
IMAGES = Path(__file__).resolve().parent.parent / "docs" / "img"
SETTINGS = {
    "smoke": CurveSettings(shares=(0.0, 1.0), choices=("retrieval", "random"), draws=1, sink=4, window=16,
                           lengths=(256,), depths=(0.9,), needles=("passkey-1",), new_tokens=16, loss_pieces=1),
    "quick": CurveSettings(shares=(0.0, 0.5, 1.0), choices=("retrieval", "random", "uniform"), draws=2, sink=4,
                           window=64, lengths=(1024,), depths=(0.5,), needles=("passkey-1",), loss_pieces=1),
    "full": CurveSettings(shares=(0.0, 0.25, 0.5, 0.75, 1.0), draws=5, sink=4, window=64, lengths=(2048,),
                          depths=(0.1, 0.5, 0.9), needles=("passkey-1",), loss_pieces=1, loss_tokens=2048),
}


def model_curve(alias: str, settings: CurveSettings, runs: Path | None, image: Path | None) -> dict[str, Any]:
    """One model's curve as the figures keep it (or the line that refused it)."""
    loaded = attnscope.load_model(alias)
    try:
        curve = kv_budget_curve(loaded, head_list(alias), settings, apply="cache", progress=True, runs=runs)
    except AttnscopeError as refusal:
        print(f"  {alias}: {refusal}", flush=True)
        return {"refused": str(refusal)}
    if image is not None:
        curve.plot(image)
    found = {**curve.to_dict(), "date": date.today().isoformat(), "cpu": cpu_name()}
    del found["records"]  # each draw's heads: in the runs file's curve, not needed for the table
    found["saving_at_95"] = {choice: saving_at(curve, choice) for choice in CHOICES if choice in settings.choices}
    print(f"  {alias}: {found['needle_trials']}; saving at 95%: {found['saving_at_95']}", flush=True)
    return found


def recorded_curves() -> dict[str, Any]:
    """The curves docs/bench/kv_curves.json holds (none before a first record)."""
    recorded = DOCS_BENCH / "kv_curves.json"
    return json.loads(recorded.read_text())["figures"]["models"] if recorded.is_file() else {}


def redraw(models: list[str]) -> None:
    """Draw ``models``' recorded curves (:func:`recorded_curves`) to ``docs/img/kv_curve_<alias>.png`` again."""
    import pandas as pd

    recorded = recorded_curves()
    for alias in models:
        curve = recorded.get(alias)
        if curve is None or "table" not in curve:
            print(f"  {alias}: no recorded curve to draw", flush=True)
            continue
        settings = curve["settings"]
        title = curve_title(curve["model"], settings["sink"], settings["window"], curve["kv_tokens"])
        path = IMAGES / f"kv_curve_{alias}.png"
        plot_curve(pd.DataFrame(curve["table"]), settings["choices"], title, path)
        print(f"  {alias}: drawn to {path} from its record of {curve['date']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="KV budget curves on the four head-list models (one JSON line last)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="which models (default: all)")
    parser.add_argument("--quick", action="store_true", help="1,024 tokens, one trial, shares 0, 0.5 and 1 (minutes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    parser.add_argument("--fresh", action="store_true", help="run every point again (default: read back the runs "
                        "kept in benchmarks/runs/ by an earlier run that stopped or finished; give it after changing "
                        "code the curve runs)")
    parser.add_argument("--redraw", action="store_true", help="draw the recorded curves' plots again from "
                        "docs/bench/kv_curves.json (no model runs; nothing recorded changes)")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.redraw:
        redraw(args.models)
        return 0
    which, load_before = sized_run(args)
    models = ["smollm2"] if which == "smoke" else args.models
    recording = "--record" in sys.argv[1:]
    curves = {alias: model_curve(alias, SETTINGS[which], kept_runs(which, args.fresh, f"kv_curves_{alias}"),
                                 IMAGES / f"kv_curve_{alias}.png" if recording else None) for alias in models}
    if recording:  # a record of some models keeps the others' recorded curves, each with its own date and CPU
        curves = {**recorded_curves(), **curves}
    emit("kv_curves", {"size": which, "models": curves, "scores": "each model's shipped head list",
                       "torch_threads": args.threads, "load_avg_before": round(load_before, 2),
                       "indexing": "layers and KV heads are 0-indexed"}, keep=which == "full")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
