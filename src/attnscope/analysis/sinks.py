"""Attention sinks: how much of each head's attention parks on the first token and on other "sink" keys.

Xiao et al. 2023 (StreamingLLM, "Efficient Streaming Language Models with Attention Sinks") found
that causal language models give the first token a large share of attention whatever that token
is, and that keeping it in the KV cache keeps a sliding-window model stable. Kobayashi et al. 2020
("Attention is Not Only a Weight") showed that weight alone overstates what such keys contribute:
the vector a head adds for key j is ``alpha_ij f(x_j)``, and sink keys tend to carry small
``||f(x_j)||``. This report measures both, per layer and head, over a corpus.

**Definitions** (``q``: a query, ``k``: a key it may see; causal models see ``k <= q``, sliding
layers only the last ``window`` keys, chunked layers (Llama 4's) only their own chunk's; layers and heads
0-indexed):

* *scored queries*: every query but the first (in a causal model the first query sees only
  itself, so its weight 1.0 on position 0 says nothing).
* *first-token share* (``first``): the mean over scored queries of ``a[q, 0]``.
* *norm-weighted share* (``first_norm``): the same with each row's weights replaced by the shares
  of ``||alpha_qk f(x_k)||`` in that row (``n[q, k] / sum_k' n[q, k']``), i.e. the share of the
  row's total contribution norm that comes from key 0.
* *other sink position* of one head on one input: a key ``k >= 1`` that, averaged over the queries
  at least two positions after it (``q >= k + 2``; the next query is left out so that a
  previous-token head does not make every key a sink), receives at least ``factor`` (default
  :data:`SINK_FACTOR` = 5) times the uniform share those queries would give it
  (``mean_q a[q, k] >= factor * mean_q 1 / n_visible(q)``), over at least ``min_queries``
  (default :data:`MIN_QUERIES` = 3) such queries.
* *other-sink share* (``other``, ``other_norm``): the mean over scored queries of the weight (or
  norm share) they put on that input's other sink positions.
* *sink rate* (``other_rate``): the share of inputs on which the head has at least one other sink
  position; ``sink_tokens`` counts which tokens those positions hold, over every head and input.

* *learned sink mass* (``learned``): models with learned attention sinks (gpt-oss) add one learned logit per
  head to each softmax's denominator, with no value behind it, so a row's weights over the real keys sum to
  1 minus its *sink mass*; ``learned`` is the mean sink mass over scored queries (NaN for a model without
  learned sinks). It stands beside ``first``: Xiao et al.'s sinks emerge on the first token, whose value a
  head still adds; a learned sink takes the same role with no value at all, and the first-token share of
  such a model is what remains beside it.

Results are means over inputs; ``by_layer`` averages the heads of each layer.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import AttnscopeError
from ..records.attention import AttentionRecord

SINK_FACTOR = 5.0
MIN_QUERIES = 3
MEASURES = ("first", "first_norm", "other", "other_norm", "other_rate", "learned")


def definition(factor: float = SINK_FACTOR, min_queries: int = MIN_QUERIES) -> str:
    """The measures' definitions in one paragraph (for ``--help`` and the JSON report)."""
    return (f"first: mean attention of every query but the first on position 0; other: on the input's other sink "
            f"positions, keys k >= 1 whose mean weight from queries q >= k + 2 (at least {min_queries}) is at least "
            f"{factor:g} x the uniform share 1/n_visible of those queries; _norm: the same on the shares of "
            f"||alpha f(x)|| in each row (Kobayashi et al. 2020); other_rate: share of inputs with such a position; "
            f"learned: the mean sink mass of models with learned attention sinks (gpt-oss), the share of each "
            f"softmax given to the learned sink logit, so that the weights on real keys sum to 1 minus it")


DEFINITION = definition()


def sink_positions(attention: np.ndarray, visible: np.ndarray, factor: float = SINK_FACTOR,
                   min_queries: int = MIN_QUERIES, query_positions: np.ndarray | None = None) -> np.ndarray:
    """Bool ``[head, k_pos]``: the other sink positions (never position 0) of each head of one layer.

    ``attention``: ``[head, q, k_pos]``; ``visible``: ``[q, k_pos]`` (see :meth:`~attnscope.records.attention.ModelInfo.visible_keys`);
    ``query_positions``: the position of each of the ``q`` rows (default: every position, ``0..k_pos - 1``),
    for the rows a generation kept.
    """
    n = attention.shape[-1]
    queries = np.arange(attention.shape[-2]) if query_positions is None else np.asarray(query_positions)
    distance = queries[:, None] - np.arange(n)[None, :]
    judged = visible & (distance >= 2)  # [q_pos, k_pos]: the queries that judge each key
    counts = judged.sum(axis=0)  # [k_pos]
    uniform = (judged / np.maximum(visible.sum(axis=1, keepdims=True), 1)).sum(axis=0)  # [k_pos], summed over q
    received = (attention * judged).sum(axis=1)  # [head, k_pos], summed over the judging queries
    sinks = (counts >= min_queries) & (received >= factor * uniform)  # sums: both sides have the same count
    sinks[:, 0] = False
    return sinks


def row_shares(norms: np.ndarray) -> np.ndarray:
    """``||alpha f(x)||`` ``[..., q_pos, k_pos]`` -> each row's shares of its total (rows of zeros stay zero)."""
    total = norms.sum(axis=-1, keepdims=True)
    return np.divide(norms, total, out=np.zeros_like(norms, dtype=np.float64), where=total > 0)


@dataclass(frozen=True)
class InputSinks:
    """One input's measures, each ``[layer, head]``, and the tokens at its other sink positions."""

    measures: dict[str, np.ndarray]
    sink_tokens: Counter[str]


def input_sinks(record: AttentionRecord, factor: float = SINK_FACTOR, min_queries: int = MIN_QUERIES) -> InputSinks:
    """The sink measures of one record (its input side); norm measures are NaN when it has no norms."""
    kind = record.model.main_kind
    attention = np.asarray(record.get(kind), dtype=np.float64)  # [layer, head, q_pos, k_pos]
    norms = record.get(kind, "norms")
    n_layers, n_heads, n, _ = attention.shape
    if n < 2:
        raise AttnscopeError(f"input {' '.join(record.tokens)!r} has one token; sinks need at least two")
    shares = None if norms is None else row_shares(np.asarray(norms, dtype=np.float64))
    measures = {name: np.full((n_layers, n_heads), np.nan) for name in MEASURES}
    tokens: Counter[str] = Counter()
    for layer in range(n_layers):
        visible = record.model.visible_keys(layer, n)
        sinks = sink_positions(attention[layer], visible, factor, min_queries)  # [head, k_pos]
        for head in range(n_heads):
            tokens.update(record.tokens[k] for k in np.flatnonzero(sinks[head]))
        measures["first"][layer] = attention[layer, :, 1:, 0].mean(axis=-1)
        measures["other"][layer] = (attention[layer, :, 1:, :] * sinks[:, None, :]).sum(-1).mean(-1)
        measures["other_rate"][layer] = sinks.any(axis=-1)
        if record.sink_mass is not None:
            measures["learned"][layer] = record.sink_mass[layer, :, 1:].mean(axis=-1)
        if shares is not None:
            measures["first_norm"][layer] = shares[layer, :, 1:, 0].mean(axis=-1)
            measures["other_norm"][layer] = (shares[layer, :, 1:, :] * sinks[:, None, :]).sum(-1).mean(-1)
    return InputSinks(measures, tokens)


@dataclass
class SinkReport:
    """Sink measures of a model over a corpus: each of :data:`MEASURES` is ``[layer, head]``, a mean over inputs."""

    model: str
    n_inputs: int
    measures: dict[str, np.ndarray]
    sink_tokens: Counter[str] = field(default_factory=Counter)
    factor: float = SINK_FACTOR
    min_queries: int = MIN_QUERIES
    causal: bool = True

    @property
    def by_layer(self) -> dict[str, np.ndarray]:
        """Each measure averaged over the heads of each layer: ``[layer]``."""
        return {name: values.mean(axis=1) for name, values in self.measures.items()}

    def top_heads(self, measure: str = "first", n: int = 5) -> list[tuple[int, int, float]]:
        """The ``n`` heads with the largest mean ``measure``: ``(layer, head, value)``, 0-indexed."""
        values = self.measures[measure]
        order = np.argsort(-np.nan_to_num(values, nan=-1.0), axis=None)[:n]
        return [(int(i // values.shape[1]), int(i % values.shape[1]), float(values.flat[i])) for i in order]

    def summary(self) -> dict[str, Any]:
        """Model-wide figures: mean of each measure over all heads, and how many heads put most weight on position 0."""
        first = self.measures["first"]
        return {
            **{f"mean_{name}": _number(values.mean()) for name, values in self.measures.items()},
            "heads": int(first.size),
            "first_majority_heads": int((first >= 0.5).sum()),
            "first_majority_heads_norm": int((self.measures["first_norm"] >= 0.5).sum()),
            "learned_majority_heads": int((self.measures["learned"] >= 0.5).sum()),
            "top_sink_tokens": self.sink_tokens.most_common(10),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: definitions, summary, per-layer curves and the ``[layer][head]`` tables."""
        return {
            "model": self.model,
            "n_inputs": self.n_inputs,
            "causal": self.causal,
            "definition": definition(self.factor, self.min_queries),
            "indexing": "layers and heads 0-indexed",
            "summary": self.summary(),
            "by_layer": {name: [_number(v) for v in values] for name, values in self.by_layer.items()},
            "heads": {name: [[_number(v) for v in row] for row in values] for name, values in self.measures.items()},
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=1))
        return path

    def plot(self, path: str | Path | None = None) -> Any:
        """Layers x heads heatmaps (first-token share, raw and norm-weighted) over per-layer curves."""
        from .figures import sink_figure

        return sink_figure(self, path)

    def to_text(self) -> str:
        """A few lines for the terminal."""
        summary: dict[str, Any] = {name: "n/a" if value is None else value  # no norms: n/a
                                   for name, value in self.summary().items()}
        share = {name: value if value == "n/a" else f"{value:.1%}" for name, value in summary.items()
                 if name.startswith("mean_")}
        lines = [f"{self.model}: {self.n_inputs} inputs, {summary['heads']} heads (layers and heads 0-indexed)",
                 (f"  attention on the first token: {share['mean_first']} of all heads' weight "
                 f"({share['mean_first_norm']} norm-weighted); {summary['first_majority_heads']} heads give it "
                 f"half or more ({summary['first_majority_heads_norm']} norm-weighted)"),
                 (f"  on other sink positions: {share['mean_other']} ({share['mean_other_norm']} "
                 f"norm-weighted); heads with one on an average input: {share['mean_other_rate']}")]
        if share["mean_learned"] != "n/a":
            lines.append(f"  on the learned sink logit (no value): {share['mean_learned']}; "
                         f"{summary['learned_majority_heads']} heads give it half or more")
        tokens = ", ".join(f"{token!r} x{count}" for token, count in summary["top_sink_tokens"][:6])
        lines.append(f"  most frequent other sink tokens: {tokens or 'none'}")
        heads = ", ".join(f"{layer}-{head} ({value:.2f})" for layer, head, value in self.top_heads("first"))
        lines.append(f"  strongest first-token heads (layer-head): {heads}")
        return "\n".join(lines)


def _number(value: float) -> float | None:
    return None if not np.isfinite(value) else round(float(value), 6)


@dataclass
class SinkTotals:
    """Mergeable sums of :func:`input_sinks` over some inputs (what a worker of the Ray engine returns):
    ``sums`` of each measure ``[layer, head]``, the inputs counted and the other-sink tokens seen."""

    model: str
    causal: bool
    factor: float
    min_queries: int
    sums: dict[str, np.ndarray] = field(default_factory=dict)
    count: int = 0
    sink_tokens: Counter[str] = field(default_factory=Counter)

    @classmethod
    def of(cls, records: Iterable[AttentionRecord], factor: float = SINK_FACTOR,
           min_queries: int = MIN_QUERIES) -> SinkTotals:
        """The sums over ``records`` (one model's; norm measures need ``norms=True``)."""
        totals: SinkTotals | None = None
        for record in _checked(records):
            totals = totals or cls(record.model.name, record.model.causal, factor, min_queries)
            one = input_sinks(record, factor, min_queries)
            for name, values in one.measures.items():
                totals.sums[name] = totals.sums.get(name, 0.0) + values
            totals.sink_tokens.update(one.sink_tokens)
            totals.count += 1
        if totals is None:
            raise AttnscopeError("no inputs to measure sinks on")
        return totals

    def merge(self, other: SinkTotals) -> SinkTotals:
        return SinkTotals(self.model, self.causal, self.factor, self.min_queries,
                          {name: values + other.sums[name] for name, values in self.sums.items()},
                          self.count + other.count, self.sink_tokens + other.sink_tokens)

    def report(self) -> SinkReport:
        """The means over every input counted."""
        measures = {name: values / self.count for name, values in self.sums.items()}
        return SinkReport(self.model, self.count, measures, Counter(self.sink_tokens), self.factor,
                          self.min_queries, self.causal)


def sink_report(records: Iterable[AttentionRecord], factor: float = SINK_FACTOR,
                min_queries: int = MIN_QUERIES) -> SinkReport:
    """Average :func:`input_sinks` over ``records`` (one model's; norm measures need records captured with
    ``norms=True``)."""
    return SinkTotals.of(records, factor, min_queries).report()


def _checked(records: Iterable[AttentionRecord]) -> Iterator[AttentionRecord]:
    for record in records:
        record.require_complete("the sink report")
        yield record
