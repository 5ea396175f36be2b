"""``attnscope head-functions``: what each head is for (induction, previous-token, duplicate-token, echo,
locality / streaming, receiver, and any score registered later), per head and per KV group; parses, calls
:func:`attnscope.head_scores`, prints and writes. The score choices and their help come from the registry
(:func:`attnscope.analysis.head_functions.head_functions`)."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..analysis.head_functions import head_functions
from ..arguments import finite_float, non_negative_int, positive_int, seed
from ..errors import AttnscopeError
from .command import Command
from .engine_options import add_engine_arguments, engine_from_args
from .model_options import add_compute_arguments

if TYPE_CHECKING:
    from ..analysis.head_functions import HeadScores
    from ..corpus.engine_choice import Engine
    from ..experiments.head_functions import HeadScoreSettings

DEFAULT_MODEL = "smollm2"  # the scores need a decoder; the package's default model is an encoder
ALL = "all"
FIGURE_SUFFIXES = (".png", ".svg", ".pdf")


def _number_list(kind: Any, what: str) -> Any:
    """An argparse type: ``16,64,256`` -> ``(16, 64, 256)``, each read by ``kind`` (sorted, each once)."""
    def parse(value: str) -> tuple[Any, ...]:
        parts = [part.strip() for part in value.split(",") if part.strip()]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected {what} separated by commas, got {value!r}")
        return tuple(sorted({kind(part) for part in parts}))
    return parse


# HeadScoreSettings field -> (argparse type, metavar, help); the defaults are the dataclass's own. Bounds that
# depend on the scores asked for (a period of at least 2, a share in (0, 1]) are check_bounds', before the model loads
SETTINGS: dict[str, tuple[Any, str, str]] = {
    "period": (positive_int, "N", "repeated tokens: the length of the random block"),
    "repeats": (positive_int, "N", "repeated tokens: how many copies of the block"),
    "sequences": (positive_int, "N", "repeated tokens: how many random sequences are averaged"),
    "seed": (seed, "N", "repeated tokens: the random seed"),
    "max_tokens": (positive_int, "N", "documents are cut at this many tokens (default: 2,048 or the model's limit)"),
    "sinks": (_number_list(non_negative_int, "sink sizes"), "K,K", "locality: sizes k of the first-k key cache"),
    "windows": (_number_list(positive_int, "window sizes"), "W,W", "locality: sizes w of the recent-w key cache"),
    "share": (finite_float, "S", "locality: the share of a row the smallest window must keep"),
    "every": (positive_int, "N", "locality: score every N-th query of a document"),
    "chunk": (positive_int, "N", "documents: queries scored at a time, which bounds memory"),
    "needles": (_number_list(str, "needle ids"), "ID,ID", "retrieval: shipped needles (attnscope.data.needles())"),
    "needle_lengths": (_number_list(positive_int, "lengths"), "N,N", "retrieval: haystack lengths in tokens"),
    "needle_depths": (_number_list(finite_float, "depths"), "D,D", "retrieval: needle depths, 0 (start) to 1 (end)"),
    "needle_document": (str, "NAME", "retrieval: the shipped document the haystacks are cut from"),
    "needle_form": (str, "FORM", "retrieval: prompt form, plain or chat (default: the model's own)"),
    "needle_new_tokens": (positive_int, "N", "retrieval: the most tokens an answer may have"),
}


def _arguments(parser: argparse.ArgumentParser) -> None:
    from ..experiments.head_functions import DEFAULT_SCORES, HeadScoreSettings

    parser.epilog = EXAMPLES + _scores_help()  # the registry as it is now: a score registered later is listed
    names = [function.name for function in head_functions()]
    parser.add_argument("--score", "-s", action="append", choices=[*names, ALL], metavar="NAME",
                        help=f"a score to compute (repeat it for several): {', '.join(names)} or {ALL} (default: "
                        f"{', '.join(DEFAULT_SCORES)})")
    parser.add_argument("--model", "-m", default=DEFAULT_MODEL,
                        help=f"a decoder: alias, local folder, .gguf file or cached repo id (default: {DEFAULT_MODEL})")
    add_compute_arguments(parser)
    add_engine_arguments(parser, runs="the needle trials of retrieval")
    defaults = HeadScoreSettings()
    for name, (kind, metavar, text) in SETTINGS.items():
        default = getattr(defaults, name)
        shown = "" if default is None else f" (default: {','.join(map(str, default)) if isinstance(default, tuple) else default})"
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, metavar=metavar, help=text + shown)
    parser.add_argument("--document", action="append", metavar="NAME|FILE",
                        help="locality and receiver: a shipped document (attnscope.data.documents()) or a UTF-8 text "
                        f"file; repeat for several (default: {', '.join(defaults.documents)})")
    parser.add_argument("--top", type=positive_int, default=5, help="heads listed per score (default: 5)")
    parser.add_argument("--json", action="store_true", help="print the table (per head and per KV group) as one JSON "
                        "object")
    parser.add_argument("--save", type=Path, metavar="FILE.parquet", help="write the table to a Parquet file")
    parser.add_argument("--per", choices=["head", "kv_head"], default="head",
                        help="--save: one row per query head (default) or per KV group (<score>_max, <score>_mean)")
    parser.add_argument("--store", type=Path, metavar="DB.duckdb",
                        help="write the rows into a DuckDB store (e.g. the heads.duckdb of 'attnscope heads', beside "
                        "its head labels): tables head_functions and head_function_groups")
    parser.add_argument("--png", type=Path, metavar="FILE", help="draw a layers x heads grid per score column "
                        "(.png, .svg or .pdf)")


def settings_from(args: argparse.Namespace) -> HeadScoreSettings:
    """The settings the options ask for (an option left out keeps the dataclass's default)."""
    from ..experiments.head_functions import HeadScoreSettings

    given: dict[str, Any] = {name: getattr(args, name) for name in SETTINGS if getattr(args, name) is not None}
    if args.document:
        given["documents"] = tuple(_document(value) for value in args.document)
    return HeadScoreSettings(**given)


def _document(value: str) -> str:
    """A shipped document's name as it is, a file's text otherwise."""
    from ..data import documents
    from ..inputs import read_document

    return value if value in documents() else read_document(Path(value))


def score_names(args: argparse.Namespace) -> list[str]:
    from ..experiments.head_functions import DEFAULT_SCORES

    asked = args.score or list(DEFAULT_SCORES)
    return [function.name for function in head_functions()] if ALL in asked else list(dict.fromkeys(asked))


def _check_outputs(args: argparse.Namespace) -> None:
    from ..analysis.store import check_head_store

    if args.save is not None and args.save.suffix.lower() != ".parquet":
        raise AttnscopeError(f"--save writes Parquet: give a .parquet file name, not {args.save}")
    if args.png is not None and args.png.suffix.lower() not in FIGURE_SUFFIXES:
        raise AttnscopeError(f"cannot tell the format of {args.png}: use a .png, .svg or .pdf file name")
    if args.store is not None:
        check_head_store(args.store)


def _check_engine(engine: Engine, names: list[str]) -> None:
    """The Ray engine runs needle trials only: refused without a score that needs them, or without Ray."""
    from ..corpus.ray_engine import ray_module

    if engine.name != "ray":
        return
    if not any(function.task == "needles" for function in head_functions() if function.name in names):
        raise AttnscopeError("--engine ray runs the needle trials of retrieval (-s retrieval); the other scores run "
                             "here: leave out --engine ray")
    ray_module()  # not installed: one line naming the extra


def _run(args: argparse.Namespace) -> int:
    from ..capture.loading import load_model
    from ..experiments.head_functions import check_bounds, head_scores
    from .outputs import output_files

    names, settings = score_names(args), settings_from(args)
    check_bounds(names, settings)
    engine = engine_from_args(args)
    _check_engine(engine, names)
    _check_outputs(args)
    with output_files(args.save, args.store, args.png):
        loaded = load_model(args.model, dtype=args.dtype, device=args.device)
        if args.store is not None:
            from ..analysis.store import check_head_store

            check_head_store(args.store, loaded.name)
        scores = head_scores(loaded, names, settings, progress=True, engine=engine)
        written = _write(scores, args)
    if args.json:
        print(json.dumps(scores.to_dict(), ensure_ascii=False))
    else:
        _print(scores, args.top)
    for line in written:
        print(line, file=sys.stderr if args.json else sys.stdout)
    return 0


def _write(scores: HeadScores, args: argparse.Namespace) -> list[str]:
    """Write what the options ask for; one line per file written."""
    from .outputs import writing

    written = []
    if args.save is not None:
        with writing(args.save):
            written.append(f"table: {scores.save(args.save, args.per)}")
    if args.store is not None:
        from ..analysis.store import store_head_scores

        written.append(f"store: {store_head_scores(args.store, scores)} (tables head_functions, head_function_groups)")
    if args.png is not None:
        from ..present.figures import plot_head_scores, save_figure

        with writing(args.png):
            written.append(f"figure: {save_figure(plot_head_scores(scores), args.png)}")
    return written


def _print(scores: HeadScores, top: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    n_layers, n_heads = scores.shape
    print(f"{scores.model}: {n_layers} layers x {n_heads} heads ({scores.n_kv_heads} KV heads); layers and heads "
          "0-indexed")
    for column in scores.scores:
        table = Table(title=f"{column}: the {top} heads of largest value")
        for name in ("layer", "head", "kv head", "score", "layer's window"):
            table.add_column(name)
        for layer, head, value in scores.ranked(column, min(top, n_layers * n_heads)):
            table.add_row(str(layer), str(head), str(head // (n_heads // scores.n_kv_heads)), f"{value:.4f}",
                          str(scores.window(layer) or "global"))
        console.print(table)
    notes = {scores.note(layer) for layer in range(n_layers)} - {""}
    for note in sorted(notes):
        layers = [layer for layer in range(n_layers) if scores.note(layer) == note]
        print(f"layers {', '.join(map(str, layers))}: {note}")


def _scores_help() -> str:
    lines = []
    for function in head_functions():
        text = f"{function.name} ({function.task}): {function.reference} [{function.cited}]"
        lines.append(textwrap.fill(text, 116, initial_indent="  ", subsequent_indent="      "))
    return "\n".join(lines)


EXAMPLES = """examples:
  attnscope head-functions                                 # SmolLM2: induction, previous/duplicate token, echo, locality
  attnscope head-functions -s induction -s previous_token --period 32 --sequences 2 --top 10
  attnscope head-functions -m gemma3 -s locality --max-tokens 1024 --windows 16,64,256,512 --png gemma3-locality.png
  attnscope head-functions -s all --save smollm2-heads.parquet --json > smollm2-heads.json
  attnscope heads brown -m smollm2 -o report/ && attnscope head-functions --store report/heads.duckdb
  attnscope head-functions -s receiver --document speech.txt --max-tokens 4096
Layers and heads are 0-indexed; each score is given per query head, and per KV group as the max and mean over the
group's heads (a cache is kept per KV head). A sliding-window layer (Gemma 3's local layers) sees no key beyond its
window: the table's window and note columns say so, and --png marks such layers (wN).
Scores registered now (name (task): what it measures [whose definition]):
"""

COMMANDS = (
    Command("head-functions", "what each head is for: induction, previous-token, echo, locality, receiver, ... scores",
            EXAMPLES, _arguments, _run),
)
