"""Encoders that add a convolution beside attention: ConvBERT (half of each layer's heads are span-based convolutions)
and Nyströmformer (a convolution of the values; exact softmax attention only with as many landmarks as positions).
Both bridges keep the model's code and replace only where attention is computed. Their rows name no output
projection: it also takes what is not attention, so a head's vector in the residual stream is not α f(x).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...errors import AttnscopeError
from ..adapters import Adapter, SiteRule
from .bridging import Bridge, attend, heads, inner_replaced

ADAPTERS: tuple[Adapter, ...] = (
    # no out_proj: the output projection also takes what is not attention (ConvBERT's convolution heads,
    # Nyströmformer's convolution of the values), so a head's vector in the residual stream is not α f(x)
    Adapter("convbert", ("convbert",), (SiteRule("self", r"encoder\.layer\.(\d+)\.attention\.self$", ""),),
            note="mixed attention: half of each layer's heads are self-attention (captured), the other half span-based "
            "convolutions over each token's neighbours (no attention over the sequence); ConvBERT computes "
            "attention itself: attnscope bridges it"),
    Adapter("nystromformer", ("nystromformer",),
            (SiteRule("self", r"encoder\.layer\.(\d+)\.attention\.self$", ""),),
            note="exact softmax attention where it has as many landmarks as positions (its Nyström approximation "
            "is refused), plus a convolution of the values over positions; attnscope bridges it"),
)


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
    q, k, v = (heads(projection(hidden_states), self.attention_head_size)
               for projection in (self.query, self.key, self.value))  # [batch, head, pos, d_head]
    output, probs = attend(self, q, k, v, attention_mask, scaling=self.attention_head_size**-0.5,
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
    spans = nn.functional.unfold(spans, kernel_size=(self.conv_kernel_size, 1),
                                 padding=((self.conv_kernel_size - 1) // 2, 0))  # [batch, width * kernel, pos]
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
    q, k, v = (heads(projection(hidden_states), self.attention_head_size)
               for projection in (self.query, self.key, self.value))  # [batch, head, pos, d_head]
    output, probs = attend(self, q, k, v, attention_mask, scaling=self.attention_head_size**-0.5,
                           dropout=0.0)  # Nyströmformer applies no dropout to its weights
    if self.conv_kernel_size is not None:
        output = output + self.conv(v).transpose(1, 2)  # [batch, head, pos, d] -> [batch, pos, head, d]
    output = output.reshape(*hidden_states.shape[:2], self.all_head_size)
    return (output, probs) if output_attentions else (output,)


BRIDGES: dict[str, Bridge] = {
    "ConvBertSelfAttention": inner_replaced("forward", _convbert_forward, is_causal=False),
    "NystromformerSelfAttention": inner_replaced("forward", _nystromformer_forward, _nystrom_approximated,
                                                 is_causal=False),
}
