"""Files of inputs a user gives: one text per line, or JSONL lines ``{"text": ..., "pair": ...}``.

Every input keeps the file and line it came from, so errors and the index ``extract`` writes name
them (``pairs.jsonl line 4``), not a position among the inputs that were kept.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .errors import AttnscopeError


@dataclass(frozen=True)
class InputLine:
    """One input: its text, optional second text (pair, or target for encoder-decoders), and where
    it came from (``source`` file and 1-based ``line``; both None for an input typed on the command line)."""

    text: str
    pair: str | None = None
    source: str | None = None
    line: int | None = None

    @property
    def item(self) -> tuple[str, str | None]:
        return self.text, self.pair


def read_document(path: Path) -> str:
    """A whole text file (UTF-8), e.g. a long document read as one input."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise AttnscopeError(f"cannot read {path}: {getattr(error, 'strerror', None) or error}") from None


def read_input_lines(path: Path) -> list[InputLine]:
    """Inputs from a text file (one per non-blank line) or a ``.jsonl`` file (``text``, optional ``pair``).

    A malformed line, or an empty text or pair, is an :class:`AttnscopeError` naming the file and line.
    """
    lines = read_document(path).splitlines()
    numbered = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    if path.suffix == ".jsonl":
        inputs = [_jsonl_input(path, number, line) for number, line in numbered]
    else:
        inputs = [InputLine(line, None, str(path), number) for number, line in numbered]
    if not inputs:
        raise AttnscopeError(f"{path} holds no inputs")
    return inputs


def read_inputs(path: Path) -> list[tuple[str, str | None]]:
    """:func:`read_input_lines` as ``(text, pair)`` items."""
    return [entry.item for entry in read_input_lines(path)]


def _jsonl_input(path: Path, number: int, line: str) -> InputLine:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise AttnscopeError(f"{path} line {number}: not valid JSON ({error.msg})") from None
    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
        raise AttnscopeError(f"{path} line {number}: expected an object with a \"text\" string")
    pair = row.get("pair")
    if pair is not None and not isinstance(pair, str):
        raise AttnscopeError(f"{path} line {number}: \"pair\" must be a string")
    for key, value in (("text", row["text"]), ("pair", pair)):
        if value is not None and not value.strip():
            raise AttnscopeError(f"{path} line {number}: \"{key}\" is empty")
    return InputLine(row["text"], pair, str(path), number)
