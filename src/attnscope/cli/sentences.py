"""``attnscope sentences``: sentence-level attention, receiver heads and attention suppression (Bogdan et al.
2025, "Thought Anchors") of a text or a saved generation; parses, calls :func:`sentence_report`, prints."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..arguments import positive_int
from ..capture.options import number_list
from ..errors import AttnscopeError
from .command import Command
from .model_options import add_compute_arguments

FIGURE_SUFFIXES = (".png", ".svg", ".pdf")


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", nargs="?", help="the text (or --file, or --record)")
    parser.add_argument("--file", type=Path, help="read the text from this UTF-8 file (a long document)")
    parser.add_argument("--record", type=Path, help="a saved generation (attnscope generate --save FILE "
                        "--prompt-rows all) or record file: its prompt and generated text")
    parser.add_argument("--model", "-m", help="a decoder (default: smollm2, or the model of --record)")
    add_compute_arguments(parser)
    parser.add_argument("--proximity", type=positive_int, default=4,
                        help="a sentence's vertical score averages what sentences at least this many later give it "
                        "(default: 4, as Bogdan et al.)")
    parser.add_argument("--top", type=positive_int, default=10, help="receiver heads listed (default: 10)")
    parser.add_argument("--suppress", nargs="?", const=True, type=_sentence_list, metavar="SENTENCES",
                        help="also mask each sentence's keys for every later token and report the change of each "
                        "later token's log-probability: all (the default) or a list like 0,3 (0-indexed); one "
                        "forward pass per sentence")
    parser.add_argument("--max-tokens", type=positive_int, help="truncate the text to this many tokens")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("-o", "--output", type=Path, help="write a figure (.png, .svg or .pdf)")


def _sentence_list(value: str) -> bool | tuple[int, ...]:
    """``all`` -> True (every sentence), else a list like ``0,3`` or ``2-5``."""
    return True if value == "all" else number_list(value)


def _source(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The text, or the record loaded from ``--record`` (exactly one of TEXT, --file, --record)."""
    given = [name for name in ("text", "file", "record") if getattr(args, name) is not None]
    if len(given) != 1:
        raise AttnscopeError("give the text as an argument, --file FILE or --record FILE (one of them)")
    if args.text is not None:
        return args.text
    if args.file is not None:
        from ..inputs import read_document

        return read_document(args.file)
    from ..records.attention import AttentionRecord
    from ..records.generation import GenerationRecord

    try:
        return GenerationRecord.load(args.record)
    except AttnscopeError:
        return AttentionRecord.load(args.record)


def _run(args: argparse.Namespace) -> int:
    from ..capture.loading import load_model
    from .outputs import check_output_file, writing

    if args.output is not None:
        if args.output.suffix.lower() not in FIGURE_SUFFIXES:
            raise AttnscopeError(f"cannot tell the format of {args.output}: use a .png, .svg or .pdf file name")
        check_output_file(args.output)
    suppress = False if args.suppress is None else args.suppress
    source = _source(args)
    model = args.model or (source.model.name if not isinstance(source, str) else "smollm2")
    from ..experiments.sentences import sentence_report

    report = sentence_report(load_model(model, dtype=args.dtype, device=args.device), source,
                             proximity=args.proximity, suppress=suppress, max_length=args.max_tokens, progress=True)
    if args.output is not None:
        from ..present.figures import save_figure
        from ..present.sentences import plot_sentences

        with writing(args.output):
            print(f"figure: {save_figure(plot_sentences(report), args.output)}",
                  file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(report.to_json(args.top), ensure_ascii=False))
        return 0
    _print(report, args.top)
    return 0


def _print(report, top: int) -> None:  # type: ignore[no-untyped-def]
    from rich.console import Console
    from rich.table import Table

    sentences = report.attention.sentences
    table = Table(title=f"{len(sentences)} sentences (0-indexed)")
    for column in ("sentence", "part", "tokens", "text"):
        table.add_column(column)
    for index, ((start, stop), text) in enumerate(zip(sentences.spans, sentences.texts)):
        table.add_row(str(index), sentences.part(index), f"{start}-{stop - 1}", text.strip()[:80])
    console = Console()
    console.print(table)
    heads = Table(title=f"receiver heads: kurtosis of vertical scores (proximity {report.receivers.proximity})")
    for column in ("rank", "layer", "head", "kurtosis"):
        heads.add_column(column)
    for rank, (layer, head, kurtosis) in enumerate(report.receivers.ranked(top)):
        heads.add_row(str(rank), str(layer), str(head), f"{kurtosis:.3f}")
    console.print(heads)
    if report.suppression is not None:
        print("mean change of each sentence's token log-probabilities (rows) when a sentence is suppressed (columns):")
        print(report.suppression.matrix_frame().round(3).to_string())


COMMANDS = (
    Command("sentences", "sentence-level attention, receiver heads and attention suppression (Thought Anchors)",
            """examples:
  attnscope sentences "The cat sat. It was happy. Then it left. The dog came. It barked. Nobody came."
  attnscope sentences --file report.txt --json            # planned capture: [layer, head, S, S] at any length
  attnscope generate "Explain why the sky is blue." --chat -n 96 --prompt-rows all --save gen.safetensors
  attnscope sentences --record gen.safetensors --suppress -o sentences.png
Sentences end at . ! ? before whitespace, at newlines, special tokens and the prompt's end. The text's first token
is in no sentence: it is BOS, or, for a model without one, the token where attention sinks. Each sentence pair's
attention is the block mean of the token matrix (Bogdan et al. 2025); a sentence's vertical score is the mean it
receives from sentences at least --proximity later; receiver heads have the largest (Fisher) kurtosis of them.""",
            _arguments, _run),
)
