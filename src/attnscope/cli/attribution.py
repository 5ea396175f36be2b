"""``attnscope qk``: why a head attends where it does (one score split into query x key component pairs)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from ..errors import AttnscopeError
from .command import Command
from .model_options import add_model_arguments, load_from_args


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
    Command("qk", "why a head attends: split one attention score into query x key component pairs", """examples:
  attnscope qk --model smollm2 "The cat sat on the mat. The cat" --head 17:4 --query -1 --key 2
  attnscope qk --model gemma3 "One two three one two" --head 5:0 --key 2 --top 5 --json qk.json

Components: "embedding", "L3H2 (head)" (an earlier head's output), "L5 MLP", "L3 attention bias", "bias" (the
query/key projections' biases). Layers, heads and positions are 0-indexed.""", _qk_arguments, _run_qk),
)
