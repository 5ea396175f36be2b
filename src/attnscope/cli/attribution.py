"""Attribution commands: ``attnscope routes`` (information-flow routes of one prediction) and ``attnscope qk``
(why a head attends where it does: one score split into query x key component pairs)."""

from __future__ import annotations

import argparse
import json
import re
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



def head_spec(text: str) -> tuple[int, int]:
    """``"L:H"`` (0-indexed) -> ``(layer, head)``."""
    found = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if found is None:
        raise argparse.ArgumentTypeError(f"--head {text!r} is not LAYER:HEAD (0-indexed, e.g. 3:2)")
    return int(found.group(1)), int(found.group(2))


def _qk_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("text", help="the text (its tokens are the positions)")
    parser.add_argument("--head", type=head_spec, required=True, metavar="L:H",
                        help="the head, as LAYER:HEAD (0-indexed)")
    parser.add_argument("--query", type=int, default=-1, help="query position (0-indexed; negative from the end; "
                        "default: the last)")
    parser.add_argument("--key", type=int, required=True, help="key position (0-indexed; negative from the end)")
    parser.add_argument("--top", type=int, default=10, metavar="K", help="pairs to print (default: 10)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the whole result (both tables) as JSON")


def _run_qk(args: argparse.Namespace) -> int:
    from ..attribution.qk import qk_attribution
    from .outputs import check_output_file, writing

    if args.top < 1:
        raise AttnscopeError("--top must be at least 1")
    if not args.text.strip():
        raise AttnscopeError("the text is empty")
    if args.json is not None:
        check_output_file(args.json)  # before the model loads
    layer, head = args.head
    qk = qk_attribution(load_from_args(args), args.text, layer, head, args.query, args.key)
    tokens = qk.tokens
    print(f"{qk.model} L{layer}H{head} (0-indexed): query {qk.query} {tokens[qk.query]!r} -> key {qk.key} "
          f"{tokens[qk.key]!r}")
    print(f"score before the softmax {qk.score:.5f}; the {len(qk.query_components)} x {len(qk.key_components)} "
          f"table sums to {qk.total():.5f} (off by {abs(qk.total() - qk.score):.1e})")
    if qk.capped_score is not None:
        print(f"softcapped: the softmax sees {qk.capped_score:.5f}; no centred table (the cap is not linear)")
    _print_pairs(qk.top_pairs(args.top), "score terms (query component x key component)")
    total = qk.softmax_total()
    if total is not None and qk.row_term is not None:
        print(f"log attention {qk.log_attention:.5f} = centred table {total - qk.row_term:.5f} + row term "
              f"{qk.row_term:.5f} (off by {abs(total - qk.log_attention):.1e})")
        _print_pairs(qk.top_pairs(args.top, "centred"), "centred terms (what this key adds over the row's mean)")
    if args.json is not None:
        with writing(args.json):
            args.json.write_text(json.dumps(qk.to_dict()) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def _print_pairs(pairs: list[tuple[str, str, float]], title: str) -> None:
    print(f"top {len(pairs)} {title}:")
    width = max(len(query) for query, _, _ in pairs)
    for query, key, value in pairs:
        print(f"  {value:+10.5f}  {query:<{width}} x {key}")


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
    Command("qk", "why a head attends: split one attention score into query x key component pairs", """examples:
  attnscope qk --model smollm2 "The cat sat on the mat. The cat" --head 17:4 --query -1 --key 2
  attnscope qk --model gemma3 "One two three one two" --head 5:0 --key 2 --top 5 --json qk.json

Components: "embedding", "L3H2 (head)" (an earlier head's output), "L5 MLP", "L3 attention bias", "bias" (the
query/key projections' biases). Layers, heads and positions are 0-indexed.""", _qk_arguments, _run_qk),
)
