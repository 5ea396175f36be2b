"""Command-line options that build a :class:`~attnscope.capture.plan.CapturePlan` (shared by commands)."""

from __future__ import annotations

import argparse

from ..errors import AttnscopeError
from .plan import DEFAULT_CHUNK, QUERY_SPECS, CapturePlan, QuerySelection

PLAN_HELP = """what to keep (long inputs: the full matrix grows with tokens squared):
  --layers/--heads/--queries select; --stats, --top-k and --overview keep figures instead of rows
  (add --rows to keep the selected rows as well); nothing given keeps everything."""


MAX_INDEX = 65_535  # above any model's layers and heads: a range beyond it (0-9999999999) is refused, not built


def number_list(value: str) -> tuple[int, ...]:
    """``"0,3,5"`` or ``"0-5"`` (inclusive) or a mix -> sorted unique 0-indexed layers or heads (at most
    :data:`MAX_INDEX`; the model's own count is checked once it is loaded)."""
    return bounded_numbers(value, highest=MAX_INDEX, what="layers and heads")


def bounded_numbers(value: str, *, highest: int, what: str, most: int | None = None) -> tuple[int, ...]:
    """:func:`number_list`'s parse of ``value``, refusing a number above ``highest`` and more than ``most``
    numbers (default ``highest + 1``) before any range is built; ``what`` names them in the refusal."""
    try:
        spans = [range(int(first), int(last if dash else first) + 1)
                 for first, dash, last in (part.strip().partition("-") for part in value.split(",") if part.strip())]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 0,3,5 or 0-5, got {value!r}") from None
    spans = [span for span in spans if span]
    if not spans:
        raise argparse.ArgumentTypeError(f"expected at least one number, got {value!r}")
    largest, count, most = max(span[-1] for span in spans), sum(map(len, spans)), most or highest + 1
    if largest > highest:
        raise argparse.ArgumentTypeError(f"{what} go up to {highest}, got {largest}")
    if count > most:
        raise argparse.ArgumentTypeError(f"at most {most:,} {what}, got {count:,} in {value!r}")
    return tuple(sorted(set().union(*spans)))


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
