"""Argument types and options shared by every command, so each number is checked the same way.

An argparse ``type`` that rejects a value makes the CLI print one ``attnscope: error:`` line and
exit 2 before any work starts.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable
from pathlib import Path

from .errors import AttnscopeError


def positive_int(value: str) -> int:
    """An integer of at least 1 (sizes, counts, lengths)."""
    number = _int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return number


def non_negative_int(value: str) -> int:
    """An integer of at least 0 (0-indexed layers and heads, resample counts)."""
    number = _int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or a positive integer, got {value}")
    return number


# more than any machine's cores: past it OpenMP is asked for absurd thread counts (and past 2**63, torch overflows)
MAX_THREADS = 1024


def thread_count(value: str) -> int:
    """``--threads`` and ``$ATTNSCOPE_THREADS``: torch's CPU threads, 1 to :data:`MAX_THREADS`."""
    number = positive_int(value)
    if number > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_THREADS} threads, got {value}")
    return number


MAX_SEED = 2**32 - 1  # numpy's classic bound; a training seed times 1000 plus the epoch still fits torch's 64 bits


def seed(value: str) -> int:
    """A random seed, 0 to :data:`MAX_SEED` (torch's ``manual_seed`` overflows on larger numbers)."""
    number = non_negative_int(value)
    if number > MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected a seed of at most {MAX_SEED}, got {value}")
    return number


def finite_float(value: str) -> float:
    """A float that is not nan or infinite."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {value}")
    return number


# sampling options: name -> (rule, what it asks); checked the same way by generate() and the CLI's types
SAMPLING_RULES = {
    "temperature": (lambda value: value > 0, "more than 0"),
    "top_p": (lambda value: 0 < value <= 1, "more than 0 and at most 1"),
    "top_k": (lambda value: value >= 1, "at least 1"),
}


def check_sampling(**options: float | None) -> None:
    """Refuse a sampling option (``temperature``, ``top_p``, ``top_k``; None: not set) out of its range."""
    for name, value in options.items():
        rule, wanted = SAMPLING_RULES[name]
        if value is not None and not (math.isfinite(value) and rule(value)):
            raise AttnscopeError(f"{name} must be {wanted}, got {value}")


def temperature(value: str) -> float:
    """argparse type of ``--temperature``: a number above 0."""
    return _sampling_option("temperature", finite_float(value))


def top_p(value: str) -> float:
    """argparse type of ``--top-p``: a number in (0, 1]."""
    return _sampling_option("top_p", finite_float(value))


def _sampling_option(name: str, number: float) -> float:
    try:
        check_sampling(**{name: number})
    except AttnscopeError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return number


def index_list(value: str) -> list[int]:
    """Comma-separated 0-indexed layers or heads, at least one: ``"0,5"`` -> ``[0, 5]``."""
    parts = [part for part in value.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated 0-indexed numbers like 0,5, got {value!r}")
    return [non_negative_int(part.strip()) for part in parts]


def check_indices(numbers: Iterable[int] | None, limit: int, noun: str, option: str = "") -> None:
    """Refuse any of ``numbers`` (0-indexed layers or heads; None: all) outside ``0..limit - 1``
    with one line naming ``option``; call it once the model is known, before any slow work."""
    bad = [number for number in numbers or () if not 0 <= number < limit]
    if bad:
        raise AttnscopeError(f"{option + ': ' if option else ''}{noun} {bad[0]} does not exist: the model has "
                             f"{limit} {noun}s (0-indexed: 0-{limit - 1})")


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None


def add_output_folder(parser: argparse.ArgumentParser, default: str, holds: str) -> None:
    """``--out/-o FOLDER`` and ``--overwrite``, for commands that fill a folder (see :mod:`attnscope.cli.outputs`)."""
    parser.add_argument("--out", "-o", type=Path, default=Path(default),
                        help=f"folder for {holds} (default: ./{default}); it must be new or empty")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the files an earlier attnscope run wrote in the folder (listed in its "
                        "attnscope-manifest.json); other files are never removed")
