"""Bridges for architectures whose attention does not dispatch through ``AttentionInterface``.

transformers 5 still computes MPNet's, BLOOM's, Falcon's and GPT-Neo's attention inline. Rather than copy its modeling code or
patch its class, attnscope swaps each such module *instance* for a bridge that reuses the
module's own projections and calls the one capture function with the relative position bias.
Bridges are keyed by class name (data, like the adapter table). A model type that picks its attention
class by the implementation's name (Falcon) cannot be built with ``"attnscope"``: it is loaded with
``"eager"`` (:data:`LOADED_EAGER`) and bridged the same way.
"""

from __future__ import annotations

import importlib
from functools import partial
from typing import Any, cast

import torch
from torch import nn

from ..errors import AttnscopeError
from .attention import attnscope_attention


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


BRIDGES: dict[str, type[nn.Module]] = {"MPNetSelfAttention": MPNetAttentionBridge, "BloomAttention": BloomAttentionBridge,
                                       "FalconAttention": FalconAttentionBridge,
                                       "GPTNeoSelfAttention": GPTNeoAttentionBridge}
LOADED_EAGER = frozenset({"falcon", "gpt_neo"})  # model types built with attn_implementation="eager", then bridged


def install_bridges(model: nn.Module) -> int:
    """Replace every module whose class has a bridge; returns how many were replaced."""
    targets = [(name, module) for name, module in model.named_modules() if type(module).__name__ in BRIDGES]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, BRIDGES[type(module).__name__](module))
    return len(targets)
