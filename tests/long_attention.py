"""Synthetic long attention with a known full matrix, for the long view's tests and benchmark.

Each row q of a head's matrix is ``sparse[q] + rest / n_keys(q)`` on every key it may see
(keys <= q when causal): the sparse part is a sink on key 0, a diagonal on key q - 1 and a few
random keys; ``rest`` is spread evenly. So the top-k keys of every row, the block-averaged
overview and any single weight are known exactly without building the 8,192 x 8,192 matrix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LongAttention:
    tokens: list[str]
    overview: np.ndarray  # [layer, head, R, R]
    block: int
    indices: np.ndarray  # [layer, head, q_pos, k]
    weights: np.ndarray  # [layer, head, q_pos, k]
    rest: np.ndarray  # [layer, head]: mass spread evenly over each row's keys
    causal: bool

    def weight(self, layer: int, head: int, query: int, key: int) -> float:
        """The full matrix's weight at (query, key), from the sparse rows and the even rest."""
        n_keys = query + 1 if self.causal else len(self.tokens)
        if self.causal and key > query:
            return 0.0
        hit = self.indices[layer, head, query] == key
        sparse = self.weights[layer, head, query][hit & (self.weights[layer, head, query] > 0)]
        even = self.rest[layer, head] / n_keys
        return float(sparse[0]) if sparse.size else float(even)


def synthetic_long_attention(tokens: int, layers: int, heads: int, *, k: int = 16, block: int = 32,
                             causal: bool = True, random_keys: int = 6, seed: int = 0) -> LongAttention:
    """Sink + diagonal + random keys + an even rest per row; top-k and overview computed exactly.

    Every sparse key of a row is among its top ``k`` (so ``k >= 2 + random_keys``); rows list only
    those keys, the rest (weight 0 in ``weights``) is the even share.
    """
    if k < 2 + random_keys:
        raise ValueError("k must hold the sink, the diagonal and the random keys of every row")
    rng = np.random.default_rng(seed)
    cells = math.ceil(tokens / block)
    overview = np.zeros((layers, heads, cells, cells))
    indices = np.zeros((layers, heads, tokens, k), dtype=np.int64)
    weights = np.zeros((layers, heads, tokens, k))
    rest = rng.uniform(0.05, 0.3, size=(layers, heads))
    for layer in range(layers):
        for head in range(heads):
            keys, mass = _sparse_rows(rng, tokens, causal, random_keys, 1.0 - rest[layer, head])
            indices[layer, head], weights[layer, head], overview[layer, head] = _head(
                keys, mass, rest[layer, head], tokens, causal, k, block)
    words = [f"w{pos}" for pos in range(tokens)]
    return LongAttention(words, overview, block, indices, weights, rest, causal)


def _sparse_rows(rng: np.random.Generator, tokens: int, causal: bool, random_keys: int,
                 total: float) -> tuple[np.ndarray, np.ndarray]:
    """Per row: key 0, key q - 1 and ``random_keys`` random visible keys ``[q_pos, 2 + random_keys]``,
    with weights summing to ``total``."""
    query = np.arange(tokens)[:, None]
    visible = query + 1 if causal else np.full_like(query, tokens)
    random = (rng.random((tokens, random_keys)) * visible).astype(np.int64)
    keys = np.concatenate([np.zeros_like(query), np.maximum(query - 1, 0), random], axis=1)
    share = np.concatenate([np.full((tokens, 1), rng.uniform(1, 6)), np.full((tokens, 1), rng.uniform(1, 6)),
                            rng.exponential(1.0, (tokens, random_keys))], axis=1)
    return keys, share / share.sum(axis=1, keepdims=True) * total


def _head(keys: np.ndarray, mass: np.ndarray, rest: float, tokens: int, causal: bool, k: int,
          block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge repeated keys, add the even rest, keep the top k per row; the exact overview ``[R, R]``."""
    query = np.repeat(np.arange(tokens), keys.shape[1])
    codes, inverse = np.unique(query * tokens + keys.ravel(), return_inverse=True)
    summed = np.bincount(inverse, weights=mass.ravel())
    rows, cols = codes // tokens, codes % tokens
    n_keys = rows + 1 if causal else np.full_like(rows, tokens)
    values = summed + rest / n_keys
    order = np.lexsort((-values, rows))  # by row, strongest first
    rows, cols, values = rows[order], cols[order], values[order]
    rank = np.arange(rows.size) - np.searchsorted(rows, rows)
    keep = rank < k
    top_i = np.zeros((tokens, k), dtype=np.int64)
    top_w = np.zeros((tokens, k))
    top_i[rows[keep], rank[keep]] = cols[keep]
    top_w[rows[keep], rank[keep]] = values[keep]
    return top_i, top_w, _overview(codes // tokens, codes % tokens, summed, rest, tokens, causal, block)


def _overview(rows: np.ndarray, cols: np.ndarray, sparse: np.ndarray, rest: float, tokens: int, causal: bool,
              block: int) -> np.ndarray:
    cells = math.ceil(tokens / block)
    per_row = np.zeros((tokens, cells))  # [q_pos, key block]: summed weight of each row on each key block
    np.add.at(per_row, (rows, cols // block), sparse)
    starts = np.arange(cells) * block
    ends = np.minimum(starts + block, tokens)
    query = np.arange(tokens)[:, None]
    seen_until = query + 1 if causal else np.full_like(query, tokens)
    overlap = np.clip(np.minimum(ends, seen_until) - starts, 0, None)  # visible keys of each block
    per_row += rest * overlap / seen_until
    counts = np.minimum(block, tokens - starts)
    return np.add.reduceat(per_row, starts, axis=0) / counts[:, None]
