"""Bridges for architectures whose attention does not dispatch through ``AttentionInterface``.

transformers 5 still computes the attention of MPNet, BLOOM, Falcon, GPT-Neo, MPT, GPT-1, XLM and
FlauBERT, XGLM, MVP, TrOCR, FSMT, DeBERTa (v1 and v2), GPT-NeoX-Japanese and BERT's older copies
(Megatron-BERT, RemBERT, TAPAS, VisualBERT, RoFormer, LUKE), I-BERT, SqueezeBERT, ConvBERT, Nyströmformer, XLNet,
ProphetNet, BigBird-Pegasus's encoder, Reformer, Longformer, LED and LongT5's local attention inline. Rather than copy its
modeling code or patch its class, attnscope swaps each such module *instance* for a bridge that reuses the module's own
projections (and, where the model computes extra terms, its own methods) and calls the one capture function,
with a position bias where the model adds one (ALiBi, DeBERTa's relative-position terms). ALBERT, which runs
one attention module several times, gets a bridge for its layer loop that gives each run its own site; HRM,
which runs two stacks of layers in cycles, gets a site per run that its attention modules name at each call.
Bridges are keyed by class name (data, like the adapter table), or by module path and class name where the
name is too common. A model type that picks its attention class by the implementation's name (Falcon) cannot
be built with ``"attnscope"``: it is loaded with ``"eager"`` (:data:`LOADED_EAGER`) and bridged the same way.
Local attention (a band of keys around each query) is computed as a full ``[q_pos, k_pos]`` attention masked to
the band. Attention over positions that are not the input's tokens is refused where the model loads (:func:`_refused`).
"""

from __future__ import annotations

import importlib
import math
from functools import partial
from typing import Any, cast

import torch
from torch import nn

from ..errors import AttnscopeError
from ..models.adapters import model_type_of
from .attention import attention_scores, attnscope_attention


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


class BloomAttentionBridge(nn.Module):
    """Stands in for ``BloomAttention``: the same fused q/k/v and output weights; ALiBi's per-head linear
    bias (``alibi``, ``[batch * head, 1, k_pos]``) is the position bias added to the scaled scores."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
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
        output, probs = attnscope_attention(
            self, q, k, v, attention_mask, scaling=self.scaling,
            dropout=self.attention_dropout.p if self.training else 0.0, position_bias=bias,
        )  # output: [batch, pos, head, d_head]
        output = self.dense(output.reshape(batch, length, self.n_heads * self.d_head))
        output = residual + nn.functional.dropout(output, p=self.hidden_dropout, training=self.training)
        return output, probs


class FalconAttentionBridge(nn.Module):
    """Stands in for ``FalconAttention`` with rotary positions (multi-query, grouped or multi-head keys): the
    same fused q/k/v and output weights, split and rotated by Falcon's own functions."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
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
        self._split_heads = partial(type(original)._split_heads, self)  # Falcon's own q/k/v layouts
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
        output, probs = attnscope_attention(self, q, k, v, attention_mask, scaling=self.head_dim**-0.5)
        return self.dense(output.reshape(batch, length, self.num_heads * self.head_dim)), probs


class GPTNeoAttentionBridge(nn.Module):
    """Stands in for ``GPTNeoSelfAttention``: the same q/k/v/out weights, unscaled scores (GPT-Neo does not
    divide by sqrt(d_head)) and, on its local layers, the sliding window its ``bias`` buffer holds, joined
    to the model's mask."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (cast(nn.Linear, getattr(original, f"{n}_proj"))
                                                                 for n in ("q", "k", "v", "out"))
        self.attn_dropout, self.resid_dropout = cast(nn.Dropout, original.attn_dropout), cast(nn.Dropout,
                                                                                              original.resid_dropout)
        # bool [1, 1, max_pos, max_pos]: causal, and windowed on local layers
        self.register_buffer("allowed", cast(torch.Tensor, original.bias), persistent=False)
        self.n_heads, self.d_head = int(cast(int, original.num_heads)), int(cast(int, original.head_dim))
        self.layer_id = original.layer_id
        local = original.attention_type == "local"
        self.sliding_window = int(cast(Any, original.config).window_size) if local else None
        self.is_causal = True
        self.train(original.training)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, layer_past: Any = None,
                use_cache: bool = False, output_attentions: bool = False,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, length, _ = hidden_states.shape
        split = (batch, length, self.n_heads, self.d_head)
        q, k, v = (proj(hidden_states).view(split).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if layer_past is not None:
            k, v = layer_past.update(k, v, self.layer_id)
        n_keys = k.shape[2]
        keep = self.allowed[:, :, n_keys - length : n_keys, :n_keys]  # [1, 1, q_pos, k_pos]
        if attention_mask is not None:  # the model's additive mask (padding, causality) joined to the window
            keep = keep & (attention_mask[:, :, :, :n_keys] > torch.finfo(attention_mask.dtype).min / 2)
        output, probs = attnscope_attention(self, q.float(), k.float(), v.float(), keep, scaling=1.0,
                                            dropout=self.attn_dropout.p if self.training else 0.0)
        output = self.out_proj(output.reshape(batch, length, self.n_heads * self.d_head).to(hidden_states.dtype))
        return self.resid_dropout(output), probs


def _heads(states: torch.Tensor, d_head: int) -> torch.Tensor:
    """``[batch, pos, head * d_head]`` -> ``[batch, head, pos, d_head]``."""
    return states.view(*states.shape[:2], -1, d_head).transpose(1, 2)


def _cached(cache: Any, layer_idx: int | None, cross: bool, key: torch.Tensor, value: torch.Tensor,
            kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values after the model's cache, as transformers' own modules keep them: an encoder-decoder
    cache holds a self-attention and a cross-attention part, and the cross part is filled once."""
    from transformers.cache_utils import EncoderDecoderCache

    if cache is None:
        return key, value
    part = cache
    if isinstance(cache, EncoderDecoderCache):
        part = cache.cross_attention_cache if cross else cache.self_attention_cache
        if cross and cache.is_updated.get(layer_idx):
            return part.layers[layer_idx].keys, part.layers[layer_idx].values
    key, value = part.update(key, value, layer_idx, kwargs=kwargs)
    if cross and isinstance(cache, EncoderDecoderCache):
        cache.is_updated[layer_idx] = True
    return key, value


class BertStyleAttentionBridge(nn.Module):
    """Stands in for the BERT self-attention that older copies still compute inline (Megatron-BERT, RemBERT,
    TAPAS, VisualBERT, RoFormer with its rotary positions): the same query/key/value weights, scores scaled by
    1/sqrt(d_head) plus the model's additive mask. Encoders only: as a decoder (``is_decoder``) these modules keep a cache the bridge does
    not reproduce, and it refuses."""

    ALWAYS_PROBS = frozenset({"MegatronBertSelfAttention", "RemBertSelfAttention", "RoFormerSelfAttention"})  # (context, probs) either way

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
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
        q, k, v = (_heads(proj(hidden_states), self.d_head) for proj in (self.query, self.key, self.value))
        if sinusoidal_pos is not None:  # RoFormer's rotary positions, by its own function
            q, k, *rotated_v = self.rotate(sinusoidal_pos, q, k, *([v] if self.rotary_value else []))
            v = rotated_v[0] if rotated_v else v
        output, probs = attnscope_attention(self, q, k, v, attention_mask, scaling=self.d_head**-0.5,
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


class BartStyleAttentionBridge(nn.Module):
    """Stands in for the BART-style attention that XGLM, MVP and TrOCR still compute inline (self-attention and,
    with ``key_value_states``, cross-attention): the same q/k/v/out weights and scaling, the model's additive
    mask. The modules do not say whether they are causal (one class serves self- and cross-attention), so each
    call says: cross-attention and an encoder's self-attention are not, a decoder's self-attention is."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (cast(nn.Linear, getattr(original, f"{n}_proj"))
                                                                 for n in ("q", "k", "v", "out"))
        self.n_heads, self.d_head = int(cast(int, original.num_heads)), int(cast(int, original.head_dim))
        self.scaling, self.p_dropout = float(cast(float, original.scaling)), float(cast(float, original.dropout))
        self.layer_idx, self.is_decoder = original.layer_idx, bool(getattr(original, "is_decoder", False))
        self.train(original.training)

    def forward(self, hidden_states: torch.Tensor, key_value_states: torch.Tensor | None = None, cache: Any = None,
                attention_mask: torch.Tensor | None = None, attn_prompt: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if attn_prompt is not None:
            raise AttnscopeError("model type 'mvp' with use_prompt adds prompt keys that are no tokens of the input, "
                                 "which attnscope's [q_pos, k_pos] records cannot hold; load it with use_prompt: false")
        cross = key_value_states is not None
        current = key_value_states if cross else hidden_states
        q = _heads(self.q_proj(hidden_states), self.d_head)
        k, v = _cached(cache, self.layer_idx, cross, _heads(self.k_proj(current), self.d_head),
                       _heads(self.v_proj(current), self.d_head), kwargs)
        output, probs = attnscope_attention(self, q, k, v, attention_mask, scaling=self.scaling,
                                            dropout=self.p_dropout if self.training else 0.0,
                                            is_causal=self.is_decoder and not cross)
        return self.out_proj(output.reshape(*hidden_states.shape[:2], self.n_heads * self.d_head)), probs


class LEDDecoderAttentionBridge(BartStyleAttentionBridge):
    """Stands in for LED's decoder attention (self- and cross-attention), BART's in all but what it returns:
    ``(output, weights if output_attentions, cache)``."""

    def forward(self, hidden_states: torch.Tensor, key_value_states: torch.Tensor | None = None,  # type: ignore[override]
                cache: Any = None, attention_mask: torch.Tensor | None = None, output_attentions: bool = False,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        output, probs = super().forward(hidden_states, key_value_states, cache, attention_mask)
        return output, probs if output_attentions else None, cache


class MptAttentionBridge(nn.Module):
    """Stands in for ``MptAttention``: the same fused q/k/v (clipped where the config clips) and output weights;
    ALiBi's per-head bias by distance (``position_bias``, ``[head, 1, max_pos]``) added to the scaled scores.
    MPT's boolean mask is True where a key is *masked*: the bridge passes its inverse (True = keep)."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.Wqkv, self.out_proj = cast(nn.Linear, original.Wqkv), cast(nn.Linear, original.out_proj)
        self.n_heads, self.d_head = int(cast(int, original.n_heads)), int(cast(int, original.head_dim))
        self.scaling, self.clip_qkv = float(cast(float, original.softmax_scale)), original.clip_qkv
        self.p_dropout, self.layer_idx = float(cast(float, original.attn_dropout_p)), original.layer_idx
        self.is_causal = True
        self.train(original.training)

    def forward(self, hidden_states: torch.Tensor, position_bias: torch.Tensor | None, cache: Any = None,
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        fused = self.Wqkv(hidden_states)
        if self.clip_qkv:
            fused = fused.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        q, k, v = (_heads(part, self.d_head) for part in fused.chunk(3, dim=2))
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        bias = None if position_bias is None else position_bias[:, -q.shape[2]:, -k.shape[2]:][None]
        keep = None if attention_mask is None else ~attention_mask
        output, probs = attnscope_attention(self, q, k, v, keep, scaling=self.scaling, position_bias=bias,
                                            dropout=self.p_dropout if self.training else 0.0)
        return self.out_proj(output.reshape(*hidden_states.shape[:2], self.n_heads * self.d_head)), probs


class OpenAIGPTAttentionBridge(nn.Module):
    """Stands in for GPT-1's ``Attention``: the same fused q/k/v and output ``Conv1D`` weights; its causal
    ``bias`` buffer joined to the model's additive padding mask (GPT-1 masks the future with -1e4, which
    leaves those weights 0 in float32 as the dtype's minimum does)."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.c_attn, self.c_proj = cast(nn.Module, original.c_attn), cast(nn.Module, original.c_proj)
        self.attn_dropout, self.resid_dropout = cast(nn.Dropout, original.attn_dropout), cast(nn.Dropout,
                                                                                              original.resid_dropout)
        self.register_buffer("allowed", cast(torch.Tensor, original.bias).bool(), persistent=False)  # [1, 1, pos, pos]
        self.n_heads, self.width, self.scale = int(cast(int, original.n_head)), int(cast(int, original.split_size)), \
            bool(original.scale)
        self.is_causal = True
        self.train(original.training)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None, output_attentions: bool = False,
                **kwargs: Any) -> list[torch.Tensor]:
        d_head = self.width // self.n_heads
        q, k, v = (_heads(part, d_head) for part in self.c_attn(x).split(self.width, dim=2))
        length = x.shape[1]
        keep = self.allowed[:, :, :length, :length]
        if attention_mask is not None:
            keep = keep & (attention_mask > torch.finfo(attention_mask.dtype).min / 2)
        output, probs = attnscope_attention(self, q, k, v, keep, scaling=d_head**-0.5 if self.scale else 1.0,
                                            dropout=self.attn_dropout.p if self.training else 0.0)
        output = self.resid_dropout(self.c_proj(output.reshape(*x.shape[:2], self.width)))
        return [output, probs] if output_attentions and probs is not None else [output]


class AlbertAttentionRun(nn.Module):
    """One run of a shared ``AlbertAttention``: the same weights (registered here too, so the site's output
    projection is found), attention via attnscope with this run as the module, so each run is its own site."""

    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        for name in ("query", "key", "value", "dense", "LayerNorm", "attention_dropout", "output_dropout"):
            setattr(self, name, getattr(shared, name))
        self.d_head, self.scaling = int(cast(int, shared.attention_head_size)), float(cast(float, shared.scaling))
        self.is_causal = False
        self.train(shared.training)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, k, v = (_heads(proj(hidden_states), self.d_head) for proj in (self.query, self.key, self.value))
        output, probs = attnscope_attention(self, q, k, v, attention_mask, scaling=self.scaling,
                                            dropout=cast(nn.Dropout, self.attention_dropout).p if self.training else 0.0)
        output = self.output_dropout(self.dense(output.reshape(*hidden_states.shape[:2], -1)))
        return self.LayerNorm(hidden_states + output), probs


class AlbertRunsBridge(nn.Module):
    """Stands in for ``AlbertTransformer``. ALBERT shares weights across layers: its ``num_hidden_layers`` layers
    run the layers of ``num_hidden_groups`` groups, one module several times. Each run gets its own site
    (``attention_runs.i``, layer ``i`` of the record: the ``i``-th attention to run, as eager's
    ``output_attentions`` lists them); the layers' other weights are ALBERT's own, applied as ALBERT does."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        from transformers.pytorch_utils import apply_chunking_to_forward

        self._chunked = apply_chunking_to_forward
        self.config = cast(Any, original.config)
        self.embedding_hidden_mapping_in = cast(nn.Linear, original.embedding_hidden_mapping_in)
        self.albert_layer_groups = cast(nn.ModuleList, original.albert_layer_groups)
        self.attention_runs = nn.ModuleList(AlbertAttentionRun(layer.attention) for layer in self._layer_runs())
        self.train(original.training)

    def _layer_runs(self) -> list[Any]:
        """The ``AlbertLayer`` of each run, in order (ALBERT's group of layer ``i``, then each of its layers)."""
        n_layers, n_groups = self.config.num_hidden_layers, self.config.num_hidden_groups
        groups = [self.albert_layer_groups[int(i / (n_layers / n_groups))] for i in range(n_layers)]
        return [layer for group in groups for layer in cast(Any, group).albert_layers]

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs: Any) -> Any:
        from transformers.modeling_outputs import BaseModelOutput

        hidden_states = self.embedding_hidden_mapping_in(hidden_states)
        for layer, run in zip(self._layer_runs(), self.attention_runs, strict=True):
            attention_output, _ = run(hidden_states, attention_mask, **kwargs)
            ffn_output = self._chunked(layer.ff_chunk, layer.chunk_size_feed_forward, layer.seq_len_dim,
                                       attention_output)
            hidden_states = layer.full_layer_layer_norm(ffn_output + attention_output)
        return BaseModelOutput(last_hidden_state=hidden_states)


def _adopt(bridge: nn.Module, original: nn.Module, methods: tuple[str, ...]) -> None:
    """Give ``bridge`` the state of ``original`` (its submodules, its own parameters, its plain attributes) and
    its class's ``methods`` bound to the bridge, so the model's own code computes the terms the bridge adds."""
    for name, child in original.named_children():
        setattr(bridge, name, child)
    for name, parameter in original.named_parameters(recurse=False):
        bridge.register_parameter(name, parameter)
    for name, value in vars(original).items():
        if not name.startswith("_") and isinstance(value, int | float | str | list | tuple) and name != "training":
            setattr(bridge, name, value)
    for name in methods:
        setattr(bridge, name, partial(getattr(type(original), name), bridge))
    bridge.is_causal = False
    bridge.train(original.training)


class DebertaV2AttentionBridge(nn.Module):
    """Stands in for DeBERTa-v2's ``DisentangledSelfAttention``: the same projections, and its disentangled
    relative-position terms (content-to-position and position-to-content, computed by DeBERTa's own method) as
    the position bias added to the content-to-content scores, all scaled by 1/sqrt(d_head * terms). The
    captured weights are the softmax of that sum: the probabilities DeBERTa mixes its values with."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        _adopt(self, original, ("transpose_for_scores", "disentangled_attention_bias"))

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

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        if original.head_weights_proj is not None:
            raise AttnscopeError("model type 'deberta' with talking_head mixes the attention weights across heads "
                                 "after the softmax, which attnscope's bridge does not reproduce; load it with "
                                 "talking_head: false")
        _adopt(self, original, ("transpose_for_scores", "disentangled_att_bias"))

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
    output, probs = attnscope_attention(bridge, q, k, v, attention_mask.bool(), scaling=(q.shape[-1] * terms) ** -0.5,
                                        position_bias=bias, dropout=bridge.dropout.p if bridge.training else 0.0)
    return output.reshape(*output.shape[:2], -1), probs if output_attentions else None


class FSMTAttentionBridge(BartStyleAttentionBridge):
    """Stands in for FSMT's ``Attention`` (time-major ``[pos, batch, width]``, self- or cross-attention): the same
    q/k/v/out weights and scaling; its additive ``attn_mask`` (the decoder's causal one) and boolean
    ``key_padding_mask`` (True = padding) joined in one additive mask, always given (zeros where FSMT gives
    neither: so each call says which keys are seen, and the site's causality is its kind's)."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__(original)
        self.cross, self.cache_key = bool(original.encoder_decoder_attention), original.cache_key

    def forward(  # type: ignore[override]  # FSMT's own signature
            self, query: torch.Tensor, key: torch.Tensor | None, key_padding_mask: torch.Tensor | None = None,
            layer_state: Any = None, attn_mask: torch.Tensor | None = None, output_attentions: bool = False,
            **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        length, batch, width = query.shape
        states = (key if self.cross else query).transpose(0, 1)  # [batch, pos, width]
        q = _heads(self.q_proj(query.transpose(0, 1)), self.d_head)
        k, v = _cached(layer_state, self.layer_idx, self.cross, _heads(self.k_proj(states), self.d_head),
                       _heads(self.v_proj(states), self.d_head), kwargs)
        # additive, as FSMT applies it: its causal attn_mask ([q_pos, k_pos], 0 or -inf) added, then every padded
        # key ([batch, k_pos], True = padding) set to the dtype's minimum whatever the causal mask said
        mask = torch.zeros((1, 1, length, k.shape[2]), dtype=q.dtype, device=q.device)
        if attn_mask is not None:
            mask = mask + attn_mask.to(q.dtype)
        if key_padding_mask is not None and key_padding_mask.dim() > 0:
            mask = mask.masked_fill(key_padding_mask.bool()[:, None, None, :], torch.finfo(q.dtype).min)
        output, probs = attnscope_attention(self, q, k, v, mask, scaling=self.scaling,
                                            dropout=self.p_dropout if self.training else 0.0)
        output = self.out_proj(output.reshape(batch, length, width).transpose(0, 1))  # back to [pos, batch, width]
        return output, probs if output_attentions else None


class XLMAttentionBridge(nn.Module):
    """Stands in for XLM's and FlauBERT's ``MultiHeadAttention``: the same q/k/v/out weights, scores scaled by
    1/sqrt(d_head); its mask (1 = keep) is ``[batch, k_pos]`` or, for a causal model, ``[batch, q_pos, k_pos]``.
    Whether it is causal is the model's ``causal`` (:meth:`configure`), which the module does not keep."""

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        self.q_lin, self.k_lin, self.v_lin, self.out_lin = (cast(nn.Linear, getattr(original, f"{n}_lin"))
                                                             for n in ("q", "k", "v", "out"))
        self.d_head, self.p_dropout = int(cast(int, original.head_dim)), float(cast(float, original.dropout))
        self.layer_id = original.layer_id
        self.is_causal = False
        self.train(original.training)

    def configure(self, config: Any) -> None:
        self.is_causal = bool(getattr(config, "causal", False))

    def forward(self, input: torch.Tensor, mask: torch.Tensor, kv: torch.Tensor | None = None, cache: Any = None,
                output_attentions: bool = False, **kwargs: Any) -> tuple[torch.Tensor, ...]:
        batch, length, _ = input.shape
        cross = kv is not None
        current = kv if cross else input
        q = _heads(self.q_lin(input), self.d_head)
        k, v = _cached(cache, self.layer_id, cross, _heads(self.k_lin(current), self.d_head),
                       _heads(self.v_lin(current), self.d_head), kwargs)
        keep = (mask != 0).view((batch, 1, length, -1) if mask.dim() == 3 else (batch, 1, 1, -1))
        output, probs = attnscope_attention(self, q, k, v, keep, scaling=self.d_head**-0.5,
                                            dropout=self.p_dropout if self.training else 0.0)
        outputs: tuple[torch.Tensor, ...] = (self.out_lin(output.reshape(batch, length, -1)),)
        return outputs + (probs,) if output_attentions and probs is not None else outputs


def _inner_replaced(method: str, compute: Any, refusal: Any = None, **attributes: Any) -> Any:
    """A bridge for a module whose forward computes attention in one inner ``method``: the same instance state
    (weights, buffers, mode) in a subclass of its class whose ``method`` is ``compute``; the rest of its
    forward is the model's own code. ``refusal(original)``, where given, names what the bridge does not
    reproduce (None where it does): attnscope then refuses the model when it loads it."""

    def bridge(original: nn.Module) -> nn.Module:
        if refusal is not None and (reason := refusal(original)) is not None:
            raise AttnscopeError(reason)
        cls = type(original)
        bridged = type(f"{cls.__name__}Bridge", (cls,), {method: compute, **attributes})
        module = bridged.__new__(bridged)
        module.__dict__.update(original.__dict__)
        return cast(nn.Module, module)

    return bridge


def _neox_japanese_attn(self: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GPT-NeoX-Japanese's ``_attn``: rotated ``[batch, head, pos, d_head]`` q/k/v in, the output in the same
    layout (its forward merges the heads) and the weights out; scores divided by sqrt(d_head)."""
    output, probs = attnscope_attention(self, query, key, value, attention_mask, scaling=1.0 / self.norm_factor,
                                        dropout=self.attention_dropout.p if self.training else 0.0)
    return output.transpose(1, 2), probs


def _diffllama_forward(self: Any, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                       attention_mask: torch.Tensor | None = None, cache: Any = None,
                       **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DiffLlama's attention in one softmax per head: its two calls share queries and keys (so their weights are
    the same) and differ in the value halves, so one call with both halves side by side (``[.., 2 * d_head]``)
    gives both outputs; the rest (head pairs combined as out_1 - λ out_2, group norm) is DiffLlama's code."""
    modeling = importlib.import_module(type(self).__mro__[1].__module__)
    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
    q, k = modeling.apply_rotary_pos_emb(q, k, *position_embeddings)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    both = torch.cat([half.repeat(1, 2, 1, 1) for half in torch.chunk(v, 2, dim=1)], dim=-1)  # [b, kv, k, 2 d]
    output, probs = attnscope_attention(self, q, k, both, attention_mask, scaling=self.scaling, **kwargs)
    out_1, out_2 = torch.chunk(output, 2, dim=2)  # [batch, q_pos, head / 2, 2 d_head]: the head pairs
    lambda_1, lambda_2 = (torch.exp(torch.sum(a * b, dim=-1, dtype=torch.float32)).to(q.dtype)
                          for a, b in ((self.lambda_q1, self.lambda_k1), (self.lambda_q2, self.lambda_k2)))
    output = out_1 - (lambda_1 - lambda_2 + self.lambda_init) * out_2
    output = (1 - self.lambda_init) * self.groupnorm(output)
    return self.o_proj(output.reshape(*hidden_states.shape[:-1], -1)), probs



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
    q, k, v = (_heads(t, self.attention_head_size) for t in (q, k, v))  # [batch, head, pos, d_head]
    output, probs = attnscope_attention(self, q, k, v, attention_mask, scaling=self.attention_head_size**-0.5,
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
    output, _ = attnscope_attention(self, q, k, v, attention_mask, scaling=self.attention_head_size**-0.5,
                                    dropout=self.dropout.p if self.training else 0.0)
    result = {"context_layer": self.transpose_output(output.transpose(1, 2))}  # [b, q_pos, head, d] -> [b, width, pos]
    if output_attentions:
        result["attention_score"] = attention_scores(q, k, attention_mask, self.attention_head_size**-0.5)
    return result


def _convbert_forward(self: Any, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      encoder_hidden_states: torch.Tensor | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ConvBERT's mixed attention: ``[batch, pos, width]`` in, ``(context [batch, pos, width], probs)`` out. Its
    self-attention heads go through attnscope; its span-based convolution heads (a softmax over each token's
    ``conv_kernel_size`` neighbours, no attention over the sequence) are ConvBERT's own code, by
    :func:`_convbert_convolution`; the context is the attention heads, then the convolution heads."""
    if encoder_hidden_states is not None:
        raise AttnscopeError("model type 'convbert' used with cross-attention is not bridged by attnscope; capture "
                             "it as an encoder")
    q, k, v = (_heads(projection(hidden_states), self.attention_head_size)
               for projection in (self.query, self.key, self.value))  # [batch, head, pos, d_head]
    output, probs = attnscope_attention(self, q, k, v, attention_mask, scaling=self.attention_head_size**-0.5,
                                        dropout=self.dropout.p if self.training else 0.0)
    convolution = _convbert_convolution(self, hidden_states)  # [batch, pos, head, d_head]
    return torch.cat([output, convolution], dim=2).reshape(*hidden_states.shape[:2], -1), probs


def _convbert_convolution(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """ConvBERT's span-based dynamic convolution heads, ``[batch, pos, width]`` -> ``[batch, pos, head, d_head]``:
    a kernel per token from its query and a separable convolution of its neighbourhood, applied to the
    unfolded ``conv_kernel_size`` neighbours of ``conv_out_layer``'s projection."""
    batch, length, _ = hidden_states.shape
    key_conv = self.key_conv_attn_layer(hidden_states.transpose(1, 2)).transpose(1, 2)
    kernel = self.conv_kernel_layer(key_conv * self.query(hidden_states))
    kernel = torch.softmax(kernel.reshape(-1, self.conv_kernel_size, 1), dim=1)  # [batch * pos * head, kernel, 1]
    spans = self.conv_out_layer(hidden_states).transpose(1, 2).unsqueeze(-1)  # [batch, width, pos, 1]
    spans = nn.functional.unfold(spans, kernel_size=[self.conv_kernel_size, 1],
                                 padding=[(self.conv_kernel_size - 1) // 2, 0])  # [batch, width * kernel, pos]
    spans = spans.transpose(1, 2).reshape(-1, self.attention_head_size, self.conv_kernel_size)
    return torch.matmul(spans, kernel).reshape(batch, length, self.num_attention_heads, self.attention_head_size)


def _nystrom_approximated(original: Any) -> str | None:
    if original.num_landmarks == original.seq_len:
        return None
    return (f"model type 'nystromformer' with {original.num_landmarks} landmarks for {original.seq_len} positions "
            f"approximates attention (Nyström): its weights are not a softmax over the tokens, which attnscope's "
            f"records hold; only num_landmarks equal to segment_means_seq_len (exact softmax attention) is bridged")


def _nystromformer_forward(self: Any, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                           output_attentions: bool = False) -> tuple[torch.Tensor, ...]:
    """Nyströmformer's self-attention where it is exact (as many landmarks as positions: a plain softmax):
    ``[batch, pos, width]`` in, ``(context, probs?)`` out; its depthwise convolution of the values over
    positions (``conv``) is added to the context, as the model does."""
    q, k, v = (_heads(projection(hidden_states), self.attention_head_size)
               for projection in (self.query, self.key, self.value))  # [batch, head, pos, d_head]
    output, probs = attnscope_attention(self, q, k, v, attention_mask, scaling=self.attention_head_size**-0.5,
                                        dropout=0.0)  # Nyströmformer applies no dropout to its weights
    if self.conv_kernel_size is not None:
        output = output + self.conv(v).transpose(1, 2)  # [batch, head, pos, d] -> [batch, pos, head, d]
    output = output.reshape(*hidden_states.shape[:2], self.all_head_size)
    return (output, probs) if output_attentions else (output,)


def _bigbird_pegasus_encoder_forward(self: Any, hidden_states: torch.Tensor,
                                     attention_mask: torch.Tensor | None = None, *masks: Any,
                                     **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """BigBird-Pegasus's encoder attention with full attention (what it runs for inputs too short for its
    blocks): ``[batch, pos, width]`` in, ``(output, probs)`` out. The encoder swaps its inner module by input
    length, so the bridge stands in for the layer's attention, which stays, and reads the inner module's
    projections at each call; block-sparse attention (long inputs) is refused."""
    if self.attention_type != "original_full":
        raise AttnscopeError("model type 'bigbird_pegasus' with block-sparse attention (an input long enough for "
                             "its blocks) attends to random blocks that attnscope's bridge does not reproduce; "
                             "load it with attention_type: original_full")
    inner = self.self
    q, k, v = (_heads(projection(hidden_states), inner.attention_head_size)
               for projection in (inner.query, inner.key, inner.value))  # [batch, head, pos, d_head]
    output, probs = attnscope_attention(self, q, k, v, attention_mask, scaling=inner.attention_head_size**-0.5,
                                        dropout=inner.dropout.p if self.training else 0.0)
    return self.output(output.reshape(*hidden_states.shape[:2], inner.all_head_size)), probs


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
    output, probs = attnscope_attention(self, q, k, v, keep, scaling=self.scale, position_bias=bias * self.scale,
                                        dropout=self.dropout.p if self.training else 0.0)
    output = output.transpose(0, 1)  # [batch, q_pos, head, d] -> [q_pos, batch, head, d]
    if not output_attentions:
        return output
    return output, None if probs is None else torch.einsum("bnij->ijbn", probs)


def _xlnet_causal(self: Any, config: Any) -> None:
    """XLNet's modules do not keep whether the model attends one way (``attn_type`` "uni") or both ways."""
    self.is_causal = config.attn_type == "uni"


def _prophetnet_forward(self: Any, hidden_states: torch.Tensor, key_value_states: torch.Tensor | None = None,
                        attention_mask: torch.Tensor | None = None, cache: Any = None,
                        output_attentions: bool = False, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ProphetNet's encoder self-attention and decoder cross-attention: ``[batch, pos, width]`` in, ``(output,
    scores?)`` out. Its ``output_attentions`` returns the scores *before* the softmax (with the mask added): the
    bridge returns those too, computed as ProphetNet computes them; the record holds the softmax of them."""
    cross = key_value_states is not None
    current = key_value_states if cross else hidden_states
    q = _heads(self.query_proj(hidden_states), self.head_dim)  # [batch, head, q_pos, d_head]
    k, v = _cached(cache, self.layer_idx, cross, _heads(self.key_proj(current), self.head_dim),
                   _heads(self.value_proj(current), self.head_dim), kwargs)
    if attention_mask is not None and attention_mask.dim() == 0:  # ProphetNet's placeholder for no mask
        attention_mask = None
    output, _ = attnscope_attention(self, q, k, v, attention_mask, scaling=self.head_dim**-0.5,
                                    dropout=self.attention_dropout if self.training else 0.0)
    output = self.out_proj(output.reshape(*hidden_states.shape[:2], -1))
    output = nn.functional.dropout(output, p=self.dropout, training=self.training)
    scores = attention_scores(q, k, attention_mask, self.head_dim**-0.5) if output_attentions else None
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
    q = _heads(self.query_proj(main), self.head_dim)  # [batch, head, pos, d_head]
    if cache is None:
        k, v = (_heads(projection(main), self.head_dim) for projection in (self.key_proj, self.value_proj))
    else:  # the keys and values the model's forward just cached
        stored = getattr(cache, "self_attention_cache", cache).layers[self.layer_idx]
        k, v = stored.keys, stored.values
    shape = q.new_empty(batch, self.num_attn_heads, length, k.shape[2])  # the method reads only the shape
    bias = self.get_main_relative_pos_embeddings(main, shape, position_ids, main_relative_position_buckets)
    main_output, probs = attnscope_attention(self, q, k, v, attention_mask, scaling=self.head_dim**-0.5,
                                             position_bias=bias,
                                             dropout=self.attention_dropout if self.training else 0.0)
    main_output = self.out_proj(main_output.reshape(batch, length, -1))
    main_output = nn.functional.dropout(main_output, p=self.dropout, training=self.training)
    return torch.cat([main_output, output[:, length:]], dim=1), probs, predict_probs


def _longformer_forward(self: Any, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                        is_index_masked: torch.Tensor | None = None, is_index_global_attn: torch.Tensor | None = None,
                        is_global_attn: bool | None = None, output_attentions: bool = False) -> tuple[Any, ...]:
    """Longformer's (and LED's encoder's) local attention, ``[batch, pos, width]`` in (padded to its window),
    ``(output [batch, pos, width], band weights?)`` out. Each query sees the keys within
    ``one_sided_attn_window_size`` on either side: computed as a full ``[q_pos, k_pos]`` attention whose mask is
    that band and the model's padding (its ``attention_mask``: 0 = local, else hidden), so the record holds zeros
    outside the band. Global attention (``global_attention_mask``) is refused."""
    if is_global_attn:
        raise AttnscopeError(f"model type {model_type_of(self)!r} with global attention (global_attention_mask) "
                             f"attends from and to chosen tokens in a second softmax that attnscope's bridge does "
                             f"not reproduce; capture it without global_attention_mask (local attention only)")
    q, k, v = (_heads(projection(hidden_states), self.head_dim) for projection in (self.query, self.key, self.value))
    length, window = hidden_states.shape[1], self.one_sided_attn_window_size
    positions = torch.arange(length, device=hidden_states.device)
    band = (positions[:, None] - positions[None, :]).abs() <= window  # [q_pos, k_pos]
    keep = band[None, None] & (attention_mask == 0)[:, None, None, :]  # [batch, 1, q_pos, k_pos]
    output, probs = attnscope_attention(self, q, k, v, keep, scaling=self.head_dim**-0.5,
                                        dropout=self.dropout if self.training else 0.0)
    if is_index_masked is not None:  # Longformer gives padded queries no attention at all
        output = output.masked_fill(is_index_masked[:, :, None, None], 0.0)
    outputs: tuple[Any, ...] = (output.reshape(*hidden_states.shape[:2], -1),)
    if output_attentions and probs is not None:
        outputs += (_as_band(probs, window),)
    return outputs


def _as_band(probs: torch.Tensor, window: int) -> torch.Tensor:
    """Full ``[batch, head, q_pos, k_pos]`` weights in Longformer's band layout ``[batch, q_pos, head, 2 * window
    + 1]``: entry j of query i is key ``i - window + j`` (0 where that key is outside the sequence)."""
    length = probs.shape[-1]
    padded = nn.functional.pad(probs, (window, window))  # key i - window + j sits at column i + j
    columns = torch.arange(length, device=probs.device)[:, None] + torch.arange(2 * window + 1, device=probs.device)
    band = torch.gather(padded, 3, columns.expand(*probs.shape[:2], -1, -1))
    return band.transpose(1, 2)


def _longt5_local_forward(self: Any, hidden_states: torch.Tensor, mask: torch.Tensor | None = None,
                          position_bias: torch.Tensor | None = None,
                          output_attentions: bool = False) -> tuple[torch.Tensor, ...]:
    """LongT5's local encoder attention, ``[batch, pos, width]`` in, ``(output, position bias, weights?)`` out.
    LongT5 attends in blocks of ``block_len`` over the block and its two neighbours, keeping the keys less than
    ``block_len`` away: the same as a full ``[q_pos, k_pos]`` attention masked to that band and the padding, with
    T5's relative-position bias by distance (the record holds zeros outside the band). Its blocked mask
    (``[batch, 1, block, block_len, 3 * block_len]``) gives the padding; the bias it passes on to the next layer
    is the bridge's own ``[1, head, q_pos, k_pos]`` (every local layer is bridged); weights, where returned, are
    ``[batch, head, q_pos, k_pos]``, not LongT5's blocks."""
    length, block_len = hidden_states.shape[1], self.block_len
    q, k, v = (_heads(projection(hidden_states), self.key_value_proj_dim) for projection in (self.q, self.k, self.v))
    distance = torch.arange(length, device=q.device)[None, :] - torch.arange(length, device=q.device)[:, None]
    keep = (distance.abs() < block_len)[None, None]  # [1, 1, q_pos, k_pos]: key j - query i within the band
    if mask is not None:
        keep = keep & _longt5_tokens(mask, block_len, length)[:, None, None, :]
    if position_bias is None:
        position_bias = torch.zeros((1, self.n_heads, length, length), device=q.device, dtype=q.dtype)
        if self.has_relative_attention_bias:
            buckets = self._relative_position_bucket(distance, bidirectional=not self.is_decoder,
                                                     num_buckets=self.relative_attention_num_buckets,
                                                     max_distance=self.relative_attention_max_distance)
            position_bias = self.relative_attention_bias(buckets).permute(2, 0, 1)[None]  # [1, head, q_pos, k_pos]
    output, probs = attnscope_attention(self, q, k, v, keep, scaling=1.0, position_bias=position_bias,
                                        dropout=self.dropout if self.training else 0.0)
    outputs = (self.o(output.reshape(*hidden_states.shape[:2], -1)), position_bias)
    return outputs + (probs,) if output_attentions else outputs


def _longt5_tokens(blocked: torch.Tensor, block_len: int, length: int) -> torch.Tensor:
    """Which positions are tokens (not padding), ``[batch, pos]``, from LongT5's blocked local mask: its entry for
    a query and the same position as key (the middle block's diagonal) is whether that position is a token."""
    blocks = blocked.reshape(blocked.shape[0], -1, block_len, 3 * block_len)  # [batch, block, q, 3 blocks of keys]
    inside = torch.arange(block_len, device=blocked.device)
    return blocks[:, :, inside, block_len + inside].reshape(blocked.shape[0], -1)[:, :length].bool()


def _refused(reason: str) -> Any:
    """A bridge that refuses its module's model in one line (``reason``): attention attnscope's records cannot
    hold, said where the model loads rather than as a module that never called the attention function."""

    def bridge(original: nn.Module) -> nn.Module:
        raise AttnscopeError(reason)

    return bridge


def _reformer_keep(self: Any, attention_mask: torch.Tensor | None, length: int, device: torch.device) -> torch.Tensor:
    """Bool ``[batch or 1, 1, q_pos, k_pos]``: the keys a Reformer query sees over a whole (short) sequence: every
    key that is no padding (its ``attention_mask``, 1 = token), and no later one in a decoder."""
    keep = torch.ones((1, 1, length, length), dtype=torch.bool, device=device)
    if attention_mask is not None:
        keep = keep & attention_mask.bool()[:, None, None, :length]
    return torch.tril(keep) if self.is_decoder else keep


def _reformer_lsh_attend(self: Any, query_vectors: torch.Tensor, key_vectors: torch.Tensor,
                         value_vectors: torch.Tensor, sorted_bucket_idx_per_hash: torch.Tensor,
                         attention_mask: torch.Tensor | None, do_standard_self_attention: bool,
                         use_cache: bool) -> tuple[torch.Tensor, Any, Any]:
    """Reformer's LSH attention where it attends over the whole sequence (no longer than a chunk, no cache): q
    ``[batch, head, pos, d_head]`` and its own keys, normalised; ``(output [batch, head, pos, d_head], None,
    weights)``. A query sees itself only where it sees nothing else: its own logit is lowered by Reformer's
    ``self_mask_value``. Hashed buckets (longer inputs) and cached decoding run the model's own code, which
    calls no attention function, so a capture of them is refused."""
    if not do_standard_self_attention or use_cache:
        return super(type(self), self)._attend(query_vectors, key_vectors, value_vectors, sorted_bucket_idx_per_hash,
                                               attention_mask, do_standard_self_attention, use_cache)
    length = query_vectors.shape[2]
    keep = _reformer_keep(self, attention_mask, length, query_vectors.device)
    itself = torch.eye(length, device=query_vectors.device)[None, None] * self.self_mask_value_float32
    output, probs = attnscope_attention(self, query_vectors, key_vectors, value_vectors, keep, scaling=1.0,
                                        position_bias=itself, dropout=self.dropout if self.training else 0.0)
    return output.transpose(1, 2), None, probs


def _reformer_local_forward(self: Any, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                            past_buckets_states: Any = None, use_cache: bool = False, output_attentions: bool = False,
                            **kwargs: Any) -> Any:
    """Reformer's local attention where one chunk holds the whole sequence (and no cache): ``[batch, pos,
    width]`` in, its output type out. Longer inputs (chunks that see their neighbours) and cached decoding run the
    model's own code, which calls no attention function, so a capture of them is refused."""
    length = hidden_states.shape[1]
    cached = past_buckets_states is not None and len(past_buckets_states) > self.layer_idx
    if cached or (self.chunk_length is not None and length > self.chunk_length):
        return super(type(self), self).forward(hidden_states, attention_mask, past_buckets_states, use_cache,
                                               output_attentions, **kwargs)
    q, k, v = (_heads(projection(hidden_states), self.attention_head_size)
               for projection in (self.query, self.key, self.value))  # [batch, head, pos, d_head]
    output, probs = attnscope_attention(self, q, k, v, _reformer_keep(self, attention_mask, length, q.device),
                                        scaling=self.attention_head_size**-0.5,
                                        dropout=self.dropout if self.training else 0.0)
    modeling = importlib.import_module(type(self).__mro__[1].__module__)
    return modeling.LocalSelfAttentionOutput(hidden_states=output.reshape(*hidden_states.shape[:2], -1),
                                             attention_probs=probs if output_attentions else ())


class AttentionRunSite(nn.Module):
    """One run of an attention module that a model runs several times per forward pass, as a site of its own (no
    weights: the module computes, and names this run's site at each call)."""

    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.is_causal = bool(getattr(shared, "is_causal", False))
        self.num_key_value_groups = getattr(shared, "num_key_value_groups", 1)


def _hrm_runs(original: nn.Module) -> nn.Module:
    """HRM's recurrent model, in place: its L and H stacks run in cycles (``H_cycles`` times the L stack
    ``L_cycles`` times, then the H stack), each run of a layer at the slot ``cycle_offset + layer`` that
    transformers' ``output_attentions`` lists it at. Each slot gets a site (``attention_runs.slot``), and each
    attention module names the site of the slot it runs at (:func:`_hrm_attention_forward`)."""
    config, model = cast(Any, original.config), cast(Any, original)
    per_stack, inner = config.num_layers_per_stack, config.L_cycles
    runs = []
    for slot in range(per_stack * config.H_cycles * (inner + 1)):
        cycle, layer = divmod(slot, per_stack)
        stack = model.H_module if cycle % (inner + 1) == inner else model.L_module
        runs.append(AttentionRunSite(stack.layers[layer].self_attn))
    model.attention_runs = nn.ModuleList(runs)
    replaced = _inner_replaced("forward", _hrm_attention_forward)
    for stack in (model.L_module, model.H_module):
        for layer in stack.layers:
            layer.self_attn = replaced(layer.self_attn)
            object.__setattr__(layer.self_attn, "attnscope_runs", model.attention_runs)  # a reference, no child
    return original


def _hrm_attention_forward(self: Any, hidden_states: torch.Tensor, *args: Any, cycle_offset: int = 0,
                           **kwargs: Any) -> Any:
    """HRM's attention (its own code), as the site of the slot it runs at: ``cycle_offset + layer_idx``."""
    run = self.attnscope_runs[cycle_offset + self.layer_idx]
    self.attnscope_site = getattr(run, "attnscope_site", None)
    return super(type(self), self).forward(hidden_states, *args, cycle_offset=cycle_offset, **kwargs)

BRIDGES: dict[str, Any] = {  # class name -> a callable that makes the bridge of one module
    "MPNetSelfAttention": MPNetAttentionBridge, "BloomAttention": BloomAttentionBridge,
    "FalconAttention": FalconAttentionBridge, "GPTNeoSelfAttention": GPTNeoAttentionBridge,
    **dict.fromkeys(("MegatronBertSelfAttention", "RemBertSelfAttention", "TapasSelfAttention",
                     "VisualBertSelfAttention", "RoFormerSelfAttention"), BertStyleAttentionBridge),
    **dict.fromkeys(("XGLMAttention", "MvpAttention", "TrOCRAttention"), BartStyleAttentionBridge),
    "LukeSelfAttention": LukeAttentionBridge, "LEDDecoderAttention": LEDDecoderAttentionBridge, "MptAttention": MptAttentionBridge, "AlbertTransformer": AlbertRunsBridge,
    "GPTNeoXJapaneseAttention": _inner_replaced("_attn", _neox_japanese_attn, is_causal=True),
    "DiffLlamaAttention": _inner_replaced("forward", _diffllama_forward),
    "IBertSelfAttention": _inner_replaced("forward", _ibert_forward, _ibert_quantized, is_causal=False),
    "SqueezeBertSelfAttention": _inner_replaced("forward", _squeezebert_forward, is_causal=False),
    "ConvBertSelfAttention": _inner_replaced("forward", _convbert_forward, is_causal=False),
    "NystromformerSelfAttention": _inner_replaced("forward", _nystromformer_forward, _nystrom_approximated,
                                                  is_causal=False),
    "XLNetRelativeAttention": _inner_replaced("rel_attn_core", _xlnet_attn_core, configure=_xlnet_causal),
    "ProphetNetAttention": _inner_replaced("forward", _prophetnet_forward, is_causal=False),
    "ProphetNetNgramSelfAttention": _inner_replaced("forward", _prophetnet_ngram_forward, is_causal=True),
    **dict.fromkeys(("LongformerSelfAttention", "LEDEncoderSelfAttention"),
                    _inner_replaced("forward", _longformer_forward, is_causal=False)),
    "LongT5LocalAttention": _inner_replaced("forward", _longt5_local_forward, is_causal=False),
    "LongT5TransientGlobalAttention": _refused(
        "model type 'longt5' with transient-global attention attends to summaries of blocks of tokens beside the "
        "tokens, which attnscope's [q_pos, k_pos] records cannot hold; load it with encoder_attention_type: local"),
    # attention over positions that are not the input's tokens: refused where the model loads
    "PegasusXGlobalLocalAttention": _refused(
        "model type 'pegasus_x': its encoder attends over learned global tokens beside blocks of the input's tokens, "
        "which attnscope's [q_pos, k_pos] records cannot hold (transformers' eager path returns none of it either); "
        "no setting of the model turns them off"),
    "FunnelRelMultiheadAttention": _refused(
        "model type 'funnel' pools its sequence between blocks, so its later layers attend over pooled positions, "
        "which attnscope's [q_pos, k_pos] records cannot hold; attnscope supports no Funnel model yet"),
    "CpmAntAttention": _refused(
        "model type 'cpmant' prepends learned prompt positions that every token attends to, which attnscope's "
        "[q_pos, k_pos] records cannot hold (transformers' eager attentions leave them out, so their rows sum to "
        "less than one); no setting of the model turns them off"),
    "transformers.models.reformer.modeling_reformer.LSHSelfAttention": _inner_replaced(
        "_attend", _reformer_lsh_attend, is_causal=property(lambda self: bool(self.is_decoder))),
    "transformers.models.reformer.modeling_reformer.LocalSelfAttention": _inner_replaced(
        "forward", _reformer_local_forward, is_causal=property(lambda self: bool(self.is_decoder))),
    "HrmTextModel": _hrm_runs,
    "BigBirdPegasusEncoderAttention": _inner_replaced("forward", _bigbird_pegasus_encoder_forward, is_causal=False),
    "transformers.models.deberta_v2.modeling_deberta_v2.DisentangledSelfAttention": DebertaV2AttentionBridge,
    "transformers.models.deberta.modeling_deberta.DisentangledSelfAttention": DebertaAttentionBridge,
    # class names too common to key by alone
    "transformers.models.openai.modeling_openai.Attention": OpenAIGPTAttentionBridge,
    "transformers.models.fsmt.modeling_fsmt.Attention": FSMTAttentionBridge,
    "transformers.models.xlm.modeling_xlm.MultiHeadAttention": XLMAttentionBridge,
    "transformers.models.flaubert.modeling_flaubert.MultiHeadAttention": XLMAttentionBridge,
}
LOADED_EAGER = frozenset({"falcon", "gpt_neo"})  # model types built with attn_implementation="eager", then bridged


def install_bridges(model: nn.Module) -> int:
    """Replace every module whose class has a bridge; returns how many were replaced."""
    targets = [(name, module, bridge) for name, module in model.named_modules()
               if (bridge := _bridge_for(module)) is not None]
    for name, module, bridge in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        replacement = bridge(module)
        if getattr(replacement, "config", None) is None:  # its refusals name the model type
            replacement.config = model.config
        if hasattr(replacement, "configure"):  # a fact of the model the module does not keep (XLM's causal)
            replacement.configure(model.config)
        setattr(parent, child, replacement)
    return len(targets)


def _bridge_for(module: nn.Module) -> Any:
    """The bridge of ``module``'s class, by its qualified name or, where that is not listed, its name."""
    cls = type(module)
    return BRIDGES.get(f"{cls.__module__}.{cls.__name__}") or BRIDGES.get(cls.__name__)
