"""``attnscope routes``: parse arguments, call :func:`attnscope.routes`, write the page (and the figure, the JSON)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..arguments import finite_float
from ..errors import AttnscopeError
from .command import Command
from .model_options import add_model_arguments, load_from_args

DEFAULT_TAU = 0.04  # attribution.routes.TAU, repeated so that --help imports no torch (a test holds them equal)


def _position(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token position (an integer, -1 = last), got {value!r}") from None


def _routes_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", help="the text whose prediction is traced (the model predicts the next token at "
                        "--position)")
    parser.add_argument("--position", "-p", type=_position, default=-1,
                        help="the position whose prediction is traced, 0-indexed; negative counts from the end "
                        "(default: -1, the last token)")
    parser.add_argument("--tau", type=finite_float, default=DEFAULT_TAU,
                        help="keep an edge when its importance (its share of the sum it joins, by the paper's "
                        f"L1 proximity) exceeds this; 0 <= tau < 1 (default: {DEFAULT_TAU}, the paper's)")
    parser.add_argument("-o", "--out", type=Path, default=Path("routes.html"),
                        help="the page to write: the figure and every kept edge (default: routes.html)")
    parser.add_argument("--png", action="store_true", help="also write the figure beside the page (OUT with .png)")
    parser.add_argument("--json", action="store_true", help="also write the graph as JSON beside the page "
                        "(OUT with .json: tokens, edges with importance and per-head split)")
    add_model_arguments(parser)


def _run_routes(args: argparse.Namespace) -> int:
    from ..attribution.routes import check_tau, routes
    from ..present.routes import save_routes_page

    check_tau(args.tau)  # a bad threshold fails before the model loads
    if not args.text.strip():
        raise AttnscopeError("the text is empty")
    if args.out.suffix.lower() not in (".html", ".htm"):
        raise AttnscopeError(f"-o names the page to write: use a .html file name, not {args.out.name!r}")
    graph = routes(load_from_args(args), args.text, position=args.position, tau=args.tau)
    written = [save_routes_page(graph, args.out)]
    if args.png:
        graph.plot(args.out.with_suffix(".png"))
        written.append(args.out.with_suffix(".png"))
    if args.json:
        written.append(graph.save(args.out.with_suffix(".json")))
    print(repr(graph))
    attention = sorted((e for e in graph.edges if e.via == "attention"), key=lambda e: -e.importance)[:5]
    if attention:
        print("strongest attention edges (layer: source -> query, importance, top head; 0-indexed):")
    for edge in attention:
        top = max(range(len(edge.heads)), key=lambda h: edge.heads[h])
        print(f"  layer {edge.target.layer}: {edge.source.position} {graph.tokens[edge.source.position]!r} -> "
              f"{edge.target.position} {graph.tokens[edge.target.position]!r}, {edge.importance:.3f}, head {top}")
    print(f"wrote {', '.join(str(path) for path in written)}")
    return 0


COMMANDS = (
    Command("routes", "information-flow routes (Ferrando & Voita 2024): which tokens, through which heads and layers, "
            "reached one prediction", """examples:
  attnscope routes --model smollm2 "The capital of France is"            # routes.html: the last token's route
  attnscope routes --model smollm2 "When Mary and John went to the store, John gave a drink to" --png --json
  attnscope routes --model gemma3 "The cat sat on the mat." --position 3 --tau 0.1 -o cat.html
how it works: at each layer, each part of the attention block's output (each source token through each head, and
the residual) and of the feed-forward block's (its output, the residual) gets its share of the whole by L1
proximity, max(0, |y|_1 - |y - part|_1), normalised; from the chosen position down, only edges above --tau are
followed, so only the rows a route reaches are computed (one forward pass, then the walk).
writes OUT (the figure: tokens on x, layers on y, width = importance, colour = top head; and the edge table),
with --png OUT.png, with --json OUT.json""", _routes_arguments, _run_routes),
)
