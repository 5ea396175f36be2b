"""Decoders with ALiBi, a per-head linear bias by distance instead of position embeddings: BLOOM and MPT. Both compute
attention themselves; their bridges reuse the fused q/k/v and output weights and pass the bias to the attention
function as its position bias.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ...errors import AttnscopeError
from ..adapters import Adapter, ModuleRule, SiteRule
from .bridging import Attend, Bridge, attend, heads

ADAPTERS: tuple[Adapter, ...] = (
    Adapter("bloom", ("bloom",), (SiteRule("self", r"(?:^|\.)h\.(\d+)\.self_attention$", "dense", causal=True),),
            blocks=(ModuleRule("self", r"(?:^|\.)h\.(\d+)$"),), ffn=(ModuleRule("self", r"(?:^|\.)h\.(\d+)\.mlp$"),),
            note="ALiBi: a per-head linear bias by distance instead of position embeddings; BLOOM computes attention "
            "itself, attnscope routes it through the capture function with a bridge"),
    Adapter("mpt", ("mpt",), (SiteRule("self", r"blocks\.(\d+)\.attn$", "out_proj", causal=True),),
            note="ALiBi: a per-head linear bias by distance; MPT computes attention itself: attnscope bridges it"),
)


class BloomAttentionBridge(nn.Module):
    """Stands in for ``BloomAttention``: the same fused q/k/v and output weights; ALiBi's per-head linear
    bias (``alibi``, ``[batch * head, 1, k_pos]``) is the position bias added to the scaled scores."""

    def __init__(self, original: nn.Module, attention: Attend) -> None:
        super().__init__()
        self.attnscope_attention = attention
        self.query_key_value, self.dense = (cast(nn.Linear, getattr(original, name)) for name in ("query_key_value",
                                                                                                   "dense"))
        self.attention_dropout = cast(nn.Dropout, original.attention_dropout)
        self.n_heads, self.d_head = int(cast(int, original.num_heads)), int(cast(int, original.head_dim))
        self.scaling, self.beta = float(cast(float, original.inv_norm_factor)), float(cast(float, original.beta))
        self.hidden_dropout, self.layer_idx = float(cast(float, original.hidden_dropout)), original.layer_idx
        self.is_causal = True
        if int(cast(int, original.pretraining_tp)) > 1 and original.slow_but_exact:
            raise AttnscopeError("model type 'bloom' with slow_but_exact and pretraining_tp > 1 splits its output "
                                 "projection in slices attnscope's bridge does not reproduce; set slow_but_exact to "
                                 "false in its config.json")
        self.train(original.training)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor, alibi: torch.Tensor,
                attention_mask: torch.Tensor | None, layer_past: Any = None, use_cache: bool = False,
                output_attentions: bool = False, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, length, _ = hidden_states.shape
        fused = self.query_key_value(hidden_states).view(batch, length, self.n_heads, 3, self.d_head)
        q, k, v = (fused[..., i, :].transpose(1, 2) for i in range(3))  # [batch, head, pos, d_head]
        if layer_past is not None:
            k, v = layer_past.update(k, v, self.layer_idx)
        bias = alibi.view(batch, self.n_heads, 1, -1) * self.beta  # [batch, head, 1, k_pos]
        output, probs = attend(self, q, k, v, attention_mask, scaling=self.scaling,
            dropout=self.attention_dropout.p if self.training else 0.0, position_bias=bias,
        )  # output: [batch, pos, head, d_head]
        output = self.dense(output.reshape(batch, length, self.n_heads * self.d_head))
        output = residual + nn.functional.dropout(output, p=self.hidden_dropout, training=self.training)
        return output, probs


class MptAttentionBridge(nn.Module):
    """Stands in for ``MptAttention``: the same fused q/k/v (clipped where the config clips) and output weights;
    ALiBi's per-head bias by distance (``position_bias``, ``[head, 1, max_pos]``) added to the scaled scores.
    MPT's boolean mask is True where a key is *masked*: the bridge passes its inverse (True = keep)."""

    def __init__(self, original: nn.Module, attention: Attend) -> None:
        super().__init__()
        self.attnscope_attention = attention
        self.Wqkv, self.out_proj = cast(nn.Linear, original.Wqkv), cast(nn.Linear, original.out_proj)
        self.n_heads, self.d_head = int(cast(int, original.n_heads)), int(cast(int, original.head_dim))
        self.scaling = float(cast(float, original.softmax_scale))
        self.clip_qkv = cast("float | None", original.clip_qkv)
        self.p_dropout, self.layer_idx = float(cast(float, original.attn_dropout_p)), original.layer_idx
        self.is_causal = True
        self.train(original.training)

    def forward(self, hidden_states: torch.Tensor, position_bias: torch.Tensor | None, cache: Any = None,
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        fused = self.Wqkv(hidden_states)
        if self.clip_qkv:
            fused = fused.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = (heads(part, self.d_head) for part in fused.chunk(3, dim=2))
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        bias = None if position_bias is None else position_bias[:, -q.shape[2]:, -k.shape[2]:][None]
        keep = None if attention_mask is None else ~attention_mask
        output, probs = attend(self, q, k, v, keep, scaling=self.scaling, position_bias=bias,
                               dropout=self.p_dropout if self.training else 0.0)
        return self.out_proj(output.reshape(*hidden_states.shape[:2], self.n_heads * self.d_head)), probs


BRIDGES: dict[str, Bridge] = {"BloomAttention": BloomAttentionBridge, "MptAttention": MptAttentionBridge}
