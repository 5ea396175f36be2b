"""Files of inputs a user gives: one text per line, JSONL lines ``{"text": ..., "pair": ...}``, or Parquet.

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
    """A whole text file (UTF-8), e.g. a long document read as one input; a name that is no file but one of
    the shipped documents (:func:`attnscope.data.documents`, e.g. ``sotu-1981-jimmy-carter``) reads that."""
    from .data import document, documents
    from .files import read_text

    if not path.exists() and str(path) in documents():
        return document(str(path))
    if not path.exists() and not path.suffix and path.parent == Path("."):
        raise AttnscopeError(f"no such file: {path} (nor a shipped document: {', '.join(documents())})")
    return read_text(path)


def read_input_lines(path: Path) -> list[InputLine]:
    """Inputs from a text file (one per non-blank line), a ``.jsonl`` file (``text``, optional ``pair``)
    or a ``.parquet`` file (columns ``text`` and optional ``pair``).

    A malformed line, or an empty text or pair, is an :class:`AttnscopeError` naming the file and line.
    """
    from .files import cannot_read

    try:
        data = path.read_bytes()
    except OSError as error:
        raise cannot_read(path, error) from None
    inputs, bad = parse_input_file(str(path), data)
    if bad:
        raise AttnscopeError(bad[0].message)
    if not inputs:
        raise AttnscopeError(f"{path} holds no inputs")
    return inputs


def read_inputs(path: Path) -> list[tuple[str, str | None]]:
    """:func:`read_input_lines` as ``(text, pair)`` items."""
    return [entry.item for entry in read_input_lines(path)]


# ---- corpus files (one parser for every engine) -----------------------------------------------
CORPUS_SUFFIXES = (".txt", ".text", ".jsonl", ".parquet")  # what a folder contributes


@dataclass(frozen=True)
class BadLine:
    """A line (or Parquet row, 1-based) that holds no usable input, and why."""

    source: str
    line: int
    reason: str

    @property
    def message(self) -> str:
        return f"{self.source} line {self.line}: {self.reason}"


def corpus_files(paths: list[Path]) -> list[Path]:
    """Files named by ``paths``: a file stays, a folder gives its ``.txt``/``.text``/``.jsonl``/``.parquet``
    files (recursively, sorted). The order is the corpus order (input ids follow it)."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in CORPUS_SUFFIXES)
            if not found:
                raise AttnscopeError(f"folder {path} holds no {', '.join(CORPUS_SUFFIXES)} files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise AttnscopeError(f"no such file or folder: {path}")
    return files


def parse_input_file(source: str, data: bytes) -> tuple[list[InputLine], list[BadLine]]:
    """The inputs of one file's bytes, in order, and its malformed lines.

    ``.parquet``: one input per row (``text``, optional ``pair``); ``.jsonl``: one JSON object per
    non-blank line; anything else: one text per non-blank line (UTF-8). Blank lines are no inputs.
    """
    if source.endswith(".parquet"):
        return _parquet_inputs(source, data)
    inputs: list[InputLine] = []
    bad: list[BadLine] = []
    for number, raw in enumerate(data.splitlines(), 1):
        try:
            line = raw.decode("utf-8")
            if not line.strip():
                continue
            text, pair = _jsonl_fields(line) if source.endswith(".jsonl") else (line, None)
        except UnicodeDecodeError:
            bad.append(BadLine(source, number, "not valid UTF-8"))
            continue
        except _Malformed as error:
            bad.append(BadLine(source, number, str(error)))
            continue
        inputs.append(InputLine(text, pair, source, number))
    return inputs, bad


class _Malformed(Exception):
    """Why one line holds no usable input (becomes a :class:`BadLine`)."""


def _jsonl_fields(line: str) -> tuple[str, str | None]:
    from .files import parse_json

    try:
        row = parse_json(line)
    except json.JSONDecodeError as error:
        raise _Malformed(f"not valid JSON ({error.msg})") from None
    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
        raise _Malformed("expected an object with a \"text\" string")
    pair = row.get("pair")
    if pair is not None and not isinstance(pair, str):
        raise _Malformed("\"pair\" must be a string")
    _check_filled(row["text"], pair)
    return row["text"], pair


def _check_filled(text: object, pair: object) -> None:
    for key, value in (("text", text), ("pair", pair)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise _Malformed(f"\"{key}\" is empty" if isinstance(value, str) else f"\"{key}\" is not a string")


def _parquet_inputs(source: str, data: bytes) -> tuple[list[InputLine], list[BadLine]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(pa.BufferReader(data))
    except pa.ArrowException as error:
        raise AttnscopeError(f"cannot read {source} as Parquet: {error}") from None
    if "text" not in table.column_names:
        raise AttnscopeError(f"{source}: a Parquet corpus needs a \"text\" column (and optionally \"pair\")")
    texts = table.column("text").to_pylist()
    pairs = table.column("pair").to_pylist() if "pair" in table.column_names else [None] * len(texts)
    inputs: list[InputLine] = []
    bad: list[BadLine] = []
    for row, (text, pair) in enumerate(zip(texts, pairs), 1):
        try:
            _check_filled(text if text is not None else "", pair)
        except _Malformed as error:
            bad.append(BadLine(source, row, str(error)))
            continue
        inputs.append(InputLine(text, pair, source, row))
    return inputs, bad
