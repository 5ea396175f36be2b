"""The options that build a :class:`~attnscope.capture.plan.CapturePlan`: what a capture keeps."""

from __future__ import annotations

import argparse

from ..capture.options import number_list
from ..capture.plan import DEFAULT_CHUNK, QUERY_SPECS, CapturePlan, QuerySelection
from ..errors import AttnscopeError

PLAN_HELP = """what to keep (long inputs: the full matrix grows with tokens squared):
  --layers/--heads/--queries select; --stats, --top-k and --overview keep figures instead of rows
  (add --rows to keep the selected rows as well); nothing given keeps everything."""


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
