"""How long work tells the user it is under way, on the lowest floor so every part says it the same way."""

from __future__ import annotations

import sys


def say_slow_step(message: str) -> None:
    """One progress line on stderr before a step that takes tens of seconds, so the wait is not silent:
    ``attnscope: <message>...``."""
    print(f"attnscope: {message}...", file=sys.stderr, flush=True)


def end_progress_lines() -> None:
    """Close every progress bar still open (a step that failed half-way leaves its bar's line unfinished on stderr),
    so that what is printed next starts a line of its own."""
    bars = sys.modules.get("tqdm.std")  # no bar can be open if tqdm was never imported: importing it costs time
    if bars is None:
        return
    for bar in list(bars.tqdm._instances):
        bar.leave = True  # a bar that would erase itself keeps its line and ends it, so nothing runs on after it
        bar.close()
