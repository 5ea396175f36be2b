"""Local and sparse attention, recorded where it is a band of keys or the whole sequence: Longformer and LED's encoder
(each query sees the keys within half its window on either side: a full ``[q_pos, k_pos]`` attention masked to
that band; global attention is refused), LED's decoder (BART's), BigBird-Pegasus's encoder with full attention
(block-sparse attention is refused) and Reformer over inputs no longer than a chunk (hashed buckets and chunks run
the model's own code, which calls no attention function: a capture of them is refused).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from ...errors import AttnscopeError
from ..adapters import Adapter, SiteRule, model_type_of
from .bart import BART_LIKE, BartStyleAttentionBridge
from .bridging import Bridge, attend, heads, inner_replaced

ADAPTERS: tuple[Adapter, ...] = (
    Adapter("longformer", ("longformer",), (SiteRule("self", r"encoder\.layer\.(\d+)\.attention\.self$",
                                                     "../output.dense", window="sliding_window"),),
            note="local attention: each query sees the keys within half its attention_window on either side (the "
            "record holds zeros outside that band); global attention is refused; Longformer computes attention "
            "itself: attnscope bridges it"),
    Adapter("led", ("led",),
            (SiteRule("encoder", r"encoder\.layers\.(\d+)\.self_attn\.longformer_self_attn$", "../output",
                      window="sliding_window"),
             *BART_LIKE[1:]),
            note="its encoder attends locally: each query sees the keys within half its attention_window on either "
            "side (the record holds zeros outside that band); global attention is refused; LED computes its "
            "encoder's attention itself: attnscope bridges it"),
    Adapter("reformer", ("reformer",),
            (SiteRule("self", r"layers\.(\d+)\.attention\.self_attention$", "../output.dense", causal=None),),
            note="LSH and local attention over inputs no longer than a chunk (where both attend over the whole "
            "sequence; an LSH query sees itself only where it sees nothing else); longer inputs, hashed into "
            "buckets or chunks, are refused; Reformer computes attention itself: attnscope bridges it"),
)


class LEDDecoderAttentionBridge(BartStyleAttentionBridge):
    """Stands in for LED's decoder attention (self- and cross-attention), BART's in all but what it returns:
    ``(output, weights if output_attentions, cache)``."""

    def forward(self, hidden_states: torch.Tensor, key_value_states: torch.Tensor | None = None,  # type: ignore[override]
                cache: Any = None, attention_mask: torch.Tensor | None = None, output_attentions: bool = False,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
        output, probs = super().forward(hidden_states, key_value_states, cache, attention_mask)
        return output, probs if output_attentions else None, cache


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
    q, k, v = (heads(projection(hidden_states), self.head_dim) for projection in (self.query, self.key, self.value))
    length, window = hidden_states.shape[1], self.one_sided_attn_window_size
    positions = torch.arange(length, device=hidden_states.device)
    band = (positions[:, None] - positions[None, :]).abs() <= window  # [q_pos, k_pos]
    assert attention_mask is not None  # Longformer's and LED's layers always pass their mask
    keep = band[None, None] & (attention_mask == 0)[:, None, None, :]  # [batch, 1, q_pos, k_pos]
    output, probs = attend(self, q, k, v, keep, scaling=self.head_dim**-0.5,
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
    q, k, v = (heads(projection(hidden_states), inner.attention_head_size)
               for projection in (inner.query, inner.key, inner.value))  # [batch, head, pos, d_head]
    output, probs = attend(self, q, k, v, attention_mask, scaling=inner.attention_head_size**-0.5,
                           dropout=inner.dropout.p if self.training else 0.0)
    return self.output(output.reshape(*hidden_states.shape[:2], inner.all_head_size)), probs


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
    output, probs = attend(self, query_vectors, key_vectors, value_vectors, keep, scaling=1.0,
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
    q, k, v = (heads(projection(hidden_states), self.attention_head_size)
               for projection in (self.query, self.key, self.value))  # [batch, head, pos, d_head]
    output, probs = attend(self, q, k, v, _reformer_keep(self, attention_mask, length, q.device),
                           scaling=self.attention_head_size**-0.5,
                           dropout=self.dropout if self.training else 0.0)
    modeling = importlib.import_module(type(self).__mro__[1].__module__)
    return modeling.LocalSelfAttentionOutput(hidden_states=output.reshape(*hidden_states.shape[:2], -1),
                                             attention_probs=probs if output_attentions else ())


BRIDGES: dict[str, Bridge] = {
    **dict.fromkeys(("LongformerSelfAttention", "LEDEncoderSelfAttention"),
                    inner_replaced("forward", _longformer_forward, is_causal=False,
                                   # the window records state: |q - k| < window (its own counts one side)
                                   sliding_window=property(lambda self: self.one_sided_attn_window_size + 1))),
    "LEDDecoderAttention": LEDDecoderAttentionBridge,
    "BigBirdPegasusEncoderAttention": inner_replaced("forward", _bigbird_pegasus_encoder_forward, is_causal=False),
    "transformers.models.reformer.modeling_reformer.LSHSelfAttention": inner_replaced(
        "_attend", _reformer_lsh_attend, is_causal=property(lambda self: bool(self.is_decoder))),
    "transformers.models.reformer.modeling_reformer.LocalSelfAttention": inner_replaced(
        "forward", _reformer_local_forward, is_causal=property(lambda self: bool(self.is_decoder))),
}
