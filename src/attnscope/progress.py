"""How long work tells the user it is under way, on the lowest floor so every part says it the same way."""

from __future__ import annotations

import sys


def say_slow_step(message: str) -> None:
    """One progress line on stderr before a step that takes tens of seconds, so the wait is not silent:
    ``attnscope: <message>...``."""
    print(f"attnscope: {message}...", file=sys.stderr, flush=True)
