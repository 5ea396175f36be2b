"""T5-like encoder-decoders: T5, mT5, UMT5, Switch Transformers (T5's attention modules; some feed-forward layers are
mixtures of experts) and LongT5, whose encoder attends locally: bridged as a full ``[q_pos, k_pos]`` attention whose
mask is each query's band of keys (the record holds zeros outside it); its transient-global attention is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from ..adapters import Adapter, ModuleRule, SiteRule
from .bridging import Bridge, attend, heads, inner_replaced, refused

T5_SITES = (
    SiteRule("encoder", r"encoder\.block\.(\d+)\.layer\.0\.SelfAttention$", "o"),
    SiteRule("decoder", r"decoder\.block\.(\d+)\.layer\.0\.SelfAttention$", "o", causal=True),
    SiteRule("cross", r"decoder\.block\.(\d+)\.layer\.1\.EncDecAttention$", "o"),
)


ADAPTERS: tuple[Adapter, ...] = (
    Adapter(
        "t5",
        ("t5", "mt5", "umt5"),
        T5_SITES,
        blocks=(ModuleRule("encoder", r"encoder\.block\.(\d+)$"), ModuleRule("decoder", r"decoder\.block\.(\d+)$")),
        ffn=(ModuleRule("encoder", r"encoder\.block\.(\d+)\.layer\.1\.DenseReluDense$"),
             ModuleRule("decoder", r"decoder\.block\.(\d+)\.layer\.2\.DenseReluDense$")),
    ),
    Adapter("longt5", ("longt5",),
            (SiteRule("encoder", r"encoder\.block\.(\d+)\.layer\.0\.LocalSelfAttention$", "o"), *T5_SITES[1:]),
            note="its encoder attends locally: each query sees the keys less than local_radius + 1 away (the record "
            "holds zeros outside that band); transient-global attention is refused; LongT5 computes its encoder's "
            "attention itself: attnscope bridges it"),
    # T5's attention modules; some feed-forward layers are mixtures of experts (no DenseReluDense)
    Adapter("switch-transformers", ("switch_transformers",), T5_SITES),
)


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
    q, k, v = (heads(projection(hidden_states), self.key_value_proj_dim) for projection in (self.q, self.k, self.v))
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
    output, probs = attend(self, q, k, v, keep, scaling=1.0, position_bias=position_bias,
                           dropout=self.dropout if self.training else 0.0)
    outputs = (self.o(output.reshape(*hidden_states.shape[:2], -1)), position_bias)
    return outputs + (probs,) if output_attentions else outputs


def _longt5_tokens(blocked: torch.Tensor, block_len: int, length: int) -> torch.Tensor:
    """Which positions are tokens (not padding), ``[batch, pos]``, from LongT5's blocked local mask: its entry for
    a query and the same position as key (the middle block's diagonal) is whether that position is a token."""
    blocks = blocked.reshape(blocked.shape[0], -1, block_len, 3 * block_len)  # [batch, block, q, 3 blocks of keys]
    inside = torch.arange(block_len, device=blocked.device)
    return blocks[:, :, inside, block_len + inside].reshape(blocked.shape[0], -1)[:, :length].bool()


BRIDGES: dict[str, Bridge] = {
    "LongT5LocalAttention": inner_replaced("forward", _longt5_local_forward, is_causal=False),
    "LongT5TransientGlobalAttention": refused(
        "model type 'longt5' with transient-global attention attends to summaries of blocks of tokens beside the "
        "tokens, which attnscope's [q_pos, k_pos] records cannot hold; load it with encoder_attention_type: local"),
}
