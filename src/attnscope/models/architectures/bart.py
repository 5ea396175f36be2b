"""BART-like encoder-decoders: BART, Marian, BlenderBot (post-LN) and mBART, Pegasus, M2M-100 (pre-LN) through
``AttentionInterface``; the copies that compute BART's attention inline, bridged (:class:`BartStyleAttentionBridge`:
XGLM, MVP, TrOCR; FSMT's time-major layout); ProphetNet (the main stream of its n-gram attention); Pegasus-X,
refused (its encoder's learned global tokens are no tokens of the input).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ...errors import AttnscopeError
from ..adapters import PRE_LN, Adapter, LayerNorms, ModuleRule, SiteRule
from .bridging import Attend, Bridge, attend, cached, eager_scores, heads, inner_replaced, refused

BART_POST_LN = LayerNorms((ModuleRule("encoder", r"encoder\.layers\.(\d+)\.self_attn_layer_norm$"),),
                          (ModuleRule("encoder", r"encoder\.layers\.(\d+)\.final_layer_norm$"),))
BART_LIKE = (
    SiteRule("encoder", r"encoder\.layers\.(\d+)\.self_attn$", "out_proj"),
    SiteRule("decoder", r"decoder\.layers\.(\d+)\.self_attn$", "out_proj", causal=True),
    SiteRule("cross", r"decoder\.layers\.(\d+)\.encoder_attn$", "out_proj"),
)

BART_BLOCKS = (ModuleRule("encoder", r"encoder\.layers\.(\d+)$"), ModuleRule("decoder", r"decoder\.layers\.(\d+)$"))
BART_FFN = (ModuleRule("encoder", r"encoder\.layers\.(\d+)\.fc2$"), ModuleRule("decoder", r"decoder\.layers\.(\d+)\.fc2$"))


ADAPTERS: tuple[Adapter, ...] = (
    Adapter(
        "bart",
        ("bart", "marian", "blenderbot-small"),
        BART_LIKE,
        blocks=BART_BLOCKS,
        ffn=BART_FFN,
        norms=BART_POST_LN,
    ),
    Adapter(  # the same modules as BART, but each normalises before its sublayer
        "mbart",
        ("mbart", "pegasus", "m2m_100", "blenderbot"),
        BART_LIKE,
        blocks=BART_BLOCKS,
        ffn=BART_FFN,
        norms=PRE_LN,
    ),
    Adapter("prophetnet", ("prophetnet",),
            (*BART_LIKE[:2], SiteRule("cross", r"decoder\.layers\.(\d+)\.cross_attn$", "out_proj")),
            note="its decoder's self-attention is the main stream of its n-gram attention (as transformers' "
            "decoder_attentions), its cross-attention the main stream's rows; the predicting streams' weights are "
            "not recorded; ProphetNet computes attention itself: attnscope bridges it"),
)


class BartStyleAttentionBridge(nn.Module):
    """Stands in for the BART-style attention that XGLM, MVP and TrOCR still compute inline (self-attention and,
    with ``key_value_states``, cross-attention): the same q/k/v/out weights and scaling, the model's additive
    mask. The modules do not say whether they are causal (one class serves self- and cross-attention), so each
    call says: cross-attention and an encoder's self-attention are not, a decoder's self-attention is."""

    def __init__(self, original: nn.Module, attention: Attend) -> None:
        super().__init__()
        self.attnscope_attention = attention
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (cast(nn.Linear, getattr(original, f"{n}_proj"))
                                                                 for n in ("q", "k", "v", "out"))
        self.n_heads, self.d_head = int(cast(int, original.num_heads)), int(cast(int, original.head_dim))
        self.scaling, self.p_dropout = float(cast(float, original.scaling)), float(cast(float, original.dropout))
        self.layer_idx = cast("int | None", original.layer_idx)
        self.is_decoder = bool(getattr(original, "is_decoder", False))
        self.train(original.training)

    def forward(self, hidden_states: torch.Tensor, key_value_states: torch.Tensor | None = None, cache: Any = None,
                attention_mask: torch.Tensor | None = None, attn_prompt: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if attn_prompt is not None:
            raise AttnscopeError("model type 'mvp' with use_prompt adds prompt keys that are no tokens of the input, "
                                 "which attnscope's [q_pos, k_pos] records cannot hold; load it with use_prompt: false")
        cross = key_value_states is not None
        current = key_value_states if cross else hidden_states
        q = heads(self.q_proj(hidden_states), self.d_head)
        k, v = cached(cache, self.layer_idx, cross, heads(self.k_proj(current), self.d_head),
                       heads(self.v_proj(current), self.d_head), kwargs)
        output, probs = attend(self, q, k, v, attention_mask, scaling=self.scaling,
                               dropout=self.p_dropout if self.training else 0.0,
                               is_causal=self.is_decoder and not cross)
        return self.out_proj(output.reshape(*hidden_states.shape[:2], self.n_heads * self.d_head)), probs


class FSMTAttentionBridge(BartStyleAttentionBridge):
    """Stands in for FSMT's ``Attention`` (time-major ``[pos, batch, width]``, self- or cross-attention): the same
    q/k/v/out weights and scaling; its additive ``attn_mask`` (the decoder's causal one) and boolean
    ``key_padding_mask`` (True = padding) joined in one additive mask, always given (zeros where FSMT gives
    neither: so each call says which keys are seen, and the site's causality is its kind's)."""

    def __init__(self, original: nn.Module, attention: Attend) -> None:
        super().__init__(original, attention)
        self.cross, self.cache_key = bool(original.encoder_decoder_attention), original.cache_key

    def forward(  # type: ignore[override]  # FSMT's own signature
            self, query: torch.Tensor, key: torch.Tensor | None, key_padding_mask: torch.Tensor | None = None,
            layer_state: Any = None, attn_mask: torch.Tensor | None = None, output_attentions: bool = False,
            **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        length, batch, width = query.shape
        source = key if self.cross else query
        assert source is not None  # FSMT always gives its cross-attention the encoder's states
        states = source.transpose(0, 1)  # [batch, pos, width]
        q = heads(self.q_proj(query.transpose(0, 1)), self.d_head)
        k, v = cached(layer_state, self.layer_idx, self.cross, heads(self.k_proj(states), self.d_head),
                       heads(self.v_proj(states), self.d_head), kwargs)
        # additive, as FSMT applies it: its causal attn_mask ([q_pos, k_pos], 0 or -inf) added, then every padded
        # key ([batch, k_pos], True = padding) set to the dtype's minimum whatever the causal mask said
        mask = torch.zeros((1, 1, length, k.shape[2]), dtype=q.dtype, device=q.device)
        if attn_mask is not None:
            mask = mask + attn_mask.to(q.dtype)
        if key_padding_mask is not None and key_padding_mask.dim() > 0:
            mask = mask.masked_fill(key_padding_mask.bool()[:, None, None, :], torch.finfo(q.dtype).min)
        output, probs = attend(self, q, k, v, mask, scaling=self.scaling,
                               dropout=self.p_dropout if self.training else 0.0)
        output = self.out_proj(output.reshape(batch, length, width).transpose(0, 1))  # back to [pos, batch, width]
        return output, probs if output_attentions else None


def _prophetnet_forward(self: Any, hidden_states: torch.Tensor, key_value_states: torch.Tensor | None = None,
                        attention_mask: torch.Tensor | None = None, cache: Any = None,
                        output_attentions: bool = False, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ProphetNet's encoder self-attention and decoder cross-attention: ``[batch, pos, width]`` in, ``(output,
    scores?)`` out. Its ``output_attentions`` returns the scores *before* the softmax (with the mask added): the
    bridge returns those too, computed as ProphetNet computes them; the record holds the softmax of them."""
    cross = key_value_states is not None
    current = key_value_states if cross else hidden_states
    q = heads(self.query_proj(hidden_states), self.head_dim)  # [batch, head, q_pos, d_head]
    k, v = cached(cache, self.layer_idx, cross, heads(self.key_proj(current), self.head_dim),
                   heads(self.value_proj(current), self.head_dim), kwargs)
    if attention_mask is not None and attention_mask.dim() == 0:  # ProphetNet's placeholder for no mask
        attention_mask = None
    output, _ = attend(self, q, k, v, attention_mask, scaling=self.head_dim**-0.5,
                       dropout=self.attention_dropout if self.training else 0.0)
    output = self.out_proj(output.reshape(*hidden_states.shape[:2], -1))
    output = nn.functional.dropout(output, p=self.dropout, training=self.training)
    scores = eager_scores(q, k, attention_mask, self.head_dim**-0.5) if output_attentions else None
    return output, scores


def _prophetnet_ngram_forward(self: Any, hidden_states: torch.Tensor, cache: Any = None,
                              attention_mask: torch.Tensor | None = None,
                              main_relative_position_buckets: torch.Tensor | None = None,
                              position_ids: torch.Tensor | None = None, **kwargs: Any) -> tuple[Any, ...]:
    """ProphetNet's n-gram decoder self-attention: ``[batch, (1 + ngram) * pos, width]`` in (the main stream,
    then each predicting stream), ``(output, main weights, predicting weights)`` out. The model's own forward
    computes both streams (and fills the cache once); the main stream, the one a record holds (as eager's
    ``decoder_attentions``), is then recomputed through attnscope, with ProphetNet's relative-position term
    as the position bias, and its output replaces the model's."""
    output, _, predict_probs = super(type(self), self).forward(
        hidden_states, cache=cache, attention_mask=attention_mask,
        main_relative_position_buckets=main_relative_position_buckets, position_ids=position_ids, **kwargs)
    batch, length = hidden_states.shape[0], hidden_states.shape[1] // (1 + self.ngram)
    main = hidden_states[:, :length]  # [batch, pos, width]
    q = heads(self.query_proj(main), self.head_dim)  # [batch, head, pos, d_head]
    if cache is None:
        k, v = (heads(projection(main), self.head_dim) for projection in (self.key_proj, self.value_proj))
    else:  # the keys and values the model's forward just cached
        stored = getattr(cache, "self_attention_cache", cache).layers[self.layer_idx]
        k, v = stored.keys, stored.values
    shape = q.new_empty(batch, self.num_attn_heads, length, k.shape[2])  # the method reads only the shape
    bias = self.get_main_relative_pos_embeddings(main, shape, position_ids, main_relative_position_buckets)
    main_output, probs = attend(self, q, k, v, attention_mask, scaling=self.head_dim**-0.5,
                                position_bias=bias,
                                dropout=self.attention_dropout if self.training else 0.0)
    main_output = self.out_proj(main_output.reshape(batch, length, -1))
    main_output = nn.functional.dropout(main_output, p=self.dropout, training=self.training)
    return torch.cat([main_output, output[:, length:]], dim=1), probs, predict_probs


BRIDGES: dict[str, Bridge] = {
    **dict.fromkeys(("XGLMAttention", "MvpAttention", "TrOCRAttention"), BartStyleAttentionBridge),
    "transformers.models.fsmt.modeling_fsmt.Attention": FSMTAttentionBridge,  # a class name too common alone
    "ProphetNetAttention": inner_replaced("forward", _prophetnet_forward, is_causal=False),
    "ProphetNetNgramSelfAttention": inner_replaced("forward", _prophetnet_ngram_forward, is_causal=True),
    # attention over positions that are not the input's tokens: refused where the model loads
    "PegasusXGlobalLocalAttention": refused(
        "model type 'pegasus_x': its encoder attends over learned global tokens beside blocks of the input's tokens, "
        "which attnscope's [q_pos, k_pos] records cannot hold (transformers' eager path returns none of it either); "
        "no setting of the model turns them off"),
}
