"""``attnscope kv-budget``: needle accuracy, loss and KV bytes against the share of full KV heads, heads chosen by
retrieval score, streaming score, at random and uniformly; parses, calls
:func:`attnscope.experiments.kv_curve.kv_budget_curve`, prints the table and draws the curve."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..arguments import finite_float, non_negative_int, positive_int, seed
from ..errors import AttnscopeError
from .command import Command
from .head_functions import _number_list
from .model_options import add_compute_arguments

if TYPE_CHECKING:
    from ..experiments.kv_curve import CurveSettings, KVCurve


def _arguments(parser: argparse.ArgumentParser) -> None:
    from ..experiments.kv_curve import CurveSettings

    defaults = CurveSettings()
    parser.add_argument("model", help="a decoder: alias, local folder, .gguf file or cached repo id")
    parser.add_argument("--scores", type=Path, metavar="FILE.parquet", help="head scores written by 'attnscope "
                        "head-functions --save' (per head or per KV group); a missing retrieval or streaming score "
                        "is computed")
    parser.add_argument("--apply", choices=("cache", "mask"), default="cache", help="how a budget is applied: "
                        "'cache', a budgeted cache that stores only the kept keys (default), or 'mask', the same keys "
                        "masked on a full cache (the reference; it equals the cache)")
    parser.add_argument("--shares", type=_number_list(finite_float, "shares"), metavar="S,S",
                        help=f"shares of full KV heads, 0 (StreamingLLM) to 1 (full) (default: {_joined(defaults.shares)})")
    parser.add_argument("--draws", type=positive_int, default=defaults.draws, metavar="N",
                        help=f"random choices: seeded draws per share (default: {defaults.draws})")
    parser.add_argument("--seed", type=seed, default=defaults.seed, metavar="N", help="random draws' seed (default: 0)")
    parser.add_argument("--sink", type=non_negative_int, default=defaults.sink, metavar="K",
                        help=f"streaming heads keep the first K keys (default: {defaults.sink})")
    parser.add_argument("--window", type=positive_int, default=defaults.window, metavar="W",
                        help=f"... and the W most recent (default: {defaults.window})")
    parser.add_argument("--lengths", type=_number_list(positive_int, "lengths"), metavar="N,N",
                        help=f"needle haystack lengths in tokens (default: {_joined(defaults.lengths)})")
    parser.add_argument("--depths", type=_number_list(finite_float, "depths"), metavar="D,D",
                        help=f"needle depths, 0 (start) to 1 (end) (default: {_joined(defaults.depths)})")
    parser.add_argument("--needles", type=_number_list(str, "needle ids"), metavar="ID,ID",
                        help=f"shipped needles (attnscope.data.needles()) (default: {_joined(defaults.needles)})")
    parser.add_argument("--new-tokens", type=positive_int, default=defaults.new_tokens, metavar="N",
                        help=f"the most tokens a needle answer may have (default: {defaults.new_tokens})")
    parser.add_argument("--loss-pieces", type=positive_int, default=defaults.loss_pieces, metavar="N",
                        help=f"loss: pieces of the shipped documents (default: {defaults.loss_pieces})")
    parser.add_argument("--loss-tokens", type=positive_int, metavar="N",
                        help="loss: tokens per piece (default: the longest haystack)")
    parser.add_argument("--runs", type=Path, metavar="FILE.jsonl", help="keep every run of the curve in FILE as it "
                        "ends; the same command given the same FILE again reads back what was done and runs only the "
                        "rest (a curve of hours that stopped resumes; runs under other settings are not read back)")
    add_compute_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the table and the records as one JSON object")
    parser.add_argument("--png", type=Path, metavar="FILE.png", help="draw the curve (accuracy and loss against "
                        "the share, one line per choice)")
    parser.add_argument("--html", type=Path, metavar="FILE.html", help="a page with the facts, the curve (drawn "
                        "beside it as FILE.png) and the table")


def _joined(values: tuple[Any, ...]) -> str:
    return ",".join(map(str, values))


def settings_from(args: argparse.Namespace) -> CurveSettings:
    """The settings the options ask for (an option left out keeps the dataclass's default)."""
    from ..experiments.kv_curve import CurveSettings

    given: dict[str, Any] = {name: getattr(args, name) for name in ("shares", "lengths", "depths", "needles")
                             if getattr(args, name) is not None}
    return CurveSettings(**given, draws=args.draws, seed=args.seed, sink=args.sink, window=args.window,
                         new_tokens=args.new_tokens, loss_pieces=args.loss_pieces, loss_tokens=args.loss_tokens)


def _figures(args: argparse.Namespace) -> list[Path | None]:
    """Every file the options ask for: the PNG, the page and the page's figure."""
    for path, suffix in ((args.png, ".png"), (args.html, ".html")):
        if path is not None and path.suffix.lower() != suffix:
            raise AttnscopeError(f"{path}: give a {suffix} file name")
    return [args.png, args.html, args.html.with_suffix(".png") if args.html is not None else None]


def _run(args: argparse.Namespace) -> int:
    from ..capture.kv_budget import read_scores
    from ..capture.loading import load_model
    from ..experiments.kv_curve import check_curve_settings, check_runs, kv_budget_curve
    from .outputs import output_files, writing

    settings = settings_from(args)
    check_curve_settings(settings)
    scores = read_scores(args.scores) if args.scores is not None else None
    if args.runs is not None:
        check_runs(args.runs)
    with output_files(*_figures(args)):
        loaded = load_model(args.model, dtype=args.dtype, device=args.device)
        curve = kv_budget_curve(loaded, scores, settings, apply=args.apply, progress=True, runs=args.runs)
        written = []
        if args.png is not None:
            with writing(args.png):
                curve.plot(args.png)
                written.append(f"figure: {args.png}")
        if args.html is not None:
            with writing(args.html):
                written.append(f"page: {curve.write_html(args.html)}")
    if args.json:
        print(json.dumps(curve.to_dict(), ensure_ascii=False))
    else:
        _print(curve)
    for line in written:
        print(line, file=sys.stderr if args.json else sys.stdout)
    return 0


def _print(curve: KVCurve) -> None:
    from rich.console import Console
    from rich.table import Table

    print(f"{curve.model}: needle trials answered with full attention {curve.trials} of {curve.asked}; KV bytes at "
          f"{curve.kv_tokens} tokens (full: {curve.full_bytes:,}); streaming heads keep the first {curve.settings.sink} "
          f"+ {curve.settings.window} most recent keys; applied as {APPLIED[curve.applied]}; random: mean over "
          f"{curve.settings.draws} draws [95% interval]; peak RSS: the point's highest, the model's weights included")
    table = Table()
    for name in ("share", "choice", "full KV heads", "needle accuracy", "loss", "KV bytes", "saving", "peak RSS MB"):
        table.add_column(name)
    for row in curve.to_frame().itertuples():
        table.add_row(f"{row.share:g}", row.choice, str(row.full_kv_heads),
                      _with_interval(row.accuracy, row.accuracy_low, row.accuracy_high),
                      _with_interval(row.loss, row.loss_low, row.loss_high), f"{row.kv_bytes:,}",
                      f"{row.kv_saving:.2f}x", "-" if math.isnan(row.peak_rss_mb) else f"{row.peak_rss_mb:,.0f}")
    console = Console()
    (console if console.is_terminal else Console(width=WIDE)).print(table)  # a pipe's 80 columns fold the intervals


APPLIED = {"cache": "a budgeted cache", "mask": "a mask on a full cache"}
WIDE = 160  # characters: the table with intervals on one line each


def _with_interval(mean: float, low: float, high: float) -> str:
    return f"{mean:.3f}" if math.isnan(low) else f"{mean:.3f} [{low:.3f}, {high:.3f}]"  # NaN bounds: no interval


EXAMPLES = """examples:
  attnscope kv-budget smollm2 --lengths 512 --shares 0,0.25,0.5,1 --png smollm2-kv.png
  attnscope head-functions -m qwen0.5b -s retrieval -s locality --sinks 4 --windows 64 --save qwen-heads.parquet
  attnscope kv-budget qwen0.5b --scores qwen-heads.parquet --lengths 1024,2048 --html qwen-kv.html
A KV head is full (every key) or streaming (the first --sink keys + the --window most recent) as a whole; only the
global layers' KV heads are chosen (a sliding-window layer keeps its own window). A budget runs as a budgeted cache
(--apply cache, the default: it stores only the kept keys) or as a mask on a full cache (--apply mask, the
reference); the two give the same tokens. Peak RSS per point includes the model's weights. Layers and heads are
0-indexed.
"""

COMMANDS = (
    Command("kv-budget", "needle accuracy, loss and KV bytes against the share of full KV heads (retrieval, "
            "streaming, random, uniform choices)", EXAMPLES, _arguments, _run),
)
