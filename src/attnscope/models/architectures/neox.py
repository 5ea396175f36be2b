"""Rotary decoders with a fused ``query_key_value`` and a ``dense`` output: GPT-NeoX (through ``AttentionInterface``),
GPT-NeoX-Japanese (bridged: its inner ``_attn``) and Falcon with rotary positions (bridged, by its own q/k/v split
and rotation; Falcon picks its attention class by the implementation's name, so it is loaded with eager attention,
then bridged; ALiBi Falcon is refused).
"""

from __future__ import annotations

import importlib
from functools import partial
from typing import Any, cast

import torch
from torch import nn

from ...errors import AttnscopeError
from ..adapters import Adapter, ModuleRule, SiteRule
from .bridging import Attend, Bridge, attend, inner_replaced

ADAPTERS: tuple[Adapter, ...] = (
    Adapter("gpt-neox", ("gpt_neox",), (SiteRule("self", r"layers\.(\d+)\.attention$", "dense", causal=True),),
            blocks=(ModuleRule("self", r"layers\.(\d+)$"),), ffn=(ModuleRule("self", r"layers\.(\d+)\.mlp$"),)),
    Adapter("falcon", ("falcon",), (SiteRule("self", r"(?:^|\.)h\.(\d+)\.self_attention$", "dense", causal=True),),
            blocks=(ModuleRule("self", r"(?:^|\.)h\.(\d+)$"),), ffn=(ModuleRule("self", r"(?:^|\.)h\.(\d+)\.mlp$"),),
            note="Falcon computes attention itself and picks its attention class by name: attnscope loads it with "
            "eager attention and routes it through the capture function with a bridge", loaded_eager=True),
)


class FalconAttentionBridge(nn.Module):
    """Stands in for ``FalconAttention`` with rotary positions (multi-query, grouped or multi-head keys): the
    same fused q/k/v and output weights, split and rotated by Falcon's own functions."""

    num_heads: int  # set from the original's attributes in __init__: declared for type checkers
    head_dim: int

    def __init__(self, original: nn.Module, attention: Attend) -> None:
        super().__init__()
        self.attnscope_attention = attention
        config = cast(Any, original.config)
        if config.alibi:
            raise AttnscopeError("model type 'falcon' with alibi: true folds its ALiBi bias into the mask, which "
                                 "attnscope's bridge does not reproduce yet; only Falcon with rotary positions (the "
                                 "released 7B/40B/180B models) is supported")
        self.query_key_value, self.dense = (cast(nn.Module, getattr(original, name)) for name in ("query_key_value",
                                                                                                   "dense"))
        for name in ("num_heads", "head_dim", "num_kv_heads", "new_decoder_architecture", "multi_query", "layer_idx"):
            setattr(self, name, getattr(original, name))
        modeling = importlib.import_module(type(original).__module__)
        # Falcon's own q/k/v layouts (getattr: nn.Module's type does not declare Falcon's method)
        self._split_heads = partial(getattr(type(original), "_split_heads"), self)  # noqa: B009
        self._rotate = modeling.apply_rotary_pos_emb
        self.is_causal = True
        self.train(original.training)

    def forward(self, hidden_states: torch.Tensor, alibi: torch.Tensor | None, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None = None, layer_past: Any = None, use_cache: bool = False,
                output_attentions: bool = False, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, length, _ = hidden_states.shape
        n_kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
        q, k, v = self._split_heads(self.query_key_value(hidden_states))  # each [batch, pos, head, d_head]
        q = q.transpose(1, 2).reshape(batch, self.num_heads, length, self.head_dim)
        k, v = (t.transpose(1, 2).reshape(batch, n_kv_heads, length, self.head_dim) for t in (k, v))
        assert position_embeddings is not None  # rotary Falcon always passes them
        q, k = self._rotate(q, k, *position_embeddings)
        if layer_past is not None:
            k, v = layer_past.update(k, v, self.layer_idx)
        output, probs = attend(self, q, k, v, attention_mask, scaling=self.head_dim**-0.5)
        return self.dense(output.reshape(batch, length, self.num_heads * self.head_dim)), probs


def _neox_japanese_attn(self: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GPT-NeoX-Japanese's ``_attn``: rotated ``[batch, head, pos, d_head]`` q/k/v in, the output in the same
    layout (its forward merges the heads) and the weights out; scores divided by sqrt(d_head)."""
    output, probs = attend(self, query, key, value, attention_mask, scaling=1.0 / self.norm_factor,
                           dropout=self.attention_dropout.p if self.training else 0.0)
    return output.transpose(1, 2), probs


BRIDGES: dict[str, Bridge] = {
    "FalconAttention": FalconAttentionBridge,
    "GPTNeoXJapaneseAttention": inner_replaced("_attn", _neox_japanese_attn, is_causal=True),
}
