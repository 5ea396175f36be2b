"""XLM and FlauBERT: encoders (causal where the model's ``causal`` says so) whose ``MultiHeadAttention`` computes
attention itself; bridged, with causality read from the model's config (:meth:`XLMAttentionBridge.configure`).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ..adapters import Adapter, SiteRule
from .bridging import Attend, Bridge, attend, cached, heads

ADAPTERS: tuple[Adapter, ...] = (
    Adapter("xlm", ("xlm", "flaubert"), (SiteRule("self", r"(?:^|\.)attentions\.(\d+)$", "out_lin", causal=None),),
            note="XLM and FlauBERT compute attention themselves: attnscope bridges it"),
)


class XLMAttentionBridge(nn.Module):
    """Stands in for XLM's and FlauBERT's ``MultiHeadAttention``: the same q/k/v/out weights, scores scaled by
    1/sqrt(d_head); its mask (1 = keep) is ``[batch, k_pos]`` or, for a causal model, ``[batch, q_pos, k_pos]``.
    Whether it is causal is the model's ``causal`` (:meth:`configure`), which the module does not keep."""

    def __init__(self, original: nn.Module, attention: Attend) -> None:
        super().__init__()
        self.attnscope_attention = attention
        self.q_lin, self.k_lin, self.v_lin, self.out_lin = (cast(nn.Linear, getattr(original, f"{n}_lin"))
                                                             for n in ("q", "k", "v", "out"))
        self.d_head, self.p_dropout = int(cast(int, original.head_dim)), float(cast(float, original.dropout))
        self.layer_id = cast("int | None", original.layer_id)
        self.is_causal = False
        self.train(original.training)

    def configure(self, config: Any) -> None:
        self.is_causal = bool(getattr(config, "causal", False))

    def forward(self, input: torch.Tensor, mask: torch.Tensor, kv: torch.Tensor | None = None, cache: Any = None,
                output_attentions: bool = False, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        batch, length, _ = input.shape
        cross = kv is not None
        current = kv if cross else input
        q = heads(self.q_lin(input), self.d_head)
        k, v = cached(cache, self.layer_id, cross, heads(self.k_lin(current), self.d_head),
                       heads(self.v_lin(current), self.d_head), kwargs)
        keep = (mask != 0).view((batch, 1, length, -1) if mask.dim() == 3 else (batch, 1, 1, -1))
        output, probs = attend(self, q, k, v, keep, scaling=self.d_head**-0.5,
                               dropout=self.p_dropout if self.training else 0.0)
        outputs: tuple[torch.Tensor, ...] = (self.out_lin(output.reshape(batch, length, -1)),)
        return outputs + (probs,) if output_attentions and probs is not None else outputs


BRIDGES: dict[str, Bridge] = {  # a class name too common to key by alone
    "transformers.models.xlm.modeling_xlm.MultiHeadAttention": XLMAttentionBridge,
    "transformers.models.flaubert.modeling_flaubert.MultiHeadAttention": XLMAttentionBridge,
}
