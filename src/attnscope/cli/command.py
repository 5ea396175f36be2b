"""What a command is: a name, its help, how it adds its options and what it runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    """One ``attnscope COMMAND``: ``add_arguments`` fills its parser, ``run`` takes the parsed arguments and
    returns the exit code."""

    name: str
    help: str
    epilog: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
