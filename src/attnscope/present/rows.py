"""Rows quantized per row, as the step view and the sentence panel ship them (``steps.schema.json``, ``$defs/rows``).

Rows of different lengths (a step's keys, a query sentence's key sentences) lie back to back on the last axis, each
stored as bytes ``0..levels`` scaled by its own maximum: ``value = byte / levels * row_max``, with ``row_max``
(float16, per row) the row's largest weight, so a row keeps its levels however long it is (at most
``row_max / (2 levels)`` plus the float16 rounding of ``row_max`` off). ``decode.js`` unpacks them
(``AttnscopeViews.unpackRows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

import numpy as np

from .payload import PackedArray, pack_bytes, pack_float16, packed_bytes, unpack


class Rows(TypedDict):
    """Rows of every step back to back: ``values`` uint8 ``[..., sum(keys)]`` in ``0..levels``,
    ``row_max`` float16 ``[..., step]``; a weight is ``value / levels * row_max``."""

    levels: int
    values: PackedArray
    row_max: PackedArray


class RowPacker:
    """Rows ``[*lead, keys_s]`` of each step -> uint8 ``[*lead, sum keys]`` in ``0..levels``, scaled per
    row by its maximum."""

    def __init__(self, lead: tuple[int, ...], keys: Sequence[int], levels: int) -> None:
        self.levels = levels
        self.values = np.zeros((*lead, sum(keys)), dtype=np.uint8)
        self.row_max = np.zeros((*lead, len(keys)), dtype=np.float16)
        self.starts = np.concatenate([[0], np.cumsum(keys)]).astype(int)

    def put(self, step: int, block: np.ndarray) -> None:
        start, end = self.starts[step], self.starts[step + 1]
        if end == start or self.values.size == 0:
            return
        top = block.max(axis=-1).astype(np.float16)
        self.row_max[..., step] = top
        scale = np.where(top > 0, top.astype(np.float32), 1.0)[..., None]  # quantize against the max as decoded
        self.values[..., start:end] = np.rint(np.clip(block / scale, 0.0, 1.0) * self.levels)

    def packed(self, compress: bool) -> Rows:
        return Rows(levels=self.levels, values=pack_bytes(self.values, compress), row_max=pack_float16(self.row_max, compress))


def row_values(rows: Rows) -> tuple[np.ndarray, np.ndarray, int]:
    """``rows`` unpacked: the bytes uint8 ``[..., sum(keys)]``, the rows' maxima ``[..., row]`` and the levels."""
    values = np.frombuffer(packed_bytes(rows["values"]), dtype=np.uint8).reshape(rows["values"]["shape"])
    return values, unpack(rows["row_max"]), rows["levels"]
