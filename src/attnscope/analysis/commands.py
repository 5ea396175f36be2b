"""``attnscope patterns``, ``heads`` and ``sinks``: thin wrappers around the analysis functions."""

from __future__ import annotations

import argparse
import json
import re
import textwrap
from pathlib import Path

from ..arguments import add_output_folder, finite_float, positive_int
from ..cli import Command, add_model_arguments, load_from_args
from ..corpus.engines import add_engine_arguments, engine_from_args
from ..errors import AttnscopeError
from .patterns import EVIDENCE, PATTERNS, STABLE_SHARE
from .sinks import DEFINITION, SINK_FACTOR
from .stats import describe_statistics, statistic_names

DEFAULT_OUT = Path("report")
RANKABLE = [*statistic_names(norms=True), "confidence", *(f"ev_{name}" for name in EVIDENCE)]


# ---- patterns -------------------------------------------------------------------------------
def _patterns_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", nargs="?", help="the text (first sentence)")
    parser.add_argument("--pair", "-p", help="second sentence")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--evaluate", action="store_true",
                        help="score the classifier on the synthetic and the labelled real maps (needs the default "
                        "model) instead of classifying TEXT")
    add_model_arguments(parser)


def _run_patterns(args: argparse.Namespace) -> int:
    if args.evaluate:
        return _run_evaluation(args)
    if args.text is None:
        raise AttnscopeError("give a TEXT to classify, or --evaluate")
    from ..capture.extract import extract
    from ..capture.tokens import split_item
    from .patterns import classify_heads

    split_item((args.text, args.pair), 0)  # reject bad input before the model loads
    record = extract(load_from_args(args), args.text, args.pair)
    patterns = classify_heads(record)
    if args.json:
        print(patterns.to_frame().to_json(orient="records"))
        return 0
    info = record.model
    print(f"model {info.name}: {info.n_layers} layers x {info.n_heads} heads, {len(record.tokens)} tokens"
          f"{' (causal templates)' if info.causal else ''}\n")
    print(patterns.to_text())
    return 0


def _run_evaluation(args: argparse.Namespace) -> int:
    from ..capture.extract import extract_corpus
    from ..models.registry import DEFAULT_MODEL
    from .evaluate import count_patterns, evaluate_stability, evaluation_summary, real_labels, stability_texts

    if args.model != DEFAULT_MODEL:
        raise AttnscopeError(f"the labelled real maps are of the default model; drop --model (got {args.model!r})")
    maps = real_labels()
    loaded = load_from_args(args)
    records = list(extract_corpus(loaded, [(m.text, m.pair) for m in maps], progress=False))
    summary = evaluation_summary(records, maps)
    deciding, held_out = (count_patterns(extract_corpus(loaded, [(text, None) for text in texts], progress=False))
                          for texts in stability_texts(maps))
    summary["stability"] = evaluate_stability(deciding, held_out)
    if args.json:
        print(json.dumps(summary))
        return 0
    print(f"synthetic set: macro-F1 {summary['synthetic_macro_f1']:.3f} over {summary['n_synthetic']} maps "
          f"(bidirectional {summary['synthetic_macro_f1_by_kind']['bidirectional']:.3f}, "
          f"causal {summary['synthetic_macro_f1_by_kind']['causal']:.3f})")
    print(f"real set: macro-F1 {summary['real_macro_f1']:.3f} over {summary['n_real']} labelled maps of the default "
          f"model (first labelling pass: {summary['real_macro_f1_first_pass']:.3f}; held-out batch: "
          f"{summary['real_macro_f1_heldout']:.3f} over {summary['n_real_heldout']} maps)")
    agreement = summary.get("real_labeller_agreement")
    if agreement:
        print(f"two labellers on the same {agreement['n']} maps: {agreement['accuracy']:.0%} alike, kappa "
              f"{agreement['kappa']:.2f}, macro-F1 {agreement['macro_f1']:.3f} one against the other (what the "
              f"labels leave open); the classifier against the second: {summary['real_macro_f1_vs_second']:.3f}")
    print(f"the same as Kovaleva et al.'s five types: synthetic {summary['synthetic_kovaleva_macro_f1']:.3f}, "
          f"real {summary['real_kovaleva_macro_f1']:.3f}")
    stability = summary["stability"]
    print(f"stable heads ({stability['stable_rule']}, {stability['n_stability_deciding']} Brown sentences): "
          f"{stability['n_stable_heads']} of {stability['n_heads']}; on {stability['n_stability_heldout']} held-out "
          f"sentences they keep their label on {_share(stability['stable_heldout_share'])} of inputs (all heads' "
          f"most common label: {_share(stability['heldout_modal_share_all'])})\n")
    for name in ("synthetic", "real"):
        print(f"{name}: {'class':26s} precision recall    f1  support")
        for label, values in summary[f"{name}_per_class"].items():
            print(f"{'':{len(name) + 2}}{label:26s} {values['precision']:9.2f} {values['recall']:6.2f} "
                  f"{values['f1']:5.2f} {values['support']:8d}")
        print()
    return 0


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


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
    from ..outputs import output_folder
    from .store import DEFAULT_DB, HeadStore

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
    report = analyze_heads(args.corpus, args.out, model=args.model, dtype=args.dtype, engine=engine.name,
                           batch_size=args.batch_size, limit=args.limit, skip_bad=args.on_bad_line == "skip",
                           num_actors=engine.num_actors, address=engine.address, stall_s=engine.stall_s,
                           verbose=engine.verbose, runtime_env=engine.runtime_env)
    for bad in report.skipped:
        print(f"attnscope: skipped {bad.message}", file=sys.stderr)
    skipped = f", skipped {len(report.skipped)} malformed line(s)" if report.skipped else ""
    print(f"analysed {report.n_inputs} inputs with {report.model} in {time.perf_counter() - start:.0f} s "
          f"({report.engine} engine{skipped}; layers and heads 0-indexed)")
    print(f"report:   {report.html}\ndatabase: {report.database}")
    stable = report.patterns.stable
    print(f"stable heads (most common label on >= {STABLE_SHARE:.0%} of inputs): {int(stable.sum())} of {stable.size}")
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
    from tqdm.auto import tqdm

    from ..capture.extract import extract_corpus
    from ..capture.tokens import split_item
    from ..corpus.report import corpus_items
    from ..outputs import output_folder
    from .sinks import sink_report

    engine = engine_from_args(args)
    with output_folder(args.out, overwrite=args.overwrite, command="sinks"):
        if engine.name == "ray":
            from ..corpus.distributed import sinks_on_ray

            report = sinks_on_ray(args.corpus, model=args.model, dtype=args.dtype, batch_size=args.batch_size,
                                  limit=args.limit, factor=args.factor, engine=engine)
        else:
            items = corpus_items(args.corpus, args.limit)
            for index, item in enumerate(items):
                split_item(item, index)  # reject bad input before the model loads
            records = extract_corpus(load_from_args(args), items, batch_size=args.batch_size, norms=True,
                                     progress=False)
            report = sink_report(tqdm(records, total=len(items), desc="sinks", unit="input"), factor=args.factor)
        json_path = report.save(args.out / "sinks.json")
        figure_path = args.out / "sinks.png"
        report.plot(figure_path)
    if args.json:
        print(json.dumps(report.to_dict()))
        return 0
    print(report.to_text())
    print(f"wrote {json_path} and {figure_path}")
    return 0


_PATTERN_LIST = ", ".join(PATTERNS)
_METRICS = "\n".join(f"  {name:22s} {text}" for name, text in describe_statistics().items())

COMMANDS = (
    Command("patterns", "classify what every head does (Kovaleva's types, Vig's patterns)", f"""labels: {_PATTERN_LIST}
examples:
  attnscope patterns "I went to the store." --pair "At the store, I bought fresh strawberries."
  attnscope patterns "The cat sat on the mat." --model smollm2      # causal templates
  attnscope patterns "The cat sat." --json
  attnscope patterns --evaluate --json        # precision/recall/F1 on the synthetic and labelled real maps""",
            _patterns_arguments, _run_patterns),
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
