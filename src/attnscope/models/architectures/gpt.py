"""GPT-2-like decoders with ``h.N`` layers (GPT-2, GPT-J and CodeGen, GPT-BigCode, CTRL), OPT, and the two that compute
attention themselves: GPT-1 (its causal ``bias`` buffer joined to the padding mask) and GPT-Neo (unscaled scores,
alternating global and local layers), which picks its attention class by the implementation's name and so is
loaded with eager attention, then bridged.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ..adapters import PRE_LN, Adapter, ModuleRule, SiteRule, Unembedding
from .bridging import Attend, Bridge, attend, heads

ADAPTERS: tuple[Adapter, ...] = (
    Adapter("gpt2", ("gpt2",), (SiteRule("self", r"(?:^|\.)h\.(\d+)\.attn$", "c_proj", causal=True, conv1d=True),),
            blocks=(ModuleRule("self", r"(?:^|\.)h\.(\d+)$"),), ffn=(ModuleRule("self", r"(?:^|\.)h\.(\d+)\.mlp$"),),
            final=(r"^(?:transformer\.)?ln_f$", r"^lm_head$"), norms=PRE_LN,
            unembedding=Unembedding(r"^(?:transformer\.)?ln_f$")),
    Adapter("gptj", ("gptj", "codegen"), (SiteRule("self", r"(?:^|\.)h\.(\d+)\.attn$", "out_proj", causal=True),),
            blocks=(ModuleRule("self", r"(?:^|\.)h\.(\d+)$"),), ffn=(ModuleRule("self", r"(?:^|\.)h\.(\d+)\.mlp$"),),
            note="attention and feed-forward read the same normalised input, side by side"),
    Adapter("gpt-bigcode", ("gpt_bigcode",),
            (SiteRule("self", r"(?:^|\.)h\.(\d+)\.attn$", "c_proj", causal=True),),  # nn.Linear, unlike GPT-2
            blocks=(ModuleRule("self", r"(?:^|\.)h\.(\d+)$"),), ffn=(ModuleRule("self", r"(?:^|\.)h\.(\d+)\.mlp$"),),
            note="multi-query attention: one key/value head shared by every query head"),
    Adapter("ctrl", ("ctrl",), (SiteRule("self", r"(?:^|\.)h\.(\d+)\.multi_head_attention$", "dense", causal=True),),
            blocks=(ModuleRule("self", r"(?:^|\.)h\.(\d+)$"),)),
    Adapter("opt", ("opt",), (SiteRule("self", r"layers\.(\d+)\.self_attn$", "out_proj", causal=True),),
            blocks=(ModuleRule("self", r"layers\.(\d+)$"),), ffn=(ModuleRule("self", r"layers\.(\d+)\.fc2$"),)),
    Adapter("openai-gpt", ("openai-gpt",),
            (SiteRule("self", r"(?:^|\.)h\.(\d+)\.attn$", "c_proj", causal=True, conv1d=True),),
            note="GPT-1 computes attention itself: attnscope bridges it"),
    Adapter("gpt-neo", ("gpt_neo",),
            (SiteRule("self", r"(?:^|\.)h\.(\d+)\.attn\.attention$", "out_proj", causal=True, window="sliding_window"),),
            blocks=(ModuleRule("self", r"(?:^|\.)h\.(\d+)$"),), ffn=(ModuleRule("self", r"(?:^|\.)h\.(\d+)\.mlp$"),),
            note="global and local (sliding-window) layers alternate; unscaled scores; GPT-Neo computes attention "
            "itself: attnscope loads it with eager attention and bridges it", loaded_eager=True),
)


class GPTNeoAttentionBridge(nn.Module):
    """Stands in for ``GPTNeoSelfAttention``: the same q/k/v/out weights, unscaled scores (GPT-Neo does not
    divide by sqrt(d_head)) and, on its local layers, the sliding window its ``bias`` buffer holds, joined
    to the model's mask."""

    allowed: torch.Tensor  # a buffer registered in __init__: declared for type checkers

    def __init__(self, original: nn.Module, attention: Attend) -> None:
        super().__init__()
        self.attnscope_attention = attention
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
        output, probs = attend(self, q.float(), k.float(), v.float(), keep, scaling=1.0,
                               dropout=self.attn_dropout.p if self.training else 0.0)
        output = self.out_proj(output.reshape(batch, length, self.n_heads * self.d_head).to(hidden_states.dtype))
        return self.resid_dropout(output), probs


class OpenAIGPTAttentionBridge(nn.Module):
    """Stands in for GPT-1's ``Attention``: the same fused q/k/v and output ``Conv1D`` weights; its causal
    ``bias`` buffer joined to the model's additive padding mask (GPT-1 masks the future with -1e4, which
    leaves those weights 0 in float32 as the dtype's minimum does)."""

    allowed: torch.Tensor  # a buffer registered in __init__: declared for type checkers

    def __init__(self, original: nn.Module, attention: Attend) -> None:
        super().__init__()
        self.attnscope_attention = attention
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
        q, k, v = (heads(part, d_head) for part in self.c_attn(x).split(self.width, dim=2))
        length = x.shape[1]
        keep = self.allowed[:, :, :length, :length]
        if attention_mask is not None:
            keep = keep & (attention_mask > torch.finfo(attention_mask.dtype).min / 2)
        output, probs = attend(self, q, k, v, keep, scaling=d_head**-0.5 if self.scale else 1.0,
                               dropout=self.attn_dropout.p if self.training else 0.0)
        output = self.resid_dropout(self.c_proj(output.reshape(*x.shape[:2], self.width)))
        return [output, probs] if output_attentions and probs is not None else [output]


BRIDGES: dict[str, Bridge] = {
    "GPTNeoSelfAttention": GPTNeoAttentionBridge,
    # a class name too common to key by alone
    "transformers.models.openai.modeling_openai.Attention": OpenAIGPTAttentionBridge,
}
