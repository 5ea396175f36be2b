"""``attnscope heads`` and ``sinks``: the corpus jobs, on the local engine or on Ray."""

from __future__ import annotations

import argparse
import json
import re
import textwrap
from pathlib import Path

from ..analysis.patterns import EVIDENCE, STABLE_SHARE
from ..analysis.sinks import DEFINITION, SINK_FACTOR
from ..analysis.stats import describe_statistics, statistic_names
from ..arguments import add_output_folder, finite_float, positive_int
from ..errors import AttnscopeError
from .command import Command
from .engine_options import add_engine_arguments, engine_from_args
from .model_options import add_model_arguments

DEFAULT_OUT = Path("report")
RANKABLE = [*statistic_names(norms=True), "confidence", *(f"ev_{name}" for name in EVIDENCE)]


# ---- heads ----------------------------------------------------------------------------------
def _layer_range(value: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", value)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a layer or a range like 3-5, got {value!r}")
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) else first
    if last < first:
        raise argparse.ArgumentTypeError(f"empty layer range {value!r}")
    return first, last


def _heads_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("corpus", nargs="*",
                        help="'brown' (2,000 sentences), 'brown-pairs' (500 pairs), or text files (one input per "
                        "line), .jsonl ({\"text\": ..., \"pair\": ...}), .parquet (text, pair columns) and folders of "
                        "them; omit to query an existing --db")
    add_output_folder(parser, str(DEFAULT_OUT), "report.html, the figures and heads.duckdb")
    parser.add_argument("--limit", type=positive_int, help="analyse only the first N inputs")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="inputs per forward pass (default: 32)")
    parser.add_argument("--on-bad-line", choices=["fail", "skip"], default="fail",
                        help="a malformed line (bad JSON, empty text, not UTF-8) stops the run (fail, the default) "
                        "or is left out (skip); either way its file and line are printed")
    add_engine_arguments(parser)
    parser.add_argument("--top", metavar="METRIC", choices=RANKABLE,
                        help="print the heads with the highest mean METRIC, e.g. sep, norm_cls, prev, entropy "
                        "(any statistic, confidence or ev_<evidence>)")
    parser.add_argument("-n", type=positive_int, default=10, help="how many heads --top prints (default: 10)")
    parser.add_argument("--layers", type=_layer_range, help="--top only in these layers, e.g. 3-5 (0-indexed)")
    parser.add_argument("--lowest", action="store_true", help="--top ranks from the lowest value")
    parser.add_argument("--db", type=Path, help="database to query (default: OUT/heads.duckdb), or a folder of its "
                        "tables as Parquet (what --engine ray writes into OUT/parquet/)")
    parser.add_argument("--sql", help="run this SQL on the database and print the result "
                        "(tables: head_stats, inputs, meta)")
    parser.add_argument("--parquet", type=Path, metavar="DIR",
                        help="export the database's tables to DIR/*.parquet (a new or empty folder; --overwrite "
                        "replaces an earlier export)")
    add_model_arguments(parser)


def _run_heads(args: argparse.Namespace) -> int:
    from ..analysis.store import DEFAULT_DB, HeadStore
    from .outputs import output_folder

    if not args.corpus and not (args.top or args.sql or args.parquet):
        raise AttnscopeError("give a CORPUS to analyse, or --top/--sql/--parquet to query a database")
    database = args.db or args.out / DEFAULT_DB
    if args.corpus:
        with output_folder(args.out, overwrite=args.overwrite, command="heads"):
            database = _write_report(args).database
    with HeadStore(database) as store:
        if args.top:
            _print_top(store, args)
        if args.sql:
            print(store.query(args.sql).to_string(index=False))
        if args.parquet:
            with output_folder(args.parquet, overwrite=args.overwrite, command="heads --parquet"):
                for path in store.export_parquet(args.parquet):
                    print(f"wrote {path}")
    return 0


def _write_report(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    import sys
    import time

    from ..corpus.engines import analyze_heads

    start = time.perf_counter()
    engine = engine_from_args(args)
    report = analyze_heads(args.corpus, args.out, model=args.model, dtype=args.dtype, device=args.device,
                           engine=engine.name, batch_size=args.batch_size, limit=args.limit,
                           skip_bad=args.on_bad_line == "skip", num_actors=engine.num_actors,
                           address=engine.address, stall_s=engine.stall_s, verbose=engine.verbose,
                           runtime_env=engine.runtime_env)
    for bad in report.skipped:
        print(f"attnscope: skipped {bad.message}", file=sys.stderr)
    skipped = f", skipped {len(report.skipped)} malformed line(s)" if report.skipped else ""
    print(f"analysed {report.n_inputs} inputs with {report.model} in {time.perf_counter() - start:.0f} s "
          f"({report.engine} engine{skipped}; layers and heads 0-indexed)")
    print(f"report:   {report.html}\ndatabase: {report.database}")
    stable = report.patterns.stable
    print(f"stable heads (most common label on >= {STABLE_SHARE:.0%} of inputs): {int(stable.sum())} of {stable.size}; "
          f"mixed (two labels carry that share): {int(report.patterns.mixed.sum())}")
    for finding in report.findings:
        heads = ", ".join(f"{h['layer']}-{h['head']}" for h in finding.heads) or "not measurable here"
        print(f"  {finding.pattern:26s} clearest heads (layer-head): {heads}")
    return report


def _print_top(store, args: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    frame = store.top(args.top, args.n, args.layers, ascending=args.lowest)
    scope = f" in layers {args.layers[0]}-{args.layers[1]}" if args.layers else ""
    print(f"heads by {'lowest' if args.lowest else 'highest'} mean {args.top}{scope} (layers and heads 0-indexed):")
    print(frame.to_string(index=False, float_format=lambda v: f"{v:.4f}"))


# ---- sinks ----------------------------------------------------------------------------------
def _sinks_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("corpus", help="'brown' (2,000 sentences), 'brown-pairs' (500 pairs), a text file (one input "
                        "per line) or .jsonl ({\"text\": ..., \"pair\": ...})")
    add_output_folder(parser, "sinks", "sinks.json and sinks.png")
    parser.add_argument("--limit", type=positive_int, help="measure only the first N inputs")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="inputs per forward pass (default: 16)")
    parser.add_argument("--factor", type=_above_one, default=SINK_FACTOR,
                        help=f"an other sink position receives at least this many times its uniform share "
                        f"(default: {SINK_FACTOR:g})")
    parser.add_argument("--json", action="store_true", help="print the report's JSON instead of the summary")
    add_engine_arguments(parser)
    add_model_arguments(parser)


def _above_one(value: str) -> float:
    number = finite_float(value)
    if number <= 1:
        raise argparse.ArgumentTypeError(f"expected a factor above 1, got {value}")
    return number


def _run_sinks(args: argparse.Namespace) -> int:
    from ..corpus.engines import corpus_sinks
    from .outputs import output_folder

    engine = engine_from_args(args)
    with output_folder(args.out, overwrite=args.overwrite, command="sinks"):
        report = corpus_sinks(args.corpus, model=args.model, dtype=args.dtype, device=args.device,
                              batch_size=args.batch_size, limit=args.limit, factor=args.factor, engine=engine)
        json_path = report.save(args.out / "sinks.json")
        figure_path = args.out / "sinks.png"
        report.plot(figure_path)
    if args.json:
        print(json.dumps(report.to_dict()))
        return 0
    print(report.to_text())
    print(f"wrote {json_path} and {figure_path}")
    return 0


_METRICS = "\n".join(f"  {name:22s} {text}" for name, text in describe_statistics().items())

COMMANDS = (
    Command("heads", "corpus report of every head: statistics, patterns, figures, DuckDB", """examples:
  attnscope heads brown -o report/                        # 2,000 Brown sentences: report/report.html + heads.duckdb
  attnscope heads brown-pairs --limit 200 -o pairs/
  attnscope heads sentences.txt --model smollm2 -o report-smollm2/
  attnscope heads corpus/ more.jsonl --on-bad-line skip -o report/   # a folder of .txt/.jsonl/.parquet files
  attnscope heads brown --engine ray --num-actors 2 -o report/       # Ray on this machine
  attnscope heads brown-57k.txt --engine ray --address auto -o report/  # on the cluster 'ray start' made
  attnscope heads --top sep --db report/parquet/                     # the Ray engine's Parquet folder
  attnscope heads --top sep --layers 3-5 --db report/heads.duckdb
  attnscope heads --top norm_cls -n 5
  attnscope heads --sql "SELECT layer, head, avg(sep) AS sep FROM head_stats WHERE layer BETWEEN 3 AND 5
                         GROUP BY ALL HAVING avg(sep) > 0.5 ORDER BY sep DESC"
  attnscope heads --parquet report/parquet/
metrics for --top (means over inputs; also confidence and ev_<evidence> of the pattern classifier):
""" + _METRICS, _heads_arguments, _run_heads),
    Command("sinks", "how much attention each head parks on the first token and other sink positions", f"""examples:
  attnscope sinks brown --model smollm2 --limit 200 -o sinks/   # sinks/sinks.json + sinks/sinks.png
  attnscope sinks sentences.txt --model gemma3 -o sinks-gemma3/
  attnscope sinks brown --limit 50 --json                       # the default encoder: its first token is [CLS]
  attnscope sinks corpus.txt --engine ray --address HEAD:6379 -o sinks/   # an actor pool on a Ray cluster
definitions (Xiao et al. 2023; norm-weighted as in Kobayashi et al. 2020):
{textwrap.fill(DEFINITION, 100, initial_indent="  ", subsequent_indent="  ")}""", _sinks_arguments, _run_sinks),
)
