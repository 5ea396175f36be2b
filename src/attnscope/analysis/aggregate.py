"""Mergeable partial aggregates of corpus analysis: what an engine keeps per (layer, head), never per input.

A worker turns its batch of head rows (:func:`attnscope.corpus.report.head_rows`) into a
:class:`HeadsPartial`: per head (0-indexed layer and head), the sum and the count of measured values of
every statistic, the count of inputs per pattern label, and per finding pattern the clearest input (its
score and id). Partials merge by adding (and keeping the clearer example), in any order and any tree, so
the driver holds ``O(layers x heads)`` numbers whatever the corpus size. The sums are exact
(:class:`ExactSum`), so the merged figures are the same bits however the inputs were split and in
whatever order their partials arrived: the Ray engine's report equals the local engine's. :class:`Coverage` says which
input ids a partial counted, as runs, so that merging proves every input was counted exactly once.

>>> partial = HeadsPartial.from_rows(rows, "minilm")          # doctest: +SKIP
>>> total = partial.merge(other)                              # doctest: +SKIP
>>> total.summary()                                           # one row per head, the means  # doctest: +SKIP
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import AttnscopeError
from .patterns import PATTERNS, CorpusPatterns, label_codes

KEYS = ("input_id", "layer", "head")
FRACTION_BITS = 60  # ExactSum counts a value's fraction in units of 2^-60 (rounded to the nearest)
LIMB_BITS = 20  # ... in three limbs of 20 bits: int64 sums of them cannot overflow before 2^43 values
NOT_AVERAGED = ("input_id", "n_tokens", "label", "kovaleva")  # columns the report's summary leaves out


@dataclass
class Coverage:
    """Input ids counted, as sorted disjoint half-open runs ``[start, stop)``; adjacent runs coalesce, so a
    job that finishes in order holds one run. Adding an id twice is an error naming the ids."""

    runs: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def of(cls, ids: Any) -> Coverage:
        """The coverage of ``ids`` (each at most once)."""
        coverage = cls()
        ids = np.sort(np.asarray(ids, dtype=np.int64))
        if len(ids) and (np.diff(ids) == 0).any():
            raise AttnscopeError(f"input {int(ids[np.flatnonzero(np.diff(ids) == 0)[0]])} appears twice in one batch")
        breaks = np.flatnonzero(np.diff(ids) != 1) + 1  # where a run of consecutive ids ends
        for run in np.split(ids, breaks) if len(ids) else []:
            coverage.add(int(run[0]), int(run[-1]) + 1)
        return coverage

    @property
    def count(self) -> int:
        return sum(stop - start for start, stop in self.runs)

    def add(self, start: int, stop: int) -> None:
        """Count ids ``[start, stop)``; fails if any of them was counted already."""
        at = bisect.bisect_left(self.runs, (start, stop))
        before = self.runs[at - 1] if at else None
        after = self.runs[at] if at < len(self.runs) else None
        for run in (before, after):
            if run is not None and run[0] < stop and start < run[1]:
                low, high = max(start, run[0]), min(stop, run[1]) - 1
                raise AttnscopeError(f"input ids {low}-{high} were counted twice")
        if before is not None and before[1] == start:
            start, at = before[0], at - 1
            del self.runs[at]
        if after is not None and after[0] == stop:
            stop = after[1]
            del self.runs[at]
        self.runs.insert(at, (start, stop))

    def merge(self, other: Coverage) -> Coverage:
        merged = Coverage(list(self.runs))
        for start, stop in other.runs:
            merged.add(start, stop)
        return merged

    def check_complete(self, n: int) -> None:
        """Fails unless exactly ids ``0 .. n-1`` were counted (each once, by construction)."""
        if self.runs != ([(0, n)] if n else []):
            missing = _gaps(self.runs, n)
            raise AttnscopeError(f"inputs {missing} were never counted ({self.count} of {n} were)")


def _gaps(runs: list[tuple[int, int]], n: int) -> str:
    """The first ids missing from ``runs`` within ``[0, n)``, as text."""
    gaps, position = [], 0
    for start, stop in [*runs, (n, n)]:
        if start > position:
            gaps.append(f"{position}-{start - 1}" if start - 1 > position else str(position))
        position = max(position, stop)
    return ", ".join(gaps[:5]) + (" ..." if len(gaps) > 5 else "")


@dataclass(frozen=True)
class ExactSum:
    """Sums of float64 values per cell, kept as integers so that adding partial sums is exact and the same in any
    order (float additions round differently for each order and grouping).

    ``parts`` ``[6, *cells]`` int64: the counts of +inf and -inf, then the sum of the values' signed integer parts
    and of their fractions' three signed 20-bit limbs (units of 2^-:data:`FRACTION_BITS`). A value is held
    exactly down to 2^-60 (8.7e-19), and rounded to the nearest multiple of it below.
    """

    parts: np.ndarray

    @classmethod
    def of(cls, values: np.ndarray, cell: np.ndarray, n_cells: int) -> ExactSum:
        """The sums of ``values`` (NaN: left out) per ``cell`` (``[value]`` indices below ``n_cells``)."""
        finite = np.isfinite(values)
        magnitude = np.where(finite, np.abs(values), 0.0)
        if (magnitude >= 2.0**62).any():
            raise AttnscopeError(f"a value of {magnitude.max():g} is too large to sum exactly")
        whole = np.floor(magnitude)
        fraction = np.rint((magnitude - whole) * 2.0**FRACTION_BITS).astype(np.int64)  # exact: |v| - floor(|v|)
        mask = (1 << LIMB_BITS) - 1
        limbs = [whole.astype(np.int64), fraction >> 2 * LIMB_BITS, (fraction >> LIMB_BITS) & mask, fraction & mask]
        parts = np.stack([values == np.inf, values == -np.inf, *(np.sign(values, where=finite, out=np.zeros_like(values))
                                                                  .astype(np.int64) * limb for limb in limbs)])
        sums = np.zeros((len(parts), n_cells), dtype=np.int64)
        np.add.at(sums.T, cell, parts.T.astype(np.int64))
        return cls(sums)

    def __add__(self, other: ExactSum) -> ExactSum:
        return ExactSum(self.parts + other.parts)

    def reshape(self, shape: tuple[int, ...]) -> ExactSum:
        return ExactSum(self.parts.reshape(len(self.parts), *shape))

    def divided_by(self, counts: np.ndarray) -> np.ndarray:
        """Each cell's sum divided by its count (1: the sum itself), the exact quotient rounded once to float64;
        NaN where the count is 0 or the sum holds both infinities, +-inf where it holds one."""
        positive, negative, whole, *limbs = (part.ravel().tolist() for part in self.parts)
        each_count = np.broadcast_to(counts, self.parts.shape[1:]).ravel().tolist()
        quotients = [_quotient(positive[i], negative[i], _units(whole[i], [limb[i] for limb in limbs]), each_count[i])
                     for i in range(len(each_count))]
        return np.array(quotients, dtype=float).reshape(self.parts.shape[1:])


def _units(whole: int, limbs: list[int]) -> int:
    """An :class:`ExactSum` cell's finite sum as one integer, in units of 2^-FRACTION_BITS."""
    for limb in limbs:
        whole = (whole << LIMB_BITS) + limb
    return whole


def _quotient(positive: int, negative: int, units: int, count: int) -> float:
    if positive or negative:
        return float("nan") if positive and negative else float("inf") if positive else float("-inf")
    return units / (count << FRACTION_BITS) if count else float("nan")  # int / int: rounded once


@dataclass
class HeadsPartial:
    """Per-head aggregates of some inputs' head rows (see the module docstring); arrays are ``[layer, head]``
    (``counts``: ``[layer, head, class]`` in :data:`PATTERNS` order).

    ``best[pattern]``: the clearest input's score and id per head for the finding patterns (``-inf`` and -1
    where the score never applied); on equal scores the smaller id wins, as a stream in corpus order keeps it.
    """

    model: str
    columns: list[str]
    sums: dict[str, ExactSum]
    seen: dict[str, np.ndarray]
    counts: np.ndarray
    best: dict[str, tuple[np.ndarray, np.ndarray]]
    rows: int

    @classmethod
    def from_rows(cls, rows: Any, model: str, scores: dict[str, str]) -> HeadsPartial:
        """The aggregate of head rows (one per input, layer and head); ``scores``: finding pattern -> the
        evidence column (without ``ev_``) whose largest value makes an input its clearest example."""
        if not len(rows):
            raise AttnscopeError("no inputs to aggregate")
        if rows.duplicated(list(KEYS)).any():
            raise AttnscopeError("a batch holds some (input, layer, head) rows twice")
        shape = (int(rows["layer"].max()) + 1, int(rows["head"].max()) + 1)
        cell = rows["layer"].to_numpy(dtype=np.int64) * shape[1] + rows["head"].to_numpy(dtype=np.int64)  # [row]
        if len(rows) != rows["input_id"].nunique() * shape[0] * shape[1]:
            raise AttnscopeError("a batch holds an input without all of its heads")
        columns = [c for c in rows.columns if c not in (*NOT_AVERAGED, "layer", "head")]
        sums, seen = {}, {}
        for column in columns:
            values = rows[column].to_numpy(dtype=float)
            sums[column] = ExactSum.of(values, cell, shape[0] * shape[1]).reshape(shape)
            seen[column] = np.bincount(cell, ~np.isnan(values), minlength=shape[0] * shape[1]).reshape(shape)
        codes = label_codes(rows["label"].to_numpy())
        counts = np.bincount(cell * len(PATTERNS) + codes, minlength=shape[0] * shape[1] * len(PATTERNS))
        best = {pattern: _clearest(rows, cell, shape, f"ev_{score}") for pattern, score in scores.items()}
        return cls(model, columns, sums, seen, counts.reshape(*shape, len(PATTERNS)), best, len(rows))

    @property
    def shape(self) -> tuple[int, int]:
        return self.counts.shape[:2]

    @property
    def n_inputs(self) -> int:
        return int(self.counts[0, 0].sum())

    def merge(self, other: HeadsPartial) -> HeadsPartial:
        """Both partials' inputs counted together (fails if the heads differ)."""
        if other.shape != self.shape or other.columns != self.columns:
            raise AttnscopeError(f"cannot merge aggregates of {self.shape} and {other.shape} heads")
        best = {}
        for pattern, (score, ids) in self.best.items():
            their_score, their_ids = other.best[pattern]
            theirs = (their_score > score) | ((their_score == score) & (their_ids >= 0) & (their_ids < ids))
            best[pattern] = (np.where(theirs, their_score, score), np.where(theirs, their_ids, ids))
        return HeadsPartial(self.model, self.columns, {c: self.sums[c] + other.sums[c] for c in self.columns},
                            {c: self.seen[c] + other.seen[c] for c in self.columns}, self.counts + other.counts,
                            best, self.rows + other.rows)

    def means(self, column: str) -> np.ndarray:
        """``[layer, head]``: the mean of ``column`` over the inputs where it was measured (NaN: never)."""
        return self.sums[column].divided_by(self.seen[column].astype(np.int64))

    def summary(self) -> Any:
        """One row per head (``layer``, ``head``, then the mean of every statistic), as pandas' ``groupby``
        mean of the rows gives it (to float64's rounding: here the exact mean, rounded once)."""
        import pandas as pd

        layers, heads = np.indices(self.shape)
        return pd.DataFrame({"layer": layers.ravel(), "head": heads.ravel(),
                             **{column: self.means(column).ravel() for column in self.columns}})

    def patterns(self) -> CorpusPatterns:
        """The labels' counts and the mean evidence per head, as :meth:`CorpusPatterns.from_rows` counts them."""
        evidence = [c for c in self.columns if c.startswith("ev_")]
        return CorpusPatterns(self.counts, {c[3:]: self.means(c) for c in evidence}, self.model,
                              {c[3:]: self.sums[c].divided_by(np.ones(self.shape, dtype=np.int64)) for c in evidence},
                              {c[3:]: self.seen[c] for c in evidence})

    def clearest(self, pattern: str, layer: int, head: int) -> tuple[float, int] | None:
        """(score, input id) of the clearest input of ``pattern`` at a head, or None where it never applied."""
        score, ids = self.best[pattern]
        return (float(score[layer, head]), int(ids[layer, head])) if ids[layer, head] >= 0 else None


def _clearest(rows: Any, cell: np.ndarray, shape: tuple[int, int], column: str) -> tuple[np.ndarray, np.ndarray]:
    """Per head, the largest finite value of ``column`` and its input (the smallest id on ties)."""
    values = rows[column].to_numpy(dtype=float)
    ids = rows["input_id"].to_numpy(dtype=np.int64)
    order = np.lexsort((ids, -values, cell))  # by cell, then score descending, then id
    order = order[np.isfinite(values[order])]
    first = order[np.r_[True, cell[order][1:] != cell[order][:-1]]] if len(order) else order
    score = np.full(shape[0] * shape[1], -np.inf)
    best = np.full(shape[0] * shape[1], -1, dtype=np.int64)
    score[cell[first]], best[cell[first]] = values[first], ids[first]
    return score.reshape(shape), best.reshape(shape)
