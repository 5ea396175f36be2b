"""What the command line and the explorer parse for capture: lists of layers and heads, which prompt rows a
generation keeps (the options that build a capture plan are :mod:`attnscope.cli.plan_options`)."""

from __future__ import annotations

import argparse

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


# the names the CLI (--prompt-rows) and the explorer (prompt_rows) give generate(prompt_rows=...)
PROMPT_ROWS = {"auto": None, "all": True, "last": False}
PROMPT_ROWS_HELP = ("which prompt positions keep their attention row. 'last': only the prompt's last (the one that "
                    "chose the first new token); every step's row is kept either way, so the steps shown are the "
                    "same, and a long prompt (a whole context window) costs memory in proportion to its length, not "
                    "its square. 'all': every prompt row, for a full [layer, head, T, T] record. 'auto' (default): "
                    "all while they stay small (about 1,000 tokens of SmolLM2), else last")
