"""What each token attends to most, per layer and head: the first report of ``make demo``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .records.attention import AttentionRecord

CELL_TOKEN_CHARS = 6


@dataclass(frozen=True, eq=False)
class TopAttention:
    """For every layer, head and query token: the most-attended key token and its weight.

    ``target``: ``[layer, head, q_pos]`` key positions; ``weight``: ``[layer, head, q_pos]``.
    """

    record: AttentionRecord
    target: np.ndarray
    weight: np.ndarray

    def rows(self) -> list[dict[str, Any]]:
        """One dict per (layer, head, query token), 0-indexed."""
        tokens = self.record.tokens
        return [
            {"layer": layer, "head": head, "q_pos": q, "token": tokens[q],
             "attends_to": tokens[int(self.target[layer, head, q])], "k_pos": int(self.target[layer, head, q]),
             "weight": float(self.weight[layer, head, q])}
            for layer, head, q in np.ndindex(*self.target.shape)
        ]

    def to_text(self, layers: list[int] | None = None) -> str:
        """A table per layer: a row per token, a column per head, cells ``token weight%``."""
        chosen = range(self.target.shape[0]) if layers is None else layers
        return "\n\n".join(self._layer_table(layer) for layer in chosen)

    def _layer_table(self, layer: int) -> str:
        tokens = self.record.tokens
        width = min(14, max(len(t) for t in tokens) + 1)
        n_heads = self.target.shape[1]
        title = (f"layer {layer} (0-indexed): the token each token attends to most, per head, "
                 f"with its weight in %")
        header = " " * width + "".join(f"{'h' + str(h):<10}" for h in range(n_heads))
        lines = [title, header.rstrip()]
        for q, token in enumerate(tokens):
            cells = []
            for head in range(n_heads):
                target = tokens[int(self.target[layer, head, q])][:CELL_TOKEN_CHARS]
                percent = min(99, round(100 * float(self.weight[layer, head, q])))
                cells.append(f"{target:<{CELL_TOKEN_CHARS}}{percent:>3} ")
            lines.append(f"{token[: width - 1]:<{width}}" + "".join(cells).rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()


def top_attention(record: AttentionRecord) -> TopAttention:
    """The most-attended key for every query, in every layer and head of ``record``'s input side."""
    record.require_complete("the top-attention report")
    attention = record.attention  # [layer, head, q_pos, k_pos]
    return TopAttention(record, attention.argmax(axis=-1), attention.max(axis=-1))
