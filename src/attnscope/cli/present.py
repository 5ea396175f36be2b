"""``attnscope view`` and ``attnscope plot``: parse arguments, call one public function, write a file."""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ..analysis.mixing import measure_choices, measures_help
from ..arguments import non_negative_int
from ..capture.options import number_list
from ..capture.plan import LONG_VIEW_TOKENS, long_view_plan
from ..errors import AttnscopeError
from ..present.payload import VIEWS
from ..records.attention import ATTENTION_KINDS, AttentionRecord
from .command import Command
from .model_options import add_model_arguments, load_from_args

if TYPE_CHECKING:
    from ..analysis.mixing import Mixing
    from ..models.loading import LoadedModel


def _input_arguments(parser: argparse.ArgumentParser) -> None:
    """TEXT (with --pair and the model options) or --record FILE."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("text", nargs="?", help="the text (first sentence)")
    source.add_argument("--file", "-F", type=Path, help="a text file read as one input (e.g. a long document)")
    source.add_argument("--record", "-r", type=Path, help="a saved record (.safetensors from 'attnscope extract')")
    parser.add_argument("--pair", "-p", help="second sentence (encoders/decoders) or target text (encoder-decoders)")
    parser.add_argument("--max-tokens", type=int, help="truncate the input to this many tokens (default: the model's limit)")
    add_model_arguments(parser)


def _record_from_args(args: argparse.Namespace, qkv: bool, norms: bool, long: bool = False,
                      loaded: LoadedModel | None = None) -> AttentionRecord:
    """The record to draw: loaded (``--record``, lazily), or captured from TEXT / ``--file``.

    With ``long`` (or an input longer than :data:`LONG_VIEW_TOKENS`), the capture keeps what the
    long view draws, an overview and the top-k keys of every query, never the whole matrix.
    """
    if args.record is not None:
        if args.pair is not None:
            raise AttnscopeError("--pair goes with TEXT, not with --record")
        return AttentionRecord.open(args.record, values=True)  # what is drawn is checked as load checks it
    from ..capture.extract import extract
    from ..capture.tokens import split_item
    from ..inputs import read_document

    text = read_document(args.file) if args.file is not None else args.text
    split_item((text, args.pair), 0)  # reject bad input before the model loads
    loaded = loaded or load_from_args(args)
    plan = long_view_plan(loaded, text, args.pair, args.max_tokens, force=long,
                          layers=getattr(args, "layers", None), heads=getattr(args, "heads", None))
    if plan is not None:
        return extract(loaded, text, args.pair, plan=plan, max_length=args.max_tokens, progress=True)
    return extract(loaded, text, args.pair, qkv=qkv, norms=norms, max_length=args.max_tokens, progress=True)


# ---- view ------------------------------------------------------------------------------------
def _view_arguments(parser: argparse.ArgumentParser) -> None:
    _input_arguments(parser)
    parser.add_argument("--kind", "-k", choices=[*VIEWS, "all"], default="all",
                        help="which view(s): " + "; ".join(f"{name}: {text}" for name, text in VIEWS.items())
                        + " (default: all)")
    parser.add_argument("--no-norms", action="store_true",
                        help="leave out ||alpha f(x)|| (smaller file, no norm toggle)")
    parser.add_argument("--output", "-o", type=Path, default=Path("attnscope-views.html"),
                        help="the HTML file to write (default: attnscope-views.html)")
    parser.add_argument("--long", action="store_true",
                        help=f"the long view (zoomable heatmap, thumbnails, a window's lines) even for inputs of "
                        f"{LONG_VIEW_TOKENS} tokens or fewer; longer inputs always get it")
    parser.add_argument("--layers", type=number_list,
                        help="long view: only these 0-indexed layers, e.g. 0-5 (fewer heads leave the page room "
                        "for more of each query's strongest keys)")
    parser.add_argument("--heads", type=number_list, help="long view: only these 0-indexed heads")
    parser.add_argument("--measure", action="append", choices=measure_choices(), default=[],
                        help="add a context-mixing measure to the page's Measure control (repeatable): "
                        f"{measures_help()}; one map per layer and its rollout, computed on TEXT alone "
                        "(see attnscope mixing)")


def _check_measures(args: argparse.Namespace) -> list[str]:
    """The measures asked for, once each; one clear line for what cannot carry them (before the model loads)."""
    from ..analysis.mixing import method_names

    names = method_names(args.measure)
    if not names:
        return names
    if args.long or args.layers is not None or args.heads is not None:
        raise AttnscopeError("--measure draws in the head and model views; the long view (--long, --layers, --heads) "
                             "does not carry it")
    if args.record is not None and names != ["attention"]:
        raise AttnscopeError(f"--measure {' '.join(n for n in names if n != 'attention')} needs the model (it reads "
                             "each layer's input and layer norms), which a record file does not hold: give TEXT "
                             "(and --model) instead of --record")
    return names


def _mixing_for(args: argparse.Namespace, record: AttentionRecord, names: list[str],
                loaded: LoadedModel | None) -> list[Mixing]:
    """The measures ``names`` of the record's text: from the record for ``attention`` alone, else on the model."""
    if not names:
        return []
    from ..analysis.mixing import mixing_from_record
    from ..experiments.mixing import mixing_measures

    if args.record is not None:
        return [mixing_from_record(record, "attention")]
    if record.is_partial:
        raise AttnscopeError(f"--measure draws in the head and model views; this input has {len(record.tokens):,} "
                             f"tokens, over the {LONG_VIEW_TOKENS} the line views take")
    assert loaded is not None, "_run_view loads the model whenever measures come without --record"
    from ..capture.tokens import TruncationWarning

    with warnings.catch_warnings():  # the record's capture already said the text was cut
        warnings.simplefilter("ignore", TruncationWarning)
        return list(mixing_measures(loaded, record.text[0], names, progress=True, max_length=args.max_tokens).values())


def _run_view(args: argparse.Namespace) -> int:
    from ..present.html import view
    from .outputs import check_output_file, writing

    check_output_file(args.output)  # before the model loads
    measures = _check_measures(args)
    needs_vectors = args.kind in ("neuron", "all")
    loaded = load_from_args(args) if measures and args.record is None else None
    if loaded is not None and args.pair is not None and not loaded.is_encoder_decoder:
        raise AttnscopeError("--measure takes one text: leave out --pair (the measures are computed on TEXT alone)")
    with truncation_notes() as notes:
        record = _record_from_args(args, qkv=needs_vectors, norms=not args.no_norms, long=args.long, loaded=loaded)
    mixing = _mixing_for(args, record, measures, loaded)
    if record.is_partial:
        return _write_long_view(record, args.output, notes)
    page = view(record, args.kind, norms=not args.no_norms, mixing=mixing).with_notes(notes)
    with writing(args.output):
        path = page.save(args.output)
    size = path.stat().st_size / 1024
    print(f"wrote {path} ({size:,.0f} KB; {', '.join(page.views)} view{'s' if len(page.views) > 1 else ''}; "
          f"{len(record.tokens)} tokens{'; measures ' + ', '.join(measures) if measures else ''}; layers and heads "
          "0-indexed): open it in any browser, it works offline")
    for note in page.payload["notes"]:
        print(f"note: {note}")
    return 0


@contextmanager
def truncation_notes() -> Iterator[list[str]]:
    """Inside the block, truncation warnings are still shown and also kept (as lines for the page)."""
    from ..capture.tokens import TruncationWarning

    notes: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TruncationWarning)
        yield notes
    for warning in caught:
        if issubclass(warning.category, TruncationWarning):
            notes.append(f"the input was truncated: {warning.message}")
        warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)


def _write_long_view(record: AttentionRecord, output: Path, notes: list[str]) -> int:
    from ..present.longview import long_view_of

    page = long_view_of(record, progress=True).with_notes(notes)
    path = page.save(output)
    print(f"wrote {path} ({path.stat().st_size / 1e6:,.1f} MB; long view: heatmap, model view, window; "
          f"{len(record.tokens):,} tokens; layers and heads 0-indexed): open it in any browser, it works offline")
    for note in page.payload["notes"]:
        print(f"note: {note}")
    return 0


# ---- plot ------------------------------------------------------------------------------------
def _plot_arguments(parser: argparse.ArgumentParser) -> None:
    from ..present.figures import FIGURES

    _input_arguments(parser)
    parser.add_argument("--figure", "-f", choices=list(FIGURES), default="head",
                        help="; ".join(f"{name}: {text}" for name, text in FIGURES.items()) + " (default: head)")
    parser.add_argument("--layer", "-l", type=non_negative_int, help="layer, 0-indexed (head figure)")
    parser.add_argument("--head", type=non_negative_int, help="head, 0-indexed (head figure)")
    parser.add_argument("--attention", "-a", choices=ATTENTION_KINDS,
                        help="kind of attention (default: the input side's: self, or encoder for encoder-decoders)")
    parser.add_argument("--norms", action="store_true", help="draw ||alpha f(x)|| (Kobayashi et al. 2020) instead of alpha")
    parser.add_argument("--measure", choices=measure_choices(),
                        help="instead: a context-mixing measure aggregated by rollout through --layer (default: the "
                        f"last): {measures_help()} (see attnscope mixing)")
    parser.add_argument("--output", "-o", type=Path, default=Path("attnscope-head.png"),
                        help="the figure file; .png, .svg or .pdf (default: attnscope-head.png)")


def _run_plot(args: argparse.Namespace) -> int:
    from ..present.figures import plot, save_figure
    from .outputs import check_output_file, writing

    if args.output.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise AttnscopeError(f"cannot tell the format of {args.output}: use a .png, .svg or .pdf file name")
    check_output_file(args.output)
    if args.measure is not None and args.pair is not None:
        raise AttnscopeError("--measure takes one text; leave out --pair")
    if args.measure is None and args.figure == "head" and (args.layer is None or args.head is None):
        raise AttnscopeError("the head figure needs --layer and --head (0-indexed)")
    loaded = _checked_model(args)
    if args.measure is not None:
        figure = _measure_figure(args, loaded)
    else:
        record = _record_from_args(args, qkv=False, norms=args.norms, loaded=loaded)
        figure = plot(record, args.figure, layer=args.layer, head=args.head, kind=args.attention, norms=args.norms)
    with writing(args.output):
        print(f"wrote {save_figure(figure, args.output)}")
    return 0


def _checked_model(args: argparse.Namespace) -> LoadedModel | None:
    """The model of TEXT / ``--file`` (None with ``--record``), once ``--layer`` and ``--head`` are
    checked against it: before the capture and the measures, which take long on a long text."""
    if args.record is not None:
        return None
    from ..capture.tokens import split_item
    from ..experiments.interventions import check_layers_and_heads

    if args.file is None:
        split_item((args.text, args.pair), 0)  # reject bad input before the model loads
    loaded = load_from_args(args)
    chosen = [None if number is None else [number] for number in (args.layer, args.head)]
    check_layers_and_heads(loaded, *chosen, kind=None if args.measure else args.attention, options=("--layer", "--head"))
    return loaded


def _measure_figure(args: argparse.Namespace, loaded: LoadedModel | None):  # type: ignore[no-untyped-def]
    """The rollout of ``--measure`` through ``--layer`` (default: the last), from a record (attention
    only) or from TEXT / ``--file`` on ``loaded``."""
    from ..experiments.mixing import mixing
    from ..inputs import read_document

    if loaded is None:
        mix = mixing(AttentionRecord.open(args.record, values=True), method=args.measure)
    else:
        text = read_document(args.file) if args.file is not None else args.text
        mix = mixing(loaded, text, method=args.measure)
    if args.layer is not None and args.layer >= mix.n_layers:
        raise AttnscopeError(f"--layer must be between 0 and {mix.n_layers - 1}")
    return mix.plot(-1 if args.layer is None else args.layer)


COMMANDS = (
    Command("view", "write the interactive head, model and neuron views as one offline HTML file", """examples:
  attnscope view "I went to the store." --pair "At the store, I bought fresh strawberries." -o views.html
  attnscope view "The cat sat on the mat." --model smollm2 --kind head -o cat.html
  attnscope view --record records/record_000000.safetensors --kind model -o model.html
  attnscope view --model smollm2 --file long.txt -o long.html     # up to 8,192 tokens: the long view
  attnscope view "The cat sat on the mat." --long -o small-long.html
  attnscope view "The cat sat on the mat." --measure alti --measure value_zeroing -o mixing.html
  attnscope view --model smollm2 --file long.txt --layers 0-3 -o first-layers.html
Inputs over 512 tokens get the long view (a zoomable heatmap from a block-averaged overview and
each query's 32 strongest keys, thumbnails of every head, the lines of a window of tokens).
The file needs no network: scripts, styles and data are inside. Hover tokens, click heads
(double-click: only that head), export the current view as SVG or PNG. The Measure control
switches between attention, ||alpha f(x)|| and each --measure (one map per layer, or its rollout).""", _view_arguments, _run_view),
    Command("plot", "draw a static figure (heatmap of a head, layers x heads grid, token types) as PNG/SVG/PDF",
            """examples:
  attnscope plot "I went to the store." --layer 2 --head 0 -o head.png
  attnscope plot "I went to the store." --pair "At the store, I bought fresh strawberries." --figure grid -o grid.svg
  attnscope plot "The cat sat." --figure types -o types.pdf
  attnscope plot --record rec.safetensors --layer 0 --head 3 --norms -o norms.png
  attnscope plot "The cat sat on the mat." --measure alti -o alti.png       # ALTI rollout through the last layer
  attnscope plot "The cat sat on the" --model smollm2 --measure value_zeroing --layer 10 -o vz.png""",
            _plot_arguments, _run_plot),
)
