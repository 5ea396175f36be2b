"""BERT-like encoders: BERT and the types that keep its modules (RoBERTa, ELECTRA, ..., through ``AttentionInterface``),
DistilBERT, MPNet, and BERT's older copies that compute attention inline, bridged: Megatron-BERT, RemBERT, TAPAS,
VisualBERT and RoFormer (:class:`BertStyleAttentionBridge`), LUKE on words alone, I-BERT unquantised, SqueezeBERT's
channels-first layout (whose eager ``output_attentions`` returns scores before the softmax) and MPNet.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ...errors import AttnscopeError
from ..adapters import Adapter, HeadProjections, LayerNorms, ModuleRule, SiteRule, model_type_of
from .bridging import Attend, Bridge, attend, eager_scores, heads, inner_replaced

ADAPTERS: tuple[Adapter, ...] = (
    Adapter(
        "bert",
        ("bert", "roberta", "xlm-roberta", "electra", "camembert", "data2vec-text", "ernie"),
        (SiteRule("self", r"layer\.(\d+)\.attention\.self$", "../output.dense"),),
        blocks=(ModuleRule("self", r"encoder\.layer\.(\d+)$"),),
        ffn=(ModuleRule("self", r"layer\.(\d+)\.output\.dense$"),),
        final=(),  # AutoModel: last_hidden_state is the last layer's output
        projections=HeadProjections("query", "key", "value", head_count=("num_attention_heads",),
                                    width=("all_head_size",)),
        norms=LayerNorms((ModuleRule("self", r"layer\.(\d+)\.attention\.output\.LayerNorm$"),),
                         (ModuleRule("self", r"layer\.(\d+)\.output\.LayerNorm$"),)),
    ),
    Adapter(  # BERT's attention modules, computed through AttentionInterface, around other layer layouts
        "bert-like",
        ("bert-generation", "esm", "markuplm", "mobilebert", "roberta-prelayernorm", "roc_bert", "splinter",
         "xlm-roberta-xl", "xmod", "megatron-bert", "rembert", "tapas", "visual_bert", "roformer", "luke", "ibert"),
        (SiteRule("self", r"encoder\.layer\.(\d+)\.attention\.self$", "../output.dense"),),
        note="BERT's attention modules; their layers normalise (pre-LN, a bottleneck) unlike BERT's, so running "
        "from a middle layer onwards, pruning and the whole-layer measures are off; Megatron-BERT, RemBERT, TAPAS, "
        "VisualBERT, RoFormer, LUKE and I-BERT compute attention itself: attnscope bridges it",
    ),
    Adapter(
        "distilbert",
        ("distilbert",),
        (SiteRule("self", r"layer\.(\d+)\.attention$", "out_lin"),),
        blocks=(ModuleRule("self", r"transformer\.layer\.(\d+)$"),),
        ffn=(ModuleRule("self", r"layer\.(\d+)\.ffn$"),),
        final=(),
        norms=LayerNorms((ModuleRule("self", r"layer\.(\d+)\.sa_layer_norm$"),),
                         (ModuleRule("self", r"layer\.(\d+)\.output_layer_norm$"),)),
    ),
    Adapter(
        "mpnet",
        ("mpnet",),
        (SiteRule("self", r"layer\.(\d+)\.attention\.attn$", "o"),),
        blocks=(ModuleRule("self", r"encoder\.layer\.(\d+)$"),),
        ffn=(ModuleRule("self", r"layer\.(\d+)\.output\.dense$"),),
        note="MPNet computes attention itself; attnscope routes it through the capture function "
        "with a bridge module.",
        final=(),
        norms=LayerNorms((ModuleRule("self", r"layer\.(\d+)\.attention\.LayerNorm$"),),
                         (ModuleRule("self", r"layer\.(\d+)\.output\.LayerNorm$"),)),
    ),
)


class MPNetAttentionBridge(nn.Module):
    """Stands in for ``MPNetSelfAttention``: same q/k/v/o weights, attention via attnscope."""

    def __init__(self, original: nn.Module, attention: Attend) -> None:
        super().__init__()
        self.attnscope_attention = attention
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
        output, probs = attend(self, q, k, v, attention_mask, scaling=self.d_head**-0.5,
            dropout=self.dropout.p if self.training else 0.0, position_bias=position_bias,
        )  # output: [batch, pos, head, d_head]
        output = self.o(output.reshape(batch, length, self.n_heads * self.d_head))
        return (output, probs) if output_attentions and probs is not None else (output,)


class BertStyleAttentionBridge(nn.Module):
    """Stands in for the BERT self-attention that older copies still compute inline (Megatron-BERT, RemBERT,
    TAPAS, VisualBERT, RoFormer with its rotary positions): the same query/key/value weights, scores scaled by
    1/sqrt(d_head) plus the model's additive mask. Encoders only: as a decoder (``is_decoder``) these modules keep a cache the bridge does
    not reproduce, and it refuses."""

    ALWAYS_PROBS = frozenset({"MegatronBertSelfAttention", "RemBertSelfAttention", "RoFormerSelfAttention"})  # (context, probs) either way

    def __init__(self, original: nn.Module, attention: Attend) -> None:
        super().__init__()
        self.attnscope_attention = attention
        if getattr(original, "is_decoder", False):
            raise AttnscopeError(f"model type {model_type_of(original)!r} used as a decoder (is_decoder: true) keeps a "
                                 f"key/value cache that attnscope's bridge for its attention does not reproduce; load "
                                 f"it as an encoder (is_decoder: false in its config.json)")
        self.query, self.key, self.value = (cast(nn.Linear, getattr(original, n)) for n in ("query", "key", "value"))
        self.dropout = cast(nn.Dropout, original.dropout)
        self.n_heads, self.d_head = int(cast(int, original.num_attention_heads)), int(cast(int,
                                                                                     original.attention_head_size))
        self.always_probs = type(original).__name__ in self.ALWAYS_PROBS
        self.rotate = getattr(original, "apply_rotary_position_embeddings", None)  # RoFormer's, a static method
        self.rotary_value = bool(getattr(original, "rotary_value", False))
        self.is_causal = False
        self.train(original.training)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                output_attentions: bool = False, sinusoidal_pos: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, ...]:
        q, k, v = (heads(proj(hidden_states), self.d_head) for proj in (self.query, self.key, self.value))
        if sinusoidal_pos is not None:  # RoFormer's rotary positions, by its own function
            assert self.rotate is not None  # only RoFormer passes sinusoidal_pos, and it has the function
            q, k, *rotated_v = self.rotate(sinusoidal_pos, q, k, *([v] if self.rotary_value else []))
            v = rotated_v[0] if rotated_v else v
        output, probs = attend(self, q, k, v, attention_mask, scaling=self.d_head**-0.5,
                               dropout=self.dropout.p if self.training else 0.0)
        output = output.reshape(*hidden_states.shape[:2], self.n_heads * self.d_head)  # [batch, pos, width]
        return (output, probs) if self.always_probs or output_attentions else (output,)


class LukeAttentionBridge(BertStyleAttentionBridge):
    """Stands in for ``LukeSelfAttention`` on words alone: BERT's attention (:class:`BertStyleAttentionBridge`).
    With entity inputs LUKE's queries and keys include entity positions, which are no tokens: refused."""

    def forward(  # type: ignore[override]  # LUKE's own signature
            self, word_hidden_states: torch.Tensor, entity_hidden_states: torch.Tensor | None,
            attention_mask: torch.Tensor | None = None, output_attentions: bool = False) -> tuple[Any, ...]:
        if entity_hidden_states is not None:
            raise AttnscopeError("model type 'luke' with entity inputs attends over entity positions beside the "
                                 "tokens, which attnscope's records of tokens cannot hold; capture it without "
                                 "entity ids")
        output = super().forward(word_hidden_states, attention_mask, output_attentions=True)
        return (output[0], None, output[1]) if output_attentions else (output[0], None)


def _ibert_quantized(original: Any) -> str | None:
    if not original.quant_mode:
        return None
    return ("model type 'ibert' with quant_mode: true computes an integer-only softmax that attnscope's bridge does "
            "not reproduce; load it with quant_mode: false (its float weights are the same)")


def _ibert_forward(self: Any, hidden_states: torch.Tensor, hidden_states_scaling_factor: Any,
                   attention_mask: torch.Tensor | None = None, output_attentions: bool = False) -> tuple[Any, Any]:
    """I-BERT's self-attention with ``quant_mode`` off (its projections and activations are then plain float):
    ``[batch, pos, width]`` in; ``((context, probs?), (None, None?))`` out, as I-BERT returns its outputs and
    their (absent) scaling factors."""
    q, k, v = (activation(projection(hidden_states, hidden_states_scaling_factor)[0], None)[0]
               for projection, activation in ((self.query, self.query_activation), (self.key, self.key_activation),
                                              (self.value, self.value_activation)))
    q, k, v = (heads(t, self.attention_head_size) for t in (q, k, v))  # [batch, head, pos, d_head]
    output, probs = attend(self, q, k, v, attention_mask, scaling=self.attention_head_size**-0.5,
                           dropout=self.dropout.p if self.training else 0.0)
    context, _ = self.output_activation(output.reshape(*hidden_states.shape[:2], self.all_head_size), None)
    return ((context, probs), (None, None)) if output_attentions else ((context,), (None,))


def _squeezebert_forward(self: Any, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                         output_attentions: bool) -> dict[str, torch.Tensor]:
    """SqueezeBERT's self-attention, channels first: ``[batch, width, pos]`` in, ``{"context_layer": [batch, width,
    pos]}`` out. Its ``output_attentions`` returns the scores *before* the softmax (with the mask added): the
    bridge returns those too, computed as SqueezeBERT computes them; the record holds the softmax of them."""
    q = self.transpose_for_scores(self.query(hidden_states))  # [batch, head, pos, d_head]
    k = self.transpose_key_for_scores(self.key(hidden_states)).transpose(2, 3)
    v = self.transpose_for_scores(self.value(hidden_states))
    output, _ = attend(self, q, k, v, attention_mask, scaling=self.attention_head_size**-0.5,
                       dropout=self.dropout.p if self.training else 0.0)
    result = {"context_layer": self.transpose_output(output.transpose(1, 2))}  # [b, q_pos, head, d] -> [b, width, pos]
    if output_attentions:
        result["attention_score"] = eager_scores(q, k, attention_mask, self.attention_head_size**-0.5)
    return result


BRIDGES: dict[str, Bridge] = {
    "MPNetSelfAttention": MPNetAttentionBridge, "LukeSelfAttention": LukeAttentionBridge,
    **dict.fromkeys(("MegatronBertSelfAttention", "RemBertSelfAttention", "TapasSelfAttention",
                     "VisualBertSelfAttention", "RoFormerSelfAttention"), BertStyleAttentionBridge),
    "IBertSelfAttention": inner_replaced("forward", _ibert_forward, _ibert_quantized, is_causal=False),
    "SqueezeBertSelfAttention": inner_replaced("forward", _squeezebert_forward, is_causal=False),
}
