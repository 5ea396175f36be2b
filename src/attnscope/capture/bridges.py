"""Bridges for architectures whose attention does not dispatch through ``AttentionInterface``.

transformers 5 still computes MPNet's attention inline. Rather than copy its modeling code or
patch its class, attnscope swaps each such module *instance* for a bridge that reuses the
module's own projections and calls the one capture function with the relative position bias.
Bridges are keyed by class name (data, like the adapter table).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from .attention import attnscope_attention


class MPNetAttentionBridge(nn.Module):
    """Stands in for ``MPNetSelfAttention``: same q/k/v/o weights, attention via attnscope."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (cast(nn.Linear, getattr(original, name)) for name in "qkvo")
        self.dropout = cast(nn.Dropout, original.dropout)
        self.n_heads = int(cast(int, original.num_attention_heads))
        self.d_head = int(cast(int, original.attention_head_size))
        self.is_causal = False
        self.train(original.training)  # a new module starts in training mode; keep the model's mode

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_bias: torch.Tensor | None = None,
        output_attentions: bool = False,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, ...]:
        batch, length, _ = hidden_states.shape
        split = (batch, length, self.n_heads, self.d_head)
        q, k, v = (proj(hidden_states).view(split).transpose(1, 2) for proj in (self.q, self.k, self.v))
        output, probs = attnscope_attention(
            self, q, k, v, attention_mask, scaling=self.d_head**-0.5,
            dropout=self.dropout.p if self.training else 0.0, position_bias=position_bias,
        )  # output: [batch, pos, head, d_head]
        output = self.o(output.reshape(batch, length, self.n_heads * self.d_head))
        return (output, probs) if output_attentions and probs is not None else (output,)


BRIDGES: dict[str, type[nn.Module]] = {"MPNetSelfAttention": MPNetAttentionBridge}


def install_bridges(model: nn.Module) -> int:
    """Replace every module whose class has a bridge; returns how many were replaced."""
    targets = [(name, module) for name, module in model.named_modules() if type(module).__name__ in BRIDGES]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, BRIDGES[type(module).__name__](module))
    return len(targets)
