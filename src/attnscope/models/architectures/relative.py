"""Attention with relative-position terms that the model computes with its own methods: DeBERTa (v1 and v2: content-to-
position and position-to-content terms) and XLNet (relative-position and segment terms). The bridges pass those
terms to the attention function as its position bias, so the captured weights are the softmax of content scores
plus those terms: the probabilities the model mixes its values with.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ...errors import AttnscopeError
from ..adapters import Adapter, SiteRule
from .bridging import Attend, Bridge, adopt, attend, inner_replaced

ADAPTERS: tuple[Adapter, ...] = (
    Adapter("deberta", ("deberta", "deberta-v2"), (SiteRule("self", r"encoder\.layer\.(\d+)\.attention\.self$", "../output.dense"),),
            note="disentangled attention: each weight is the softmax of content-to-content plus relative-position "
            "terms (content-to-position, position-to-content), as DeBERTa mixes its values; DeBERTa computes it "
            "itself: attnscope bridges it"),
    # no out_proj: XLNet's output projection is a parameter (``o``, [d_model, head, d_head]), not a module
    Adapter("xlnet", ("xlnet",), (SiteRule("self", r"layer\.(\d+)\.rel_attn$", "", causal=None),),
            note="relative attention: each weight is the softmax of content plus relative-position and segment "
            "terms; XLNet computes it itself: attnscope bridges it; its two-stream "
            "pretraining mode (target_mapping) runs attention twice per layer and is refused"),
)


class DebertaV2AttentionBridge(nn.Module):
    """Stands in for DeBERTa-v2's ``DisentangledSelfAttention``: the same projections, and its disentangled
    relative-position terms (content-to-position and position-to-content, computed by DeBERTa's own method) as
    the position bias added to the content-to-content scores, all scaled by 1/sqrt(d_head * terms). The
    captured weights are the softmax of that sum: the probabilities DeBERTa mixes its values with."""

    # given by adopt (the original's methods bound to the bridge, its plain attributes): declared for type checkers
    transpose_for_scores: Callable[..., torch.Tensor]
    disentangled_attention_bias: Callable[..., torch.Tensor]
    pos_att_type: Sequence[str]
    num_attention_heads: int
    query_proj: nn.Module
    key_proj: nn.Module
    value_proj: nn.Module
    pos_dropout: nn.Module

    def __init__(self, original: nn.Module, attention: Attend) -> None:
        super().__init__()
        self.attnscope_attention = attention
        adopt(self, original, ("transpose_for_scores", "disentangled_attention_bias"))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, output_attentions: bool = False,
                query_states: torch.Tensor | None = None, relative_pos: torch.Tensor | None = None,
                rel_embeddings: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        n_heads = self.num_attention_heads
        queries = hidden_states if query_states is None else query_states
        q, k, v = (self.transpose_for_scores(proj(states), n_heads) for proj, states in
                   ((self.query_proj, queries), (self.key_proj, hidden_states), (self.value_proj, hidden_states)))
        terms = 1 + sum(kind in self.pos_att_type for kind in ("c2p", "p2c"))
        bias = None
        if self.relative_attention:
            bias = self.disentangled_attention_bias(q, k, relative_pos, self.pos_dropout(rel_embeddings), terms)
            bias = bias.view(-1, n_heads, *bias.shape[-2:])  # [batch, head, q_pos, k_pos]
        q, k, v = (t.view(-1, n_heads, *t.shape[-2:]) for t in (q, k, v))  # [batch, head, pos, d_head]
        return _disentangled(self, q, k, v, attention_mask, terms, bias, output_attentions)


class DebertaAttentionBridge(nn.Module):
    """Stands in for DeBERTa's (v1) ``DisentangledSelfAttention``: its fused projection and biases, and its
    relative-position terms (by its own method) as the position bias, as :class:`DebertaV2AttentionBridge`.
    Talking heads (``talking_head``: weights mixed across heads after the softmax) are refused."""

    # given by adopt, as in DebertaV2AttentionBridge
    transpose_for_scores: Callable[..., torch.Tensor]
    disentangled_att_bias: Callable[..., torch.Tensor]
    pos_att_type: Sequence[str]
    q_bias: torch.Tensor
    v_bias: torch.Tensor
    in_proj: nn.Module
    pos_dropout: nn.Module

    def __init__(self, original: nn.Module, attention: Attend) -> None:
        super().__init__()
        self.attnscope_attention = attention
        if original.head_weights_proj is not None:
            raise AttnscopeError("model type 'deberta' with talking_head mixes the attention weights across heads "
                                 "after the softmax, which attnscope's bridge does not reproduce; load it with "
                                 "talking_head: false")
        adopt(self, original, ("transpose_for_scores", "disentangled_att_bias"))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, output_attentions: bool = False,
                query_states: torch.Tensor | None = None, relative_pos: torch.Tensor | None = None,
                rel_embeddings: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        if query_states is not None:
            raise AttnscopeError("model type 'deberta': a call with separate query states (its enhanced mask "
                                 "decoder) is not bridged by attnscope; capture the encoder's attention")
        q, k, v = self.transpose_for_scores(self.in_proj(hidden_states)).chunk(3, dim=-1)  # [batch, head, pos, d]
        q, v = q + self.transpose_for_scores(self.q_bias[None, None, :]), v + self.transpose_for_scores(
            self.v_bias[None, None, :])
        terms = 1 + len(self.pos_att_type)
        bias = None
        if self.relative_attention and rel_embeddings is not None and relative_pos is not None:
            scaled = q / math.sqrt(q.shape[-1] * terms)  # DeBERTa's terms take the scaled queries
            bias = self.disentangled_att_bias(scaled, k, relative_pos, self.pos_dropout(rel_embeddings), terms)
        return _disentangled(self, q, k, v, attention_mask, terms, bias, output_attentions)


def _disentangled(bridge: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor,
                  terms: int, bias: torch.Tensor | None, output_attentions: bool) -> tuple[torch.Tensor, Any]:
    """DeBERTa's attention of ``[batch, head, pos, d_head]`` q/k/v: scores scaled by 1/sqrt(d_head * terms)
    plus the relative-position ``bias``, its boolean mask (1 = keep); ``(context [batch, pos, width], weights)``."""
    output, probs = attend(bridge, q, k, v, attention_mask.bool(), scaling=(q.shape[-1] * terms) ** -0.5,
                           position_bias=bias, dropout=bridge.dropout.p if bridge.training else 0.0)
    return output.reshape(*output.shape[:2], -1), probs if output_attentions else None


def _xlnet_attn_core(self: Any, q_head: torch.Tensor, k_head_h: torch.Tensor, v_head_h: torch.Tensor,
                     k_head_r: torch.Tensor, seg_mat: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                     output_attentions: bool = False) -> Any:
    """XLNet's relative attention, time-major: q ``[q_pos, batch, head, d_head]``, k/v ``[k_pos, batch, head,
    d_head]``, its relative-position keys ``k_head_r``, its segment matrix and its mask (1 = hidden, ``[q_pos,
    k_pos, batch, 1 or head]``). Content scores (queries plus ``r_w_bias``) go through attnscope; the
    position and segment terms, computed as XLNet does, are the position bias; all scaled by ``scale``.
    Returns the output ``[q_pos, batch, head, d_head]`` (and the weights as ``[q_pos, k_pos, batch, head]``)."""
    to_heads_first = "ibnd->bnid"
    q, k, v = (torch.einsum(to_heads_first, t) for t in (q_head + self.r_w_bias, k_head_h, v_head_h))
    bias = self.rel_shift_bnij(torch.einsum("ibnd,jbnd->bnij", q_head + self.r_r_bias, k_head_r), klen=k.shape[2])
    if seg_mat is not None:
        segment = torch.einsum("ibnd,snd->ibns", q_head + self.r_s_bias, self.seg_embed)
        bias = bias + torch.einsum("ijbs,ibns->bnij", seg_mat, segment)
    keep = None if attn_mask is None else torch.einsum("ijbn->bnij", attn_mask) == 0  # [batch, 1|head, q, k]
    output, probs = attend(self, q, k, v, keep, scaling=self.scale, position_bias=bias * self.scale,
                           dropout=self.dropout.p if self.training else 0.0)
    output = output.transpose(0, 1)  # [batch, q_pos, head, d] -> [q_pos, batch, head, d]
    if not output_attentions:
        return output
    return output, None if probs is None else torch.einsum("bnij->ijbn", probs)


def _xlnet_causal(self: Any, config: Any) -> None:
    """XLNet's modules do not keep whether the model attends one way (``attn_type`` "uni") or both ways."""
    self.is_causal = config.attn_type == "uni"


BRIDGES: dict[str, Bridge] = {  # keyed by module path: both DeBERTas name their class DisentangledSelfAttention
    "transformers.models.deberta_v2.modeling_deberta_v2.DisentangledSelfAttention": DebertaV2AttentionBridge,
    "transformers.models.deberta.modeling_deberta.DisentangledSelfAttention": DebertaAttentionBridge,
    "XLNetRelativeAttention": inner_replaced("rel_attn_core", _xlnet_attn_core, configure=_xlnet_causal),
}
