"""Attention rollout and attention flow (Abnar & Zuidema 2020), for encoders and causal decoders.

Both treat the model as a layered graph: node ``(level, pos)`` for ``level`` 0 (the input
embeddings) to ``n_layers`` (the output of the last layer), with an edge from ``(l + 1, i)`` down to
``(l, j)`` weighted by the *residual-adjusted* attention of layer ``l``::

    A_hat[l] = row_normalise(0.5 * mean_over_heads(A[l]) + 0.5 * I)      # [layer, q_pos, k_pos]

(the residual connection carries half of each token's state straight up, as in the paper).
With learned attention sinks (gpt-oss) a row of ``A[l]`` sums to 1 minus its sink mass: the sink has no
value, so that share of the head takes in nothing from any token, and the query keeps its own state
there. Records with sinks therefore have their sink mass put on the diagonal (:func:`sink_on_diagonal`)
before anything else, and their rows sum to 1 again without rescaling the tokens' shares.

* **Rollout** multiplies these matrices: ``R[l] = A_hat[l] @ R[l - 1]``, ``R[0] = A_hat[0]``, so
  ``R[l][i, j]`` is how much of input token ``j`` reaches token ``i`` after layer ``l`` if mixing
  composes linearly.
* **Flow** takes the edge weights as capacities and computes, for each output token ``i`` and input
  token ``j``, the maximum flow from ``(n_layers, i)`` to ``(0, j)``. The solver is SciPy's
  ``maximum_flow`` (Dinic's algorithm, compiled) on the layered graph built once per input; it
  needs integer capacities, so capacities are scaled by ``FLOW_SCALE = 2**30`` and rounded. Each
  capacity is then off by at most ``0.5 / FLOW_SCALE`` (4.7e-10), and a flow value by at most that
  times the number of edges of the minimum cut (at most ``n_tokens`` for the usual cuts next to
  the source or the sink, e.g. 3e-8 at 64 tokens), far below the 1e-6 that matters at a capacity
  scale of 1. ``benchmarks/flow.py`` checks it against networkx in floating point.

Causal attention is lower-triangular, so causal graphs simply have fewer edges.

>>> flow = attention_flow(rec)                   # doctest: +SKIP
>>> flow.values.shape                            # [q_pos (output token), k_pos (input token)]
(19, 19)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import AttnscopeError
from ..records.attention import AttentionRecord

FLOW_SCALE = 2**30  # integer capacity of an attention weight of 1.0 (fits SciPy's int32 capacities)


def _attention_of(source: AttentionRecord | np.ndarray) -> tuple[np.ndarray, tuple[str, ...]]:
    """Attention as float64 ``[layer, head, q_pos, k_pos]`` (``[layer, q_pos, k_pos]`` gets a head axis)."""
    if isinstance(source, AttentionRecord):
        return sink_on_diagonal(np.asarray(source.attention, dtype=np.float64), source.sink_mass), source.tokens
    array = np.asarray(source, dtype=np.float64)
    if array.ndim == 3:
        array = array[:, None]  # [layer, 1 head, q_pos, k_pos]
    if array.ndim != 4 or array.shape[-1] != array.shape[-2]:
        raise AttnscopeError("attention must be [layer, head, q_pos, k_pos] or [layer, q_pos, k_pos] with q_pos == k_pos")
    return array, tuple(str(i) for i in range(array.shape[-1]))


def sink_on_diagonal(attention: np.ndarray, sink_mass: np.ndarray | None) -> np.ndarray:
    """``attention`` ``[..., q_pos, k_pos]`` with each row's learned sink mass ``[..., q_pos]`` added to the
    query's own key, so rows sum to 1 (see the module docstring); unchanged when ``sink_mass`` is None."""
    if sink_mass is None:
        return attention
    moved = attention.copy()
    diagonal = np.arange(attention.shape[-1])
    moved[..., diagonal, diagonal] += sink_mass
    return moved


def residual_attention(attention: np.ndarray, residual: float = 0.5) -> np.ndarray:
    """``[layer, head, q_pos, k_pos]`` -> ``[layer, q_pos, k_pos]``: heads averaged, ``residual * I`` added,
    rows normalised to sum to 1."""
    if not 0.0 <= residual <= 1.0:
        raise AttnscopeError(f"residual must be between 0 and 1, got {residual}")
    mixed = (1.0 - residual) * attention.mean(axis=1) + residual * np.eye(attention.shape[-1])
    return mixed / mixed.sum(axis=-1, keepdims=True)


@dataclass(frozen=True, eq=False)
class Rollout:
    """``matrix[l]``: rollout through layer ``l`` (0-indexed), ``[layer, q_pos, k_pos]``; rows sum to 1."""

    matrix: np.ndarray
    tokens: tuple[str, ...]
    residual: float = 0.5

    def to_frame(self) -> Any:
        """Long format: ``layer``, ``q_pos``, ``k_pos``, ``query``, ``key``, ``value``."""
        import pandas as pd

        layer, q, k = np.indices(self.matrix.shape)
        tokens = np.array(self.tokens, dtype=object)
        return pd.DataFrame({"layer": layer.ravel(), "q_pos": q.ravel(), "k_pos": k.ravel(),
                             "query": tokens[q.ravel()], "key": tokens[k.ravel()], "value": self.matrix.ravel()})

    def plot(self, layer: int = -1) -> Any:
        """A heatmap figure of the rollout through ``layer`` (default: the last)."""
        from .figures import map_figure

        index = range(len(self.matrix))[layer]
        return map_figure(self.matrix[layer], self.tokens, f"attention rollout through layer {index} (0-indexed)")


def attention_rollout(source: AttentionRecord | np.ndarray, residual: float = 0.5) -> Rollout:
    """Rollout of a record (or of attention ``[layer, head, q_pos, k_pos]``) through every layer."""
    attention, tokens = _attention_of(source)
    adjusted = residual_attention(attention, residual)  # [layer, q_pos, k_pos]
    rolled = np.empty_like(adjusted)
    current = np.eye(adjusted.shape[-1])
    for layer, matrix in enumerate(adjusted):
        current = matrix @ current
        rolled[layer] = current
    return Rollout(rolled, tokens, residual)


@dataclass(frozen=True, eq=False)
class Flow:
    """``values[i, j]``: maximum flow from output token ``i`` (after layer ``layer``, 0-indexed) to input token ``j``.

    ``[q_pos, k_pos]``; values lie in [0, 1] (a token's outgoing capacity is 1) and are not normalised.
    """

    values: np.ndarray
    tokens: tuple[str, ...]
    layer: int
    residual: float = 0.5

    def normalized(self) -> np.ndarray:
        """Rows rescaled to sum to 1, as the paper's figures show them: ``[q_pos, k_pos]``."""
        totals = self.values.sum(axis=-1, keepdims=True)
        return np.divide(self.values, totals, out=np.zeros_like(self.values), where=totals > 0)

    def to_frame(self) -> Any:
        """Long format: ``q_pos``, ``k_pos``, ``query``, ``key``, ``flow``."""
        import pandas as pd

        q, k = np.indices(self.values.shape)
        tokens = np.array(self.tokens, dtype=object)
        return pd.DataFrame({"q_pos": q.ravel(), "k_pos": k.ravel(), "query": tokens[q.ravel()],
                             "key": tokens[k.ravel()], "flow": self.values.ravel()})

    def plot(self) -> Any:
        from .figures import map_figure

        return map_figure(self.normalized(), self.tokens, f"attention flow after layer {self.layer} (0-indexed), "
                          "rows normalised")


def layered_graph(adjusted: np.ndarray, scale: int = FLOW_SCALE) -> Any:
    """The flow network of residual-adjusted attention ``[layer, q_pos, k_pos]`` as a SciPy CSR matrix.

    Node ``level * n + pos``; edge ``(l + 1, i) -> (l, j)`` with capacity ``round(scale * A_hat[l][i, j])``.
    """
    from scipy.sparse import csr_array

    n_layers, n, _ = adjusted.shape
    capacities = np.rint(adjusted * scale).astype(np.int32)  # [layer, q_pos, k_pos]
    layer, q, k = np.nonzero(capacities)
    size = (n_layers + 1) * n
    return csr_array((capacities[layer, q, k], ((layer + 1) * n + q, layer * n + k)), shape=(size, size))


def attention_flow(source: AttentionRecord | np.ndarray, residual: float = 0.5, layer: int = -1) -> Flow:
    """Attention flow from every token after ``layer`` (default: the last) to every input token.

    ``n_tokens ** 2`` maximum-flow problems on one layered graph (see the module docstring).
    """
    from scipy.sparse.csgraph import maximum_flow

    attention, tokens = _attention_of(source)
    n_layers, n = attention.shape[0], attention.shape[-1]
    top = range(n_layers)[layer]  # raises IndexError for a bad layer
    graph = layered_graph(residual_attention(attention[: top + 1], residual))
    values = np.zeros((n, n))
    for output in range(n):
        source_node = (top + 1) * n + output
        for token in range(n):
            values[output, token] = maximum_flow(graph, source_node, token).flow_value
    return Flow(values / FLOW_SCALE, tokens, top, residual)
