"""Per-head figures of a partial record: what a planned capture's row statistics say, head by head.

A planned capture with ``statistics=True`` (``attnscope extract --stats``) keeps, per layer, head
and selected query row, the figures of :mod:`attnscope.capture.rows` instead of the matrix. This
module turns them into one row per head (0-indexed layer and head): each statistic's mean over the
rows where it applies (``prev`` skips the first position, ``next`` is NaN for causal models), and
the distance histogram as shares of the head's attention. Heads are compared by these means, for
example the attention sink (mass on the first token) across a long document.

>>> table = partial_statistics(rec)                 # doctest: +SKIP
>>> table.sort_values("first", ascending=False).head()   # the heads most drawn to the first token  # doctest: +SKIP
"""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd

from ..errors import AttnscopeError
from ..records.attention import AttentionRecord

DESCRIPTIONS = {
    "first": "mass on the first token (the attention sink of decoders, [CLS] of encoders)",
    "special": "mass on special tokens",
    "self": "mass on the query's own position",
    "prev": "mass on the previous token",
    "next": "mass on the next token (NaN for causal models)",
    "entropy": "entropy of a query's attention (nats)",
    "distance": "mean |q_pos - k_pos| weighted by attention (tokens)",
    "max_weight": "the largest weight in a query's row",
}


def partial_statistics(record: AttentionRecord) -> pd.DataFrame:
    """One row per held head: ``layer``, ``head``, ``rows`` (query rows averaged), the mean of each
    row statistic, and ``dist_<low>-<high>`` shares of attention at each distance bin."""
    statistics = record.statistics
    if not statistics:
        raise AttnscopeError(f"this record holds no row statistics ({record.holdings()}); capture it with "
                             "--stats (CapturePlan(statistics=True))")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a statistic that never applies is NaN, not a warning
        means = {name: np.nanmean(np.asarray(values, dtype=np.float64), axis=-1) for name, values in statistics.items()}
    layers, heads = record.layers_held, record.heads_held
    rows = [{"layer": layer, "head": head, "rows": len(record.query_positions),
             **{name: float(values[i, j]) for name, values in means.items()}}
            for i, layer in enumerate(layers) for j, head in enumerate(heads)]
    table = pd.DataFrame(rows)
    histogram = record.get(record.model.main_kind, "distance_histogram")
    if histogram is not None:
        from ..records.format import distance_bin_edges

        shares = np.asarray(histogram, dtype=np.float64)
        shares = shares / np.maximum(shares.sum(-1, keepdims=True), 1e-12)  # [layer, head, bin]
        edges = distance_bin_edges(len(record.tokens))[: shares.shape[-1]]
        for b, (low, high) in enumerate(edges):
            name = f"dist_{low}" if low == high else f"dist_{low}-{high}"
            table[name] = shares[..., b].reshape(-1)
    return table
