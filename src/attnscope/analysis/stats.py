"""Per-head statistics of one record, and their means over a corpus.

Every statistic is a number per ``[layer, head]`` (0-indexed), computed for all heads at once
from attention ``[layer, head, q_pos, k_pos]``. A *mass* statistic is the attention a query puts
on a set of keys, averaged over the queries for which the set can be non-empty (all queries,
special tokens included, as in Clark et al. 2019; only queries with a previous token for
``prev``, and so on). Each mass statistic also comes norm-weighted (``norm_`` prefix): the same
sum over ||alpha f(x)|| (Kobayashi et al. 2020) with each query's row normalised to sum to 1,
so both read as shares of what the query takes in. A statistic that cannot apply to an input (no
repeated word, a single sentence, ``next`` in a causal model) is NaN there, and corpus means skip
it.

Causal models park attention on their first position whatever its token is (the attention sink,
see :mod:`attnscope.analysis.tokens`). ``sink`` measures that mass; every other key set of a
single position or word (``self``, ``prev``, ``next``, ``punct``, ``same_word``...) leaves the
sink out, so that the sink is not read as the second token's previous token, the first query's
own position or another occurrence of its word. The [CLS]/[SEP] and sentence masses keep it (a
BOS sink is a leading special token). Shape statistics are averaged over the queries that see
more than one key (the first query of a causal model sees only itself: entropy 0, weight 1).

In a model with learned sinks (gpt-oss) a row sums to 1 minus its sink mass: masses are shares of the
whole softmax, the learned sink's own share being the sink report's ``learned``
(:mod:`attnscope.analysis.sinks`), and shape statistics (entropy, distance, largest weight) read the
weights over the tokens as they are, without rescaling them.

Token types (``[CLS]``, ``[SEP]``, punctuation, same word) are defined in
:mod:`attnscope.analysis.tokens`.

>>> stats = head_statistics(rec)                        # doctest: +SKIP
>>> stats["sep"].shape                                  # [layer, head]
(6, 12)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import AttnscopeError
from ..records.attention import AttentionRecord
from .tokens import TokenContext, token_context

NORM_PREFIX = "norm_"


@dataclass(frozen=True)
class MassStatistic:
    """Attention mass on a set of keys: ``keys(ctx) -> [q_pos, k_pos]`` bool.

    Queries whose key set is empty are left out of the mean.
    """

    name: str
    description: str
    keys: Callable[[TokenContext], np.ndarray]


@dataclass(frozen=True)
class ShapeStatistic:
    """Any other per-head number: ``compute(attention [layer, head, q_pos, k_pos], ctx) -> [layer, head]``."""

    name: str
    description: str
    compute: Callable[[np.ndarray, TokenContext], np.ndarray]


def _offset(ctx: TokenContext, offset: int) -> np.ndarray:
    return np.eye(ctx.n, k=offset, dtype=bool) & ctx.allowed & ~ctx.sink[None, :]


def _columns(mask: np.ndarray, ctx: TokenContext) -> np.ndarray:
    return np.broadcast_to(mask[None, :], (ctx.n, ctx.n)) & ctx.allowed


MASS_STATISTICS: dict[str, MassStatistic] = {s.name: s for s in (
    MassStatistic("cls", "mass on [CLS] (leading special tokens)", lambda c: _columns(c.cls, c)),
    MassStatistic("sep", "mass on [SEP] (other special tokens)", lambda c: _columns(c.sep, c)),
    MassStatistic("sink", "mass on the first token of causal models, the attention sink (NaN for bidirectional "
                  "models)", lambda c: _columns(c.sink, c)),
    MassStatistic("punct", "mass on the punctuation tokens '.' and ','", lambda c: _columns(c.punct & ~c.sink, c)),
    MassStatistic("self", "mass on the query's own position", lambda c: _offset(c, 0)),
    MassStatistic("prev", "mass on the previous token", lambda c: _offset(c, -1)),
    MassStatistic("next", "mass on the next token (NaN for causal models)", lambda c: _offset(c, 1)),
    MassStatistic("same_word", "mass on other occurrences of the query's word (queries whose word repeats)",
                  lambda c: c.same_word),
    MassStatistic("same_word_other", "mass on occurrences of the query's word in the other sentence",
                  lambda c: c.same_word_other_sentence),
    MassStatistic("within_sentence", "mass on the query's own sentence", lambda c: c.same_sentence & c.allowed),
    MassStatistic("cross_sentence", "mass on the other sentence (pairs only)", lambda c: ~c.same_sentence & c.allowed),
)}


def row_entropy(attention: np.ndarray) -> np.ndarray:
    """``[..., q_pos, k_pos]`` -> ``[..., q_pos]`` entropy of each query's weights, in nats."""
    p = np.clip(attention, 0.0, None)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, -p * np.log(p), 0.0)
    return terms.sum(axis=-1)


def _choosing_rows(ctx: TokenContext) -> np.ndarray:
    """[q_pos] bool: queries that see more than one key (whose rows say something about the head)."""
    return ctx.allowed.sum(axis=1) > 1


def _row_mean(per_query: np.ndarray, ctx: TokenContext) -> np.ndarray:
    """``[..., q_pos]`` -> ``[...]`` mean over the choosing queries (NaN when there are none)."""
    rows = _choosing_rows(ctx)
    if not rows.any():
        return np.full(per_query.shape[:-1], np.nan)
    return per_query[..., rows].mean(axis=-1)


def _entropy(attention: np.ndarray, ctx: TokenContext) -> np.ndarray:
    return _row_mean(row_entropy(attention), ctx)


def _uniform_entropy(attention: np.ndarray, ctx: TokenContext) -> np.ndarray:
    baseline = _row_mean(np.log(ctx.allowed.sum(axis=1)), ctx)  # a uniform row over the keys a query may see
    return np.full(attention.shape[:2], baseline)


def _mean_distance(attention: np.ndarray, ctx: TokenContext) -> np.ndarray:
    positions = np.arange(ctx.n)
    distance = np.abs(positions[:, None] - positions[None, :])  # [q_pos, k_pos]
    return _row_mean(np.einsum("lhqk,qk->lhq", attention, distance), ctx)


def _max_weight(attention: np.ndarray, ctx: TokenContext) -> np.ndarray:
    return _row_mean(attention.max(axis=-1), ctx)


SHAPE_STATISTICS: dict[str, ShapeStatistic] = {s.name: s for s in (
    ShapeStatistic("entropy", "mean entropy of a query's attention (nats)", _entropy),
    ShapeStatistic("uniform_entropy", "the same for uniform attention over the keys a query may see (nats)",
                   _uniform_entropy),
    ShapeStatistic("mean_distance", "mean |q_pos - k_pos| weighted by attention (tokens)", _mean_distance),
    ShapeStatistic("max_weight", "mean over queries of the largest weight in the row", _max_weight),
)}


def statistic_names(norms: bool = True) -> list[str]:
    """Every statistic's name, in table order; ``norm_*`` names when norms are included."""
    names = [*MASS_STATISTICS, *SHAPE_STATISTICS]
    return names + [NORM_PREFIX + name for name in MASS_STATISTICS] if norms else names


def describe_statistics() -> dict[str, str]:
    """name -> one-line description, for ``--help`` and reports."""
    described = {name: s.description for name, s in MASS_STATISTICS.items()}
    described.update({name: s.description for name, s in SHAPE_STATISTICS.items()})
    described.update({NORM_PREFIX + name: f"{s.description}, norm-weighted" for name, s in MASS_STATISTICS.items()})
    return described


def masses(weights: np.ndarray, key_masks: np.ndarray) -> np.ndarray:
    """Mean mass per head on each key set: ``[layer, head, q_pos, k_pos]`` x ``[set, q_pos, k_pos]`` -> ``[set, layer, head]``.

    Queries with an empty key set are left out; a set that is empty for every query gives NaN.
    """
    per_query = np.einsum("lhqk,sqk->slhq", weights, key_masks.astype(weights.dtype))
    counted = key_masks.any(axis=-1)  # [set, q_pos]
    n_counted = counted.sum(axis=-1)  # [set]
    total = np.einsum("slhq,sq->slh", per_query, counted.astype(weights.dtype))
    with np.errstate(invalid="ignore", divide="ignore"):
        return total / np.where(n_counted > 0, n_counted, np.nan)[:, None, None]


def normalized_rows(norms: np.ndarray) -> np.ndarray:
    """``[..., q_pos, k_pos]`` norms -> shares of each query's row (rows of zeros stay zero)."""
    totals = norms.sum(axis=-1, keepdims=True)
    return np.divide(norms, totals, out=np.zeros_like(norms), where=totals > 0)


def largest_measured(grid: np.ndarray, n: int) -> list[tuple[int, int]]:
    """The ``(layer, head)`` cells of the ``n`` largest finite values of ``grid`` ``[layer, head]``,
    largest first; cells where the score never applied (NaN) are never named."""
    cells = np.argwhere(np.isfinite(grid))  # [cell, 2]
    order = np.argsort(-grid[tuple(cells.T)], kind="stable")[:n]
    return [(int(layer), int(head)) for layer, head in cells[order]]


@dataclass(frozen=True, eq=False)
class HeadStatistics:
    """Statistics per ``[layer, head]`` (0-indexed): one record's, or means over ``n_inputs`` records.

    ``values[name]`` is a float array ``[layer, head]``; names are listed by
    :func:`statistic_names` and described by :func:`describe_statistics`.
    """

    values: dict[str, np.ndarray]
    model: str = ""
    n_inputs: int = 1
    text: tuple[str, ...] = field(default=())

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.values:
            raise AttnscopeError(f"unknown statistic {name!r}; choose from {', '.join(self.values)}")
        return self.values[name]

    @property
    def shape(self) -> tuple[int, int]:
        first = next(iter(self.values.values()))
        return int(first.shape[0]), int(first.shape[1])

    def to_frame(self) -> Any:
        """A pandas DataFrame: one row per head (``layer``, ``head`` 0-indexed), one column per statistic."""
        import pandas as pd

        layers, heads = np.indices(self.shape)
        columns = {"layer": layers.ravel(), "head": heads.ravel()}
        columns.update({name: value.ravel() for name, value in self.values.items()})
        return pd.DataFrame(columns)

    def top(self, name: str, n: int = 10) -> list[tuple[int, int, float]]:
        """The ``n`` heads with the largest value of ``name``: ``(layer, head, value)``; heads where the
        statistic did not apply (NaN) are left out, so fewer than ``n`` may come back."""
        values = self[name]
        return [(layer, head, float(values[layer, head])) for layer, head in largest_measured(values, n)]

    def _repr_html_(self) -> str:
        caption = f"{self.model}: statistics per head (layers and heads 0-indexed), {self.n_inputs} input(s)"
        return str(self.to_frame().style.set_caption(caption).format(precision=3).hide(axis="index").to_html())

    @classmethod
    def mean(cls, items: Iterable[HeadStatistics]) -> HeadStatistics:
        """The mean of each statistic over inputs (NaN entries, where a statistic did not apply, are skipped)."""
        items = list(items)
        if not items:
            raise AttnscopeError("no statistics to average")
        values = {}
        for name in items[0].values:
            stacked = np.stack([item.values[name] for item in items])  # [input, layer, head]
            counted = (~np.isnan(stacked)).sum(axis=0)
            total = np.nansum(stacked, axis=0)
            values[name] = np.divide(total, counted, out=np.full(total.shape, np.nan), where=counted > 0)
        return cls(values, model=items[0].model, n_inputs=sum(item.n_inputs for item in items))


def head_statistics(record: AttentionRecord, context: TokenContext | None = None) -> HeadStatistics:
    """Every statistic of :data:`MASS_STATISTICS` and :data:`SHAPE_STATISTICS` for each head of ``record``.

    Norm-weighted (``norm_*``) statistics are included when the record holds norms (extract with
    ``norms=True``). Attention: ``[layer, head, q_pos, k_pos]``; every value: ``[layer, head]``.
    """
    record.require_complete("head statistics (for a partial record: attnscope.analysis.partial_statistics)")
    ctx = context or token_context(record)
    attention = np.asarray(record.attention, dtype=np.float64)
    key_masks = np.stack([s.keys(ctx) for s in MASS_STATISTICS.values()])  # [set, q_pos, k_pos]
    values = dict(zip(MASS_STATISTICS, masses(attention, key_masks)))
    values.update({name: s.compute(attention, ctx) for name, s in SHAPE_STATISTICS.items()})
    if record.norms is not None:
        shares = normalized_rows(np.asarray(record.norms, dtype=np.float64))
        values.update({NORM_PREFIX + name: v for name, v in zip(MASS_STATISTICS, masses(shares, key_masks))})
    return HeadStatistics(values, model=record.model.name, text=record.text)
