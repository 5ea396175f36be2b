"""Every parser of the command line, nested ones included (``toy train``, ``probe deps``), for tests that check
all of them."""

from __future__ import annotations

import argparse
from collections.abc import Iterator


def parsers(parser: argparse.ArgumentParser, name: str = "") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``(name, parser)`` for ``parser`` and each sub-command's parser below it, named like ``"toy train"``."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child, sub in action.choices.items():
                yield from parsers(sub, f"{name} {child}".strip())
