"""Command-line options that build a :class:`~attnscope.capture.plan.CapturePlan` (shared by commands)."""

from __future__ import annotations

import argparse

from ..errors import AttnscopeError
from .plan import DEFAULT_CHUNK, QUERY_SPECS, CapturePlan, QuerySelection

PLAN_HELP = """what to keep (long inputs: the full matrix grows with tokens squared):
  --layers/--heads/--queries select; --stats, --top-k and --overview keep figures instead of rows
  (add --rows to keep the selected rows as well); nothing given keeps everything."""


def number_list(value: str) -> tuple[int, ...]:
    """``"0,3,5"`` or ``"0-5"`` (inclusive) or a mix -> sorted unique numbers."""
    numbers: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in value.split(","))):
            first, dash, last = part.partition("-")
            numbers.update(range(int(first), int(last) + 1) if dash else [int(first)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 0,3,5 or 0-5, got {value!r}") from None
    if not numbers:
        raise argparse.ArgumentTypeError(f"expected at least one number, got {value!r}")
    return tuple(sorted(numbers))


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """``--layers --heads --queries --stats --top-k --overview --rows --chunk``."""
    group = parser.add_argument_group("what to keep", PLAN_HELP)
    group.add_argument("--layers", type=number_list, help="0-indexed layers to keep, e.g. 0,5 or 0-3 (default: all)")
    group.add_argument("--heads", type=number_list, help="0-indexed heads to keep (default: all)")
    group.add_argument("--queries", type=str, help=f"query positions to keep: {QUERY_SPECS} (default: all)")
    group.add_argument("--stats", action="store_true",
                       help="per query: mass on the first token (sink), special tokens, previous/next/own "
                       "position, entropy, mean distance; per head: a histogram of attention distance")
    group.add_argument("--top-k", type=int, default=0, metavar="K", help="per query: the K strongest keys and weights")
    group.add_argument("--overview", type=int, default=0, metavar="BLOCK",
                       help="the whole matrix averaged over blocks of BLOCK tokens (for the long views)")
    group.add_argument("--rows", action="store_true", help="with --stats/--top-k/--overview: keep the rows too")
    group.add_argument("--chunk", type=int, default=DEFAULT_CHUNK,
                       help=f"queries computed at a time (memory per layer grows with it; default {DEFAULT_CHUNK})")


def plan_from_args(args: argparse.Namespace) -> CapturePlan | None:
    """The plan the options ask for, or None for a plain full capture."""
    if args.top_k < 0 or args.overview < 0 or args.chunk < 1:
        raise AttnscopeError("--top-k and --overview must be >= 0 and --chunk >= 1")
    figures = args.stats or args.top_k or args.overview
    queries = QuerySelection.parse(args.queries) if args.queries else QuerySelection()
    plan = CapturePlan(layers=args.layers, heads=args.heads, queries=queries, attention=args.rows or not figures,
                       statistics=args.stats, top_k=args.top_k, overview=args.overview, chunk=args.chunk)
    return None if plan.keeps_everything and args.chunk == DEFAULT_CHUNK else plan


# the names the CLI (--prompt-rows) and the explorer (prompt_rows) give generate(prompt_rows=...)
PROMPT_ROWS = {"auto": None, "all": True, "last": False}
PROMPT_ROWS_HELP = ("which prompt positions keep their attention row. 'last': only the prompt's last (the one that "
                    "chose the first new token); every step's row is kept either way, so the steps shown are the "
                    "same, and a long prompt (a whole context window) costs memory in proportion to its length, not "
                    "its square. 'all': every prompt row, for a full [layer, head, T, T] record. 'auto' (default): "
                    "all while they stay small (about 1,000 tokens of SmolLM2), else last")
