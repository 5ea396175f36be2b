"""The process's resident memory, from ``/proc/self/status`` (Linux): its peak since :func:`reset_peak` and now.

The peak (``VmHWM``) is reset by writing 5 to ``/proc/self/clear_refs``; where the file system has neither (not
Linux), :func:`reset_peak` does nothing and the figures are None, so callers report "not measured" rather than fail.
Figures include the model's weights and everything else the process holds; they stay valid under a busy machine
(unlike timings)."""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, cast

STATUS = Path("/proc/self/status")


def _heap_trimmer() -> Callable[[], Any]:
    """glibc's ``malloc_trim(0)`` (nothing elsewhere): hands the heap's free pages back to the system."""
    try:
        return cast(Callable[[], Any], partial(ctypes.CDLL("libc.so.6").malloc_trim, 0))
    except (OSError, AttributeError):
        return lambda: None


# glibc's malloc_trim(0), where there is one: hands the heap's free pages back to the system. Why: once a large block is
# freed, glibc raises its mmap threshold (up to 32 MiB), so later large blocks (each step's tensors, a long prompt's
# per-layer scores, the logit lens's [step, vocab] logits) come from the heap, where the small long-lived pieces
# allocated between them split their holes, so the next block of the same size no longer fits and the heap grows:
# never handed back (SmolLM2, 256 tokens after 512: 6.3 GB peak for a record of 305 MB and a model of 1 GB), and
# within one pass, layer after layer (the prompt's pass of 512 tokens: 0.5 GB more than it holds).
trim_heap = _heap_trimmer()


def reset_peak() -> None:
    """Start a new peak: the next :func:`peak_mb` is the most held from now on. Garbage is collected and the heap's
    free pages handed back first (:data:`trim_heap`), so that the peak is what is live plus what the next work adds,
    not what earlier work left in the heap."""
    gc.collect()
    trim_heap()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # no /proc: peak_mb() says None


def peak_mb() -> float | None:
    """The process's peak resident set size since :func:`reset_peak`, in MB (None where not measurable)."""
    return _status_mb("VmHWM")


def rss_mb() -> float | None:
    """The process's resident set size now, in MB (None where not measurable)."""
    return _status_mb("VmRSS")


def _status_mb(field: str) -> float | None:
    try:
        lines = STATUS.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return None
