"""The process's resident memory, from ``/proc/self/status`` (Linux): its peak since :func:`reset_peak` and now.

The peak (``VmHWM``) is reset by writing 5 to ``/proc/self/clear_refs``; where the file system has neither (not
Linux), :func:`reset_peak` does nothing and the figures are None, so callers report "not measured" rather than fail.
Figures include the model's weights and everything else the process holds; they stay valid under a busy machine
(unlike timings)."""

from __future__ import annotations

from pathlib import Path

STATUS = Path("/proc/self/status")


def reset_peak() -> None:
    """Start a new peak: the next :func:`peak_mb` is the most held from now on."""
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
