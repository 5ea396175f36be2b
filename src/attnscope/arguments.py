"""Argument types and options shared by every command, so each number is checked the same way.

An argparse ``type`` that rejects a value makes the CLI print one ``attnscope: error:`` line and
exit 2 before any work starts.
"""

from __future__ import annotations

import argparse
import math
import operator
from collections.abc import Callable, Iterable
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
    return _as_argument(check_threads, positive_int(value))


def check_threads(threads: int, option: str = "") -> int:
    """``threads`` if it is an integer from 1 to :data:`MAX_THREADS`, else one line naming ``option``. The CLI's
    ``thread_count`` and the library functions that take a thread count share it."""
    return _bounded_int(threads, 1, MAX_THREADS, "a thread count", option)


MAX_SEED = 2**32 - 1  # numpy's classic bound; a training seed times 1000 plus the epoch still fits torch's 64 bits
# seed lists (toy evaluate --seeds, probe edges --seeds): each toy seed trains a translator first (about 20 s),
# so 100 take half an hour
MAX_SEEDS = 100


def seed(value: str) -> int:
    """A random seed, 0 to :data:`MAX_SEED` (torch's ``manual_seed`` overflows on larger numbers)."""
    return _as_argument(check_seed, non_negative_int(value))


def check_seed(value: int, option: str = "") -> int:
    """``value`` if it is an integer seed from 0 to :data:`MAX_SEED`, else one line naming ``option``: the CLI's
    ``seed`` type and every library function that takes a seed check it here, so both refuse alike."""
    return _bounded_int(value, 0, MAX_SEED, "a seed", option)


def check_seeds(values: Iterable[int], option: str = "seeds") -> tuple[int, ...]:
    """``values`` as a tuple if there are 1 to :data:`MAX_SEEDS` of them, each passing :func:`check_seed`."""
    seeds = tuple(values)
    if not 1 <= len(seeds) <= MAX_SEEDS:
        raise AttnscopeError(f"{option}: expected 1 to {MAX_SEEDS} seeds, got {len(seeds)}")
    for value in seeds:
        check_seed(value, option)
    return seeds


def _bounded_int(value: object, low: int, high: int, noun: str, option: str) -> int:
    """``value`` as an int if it is an integer (bool aside) within ``low..high``, else an AttnscopeError."""
    prefix = f"{option}: " if option else ""
    try:
        number = operator.index(value)  # type: ignore[arg-type]  # accepts int and numpy integers, refuses floats
    except TypeError:
        number = None
    if number is None or isinstance(value, bool):
        raise AttnscopeError(f"{prefix}expected an integer, got {value!r}")
    if number < low:
        raise AttnscopeError(f"{prefix}expected {noun} of at least {low}, got {number}")
    if number > high:
        raise AttnscopeError(f"{prefix}expected {noun} of at most {high}, got {number}")
    return number


def _as_argument(check: Callable[[int], int], number: int) -> int:
    """``check(number)`` as an argparse type: its AttnscopeError becomes argparse's one error line."""
    try:
        return check(number)
    except AttnscopeError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


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
