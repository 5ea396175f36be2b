"""Llama-like rotary decoders: ``layers.N.self_attn`` with ``o_proj``, pre-norm, grouped key/value heads (Llama,
Mistral, Qwen2/3, Gemma 1, OLMo, Granite, Phi-3, SmolLM3), and the decoders that keep Llama's modules with a twist:
DiffLlama's differential heads (bridged: two attention calls per layer become one), LongCat-Flash's two attention
modules per block, Inkling 2's attention over earlier blocks' outputs (computed, not recorded), DBRX's blocks.
Its shared pieces (:data:`LLAMA_LIKE`, :func:`llama_row`, ...) are the other families' building blocks.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from ..adapters import PRE_LN, Adapter, HeadProjections, ModuleRule, SiteRule, Unembedding
from .bridging import Bridge, attend, inner_replaced

LLAMA_LIKE = (SiteRule("self", r"layers\.(\d+)\.self_attn$", "o_proj", causal=True, window="sliding_window"),)
LLAMA_BLOCKS = (ModuleRule("self", r"layers\.(\d+)$"),)
LLAMA_FFN = (ModuleRule("self", r"layers\.(\d+)\.mlp$"),)
LLAMA_FINAL = (r"^(?:model\.)?norm$", r"^lm_head$")
LLAMA_UNEMBEDDING = Unembedding(r"^(?:model\.)?norm$")
LLAMA_PROJECTIONS = HeadProjections("q_proj", "k_proj", "v_proj", group_size=("num_key_value_groups",))


def llama_row(name: str, model_types: tuple[str, ...], unembedding: Unembedding) -> Adapter:
    """A row of the Llama family: Llama's modules, pre-norm, whole-model pruning; ``unembedding`` says how
    its sublayers reach the logits."""
    return Adapter(name, model_types, LLAMA_LIKE, blocks=LLAMA_BLOCKS, ffn=LLAMA_FFN, final=LLAMA_FINAL,
                   projections=LLAMA_PROJECTIONS, norms=PRE_LN, unembedding=unembedding)


ADAPTERS: tuple[Adapter, ...] = (
    llama_row("llama", ("llama", "mistral", "qwen2", "qwen3", "gemma", "olmo", "granite", "phi3", "smollm3"),
              LLAMA_UNEMBEDDING),
    # no out_proj: the heads' outputs are combined in pairs (out_h - λ out_h+heads/2) and normalised before o_proj,
    # so no per-head vector reaches the residual stream (the measures that need one are unavailable)
    Adapter("diffllama", ("diffllama",), (SiteRule("self", r"layers\.(\d+)\.self_attn$", "", causal=True),),
            note="differential attention: head h and head h + heads/2 are the two softmaxes of one differential "
            "head (its output is out_h - λ out_h+heads/2); the record holds each softmax as its own head, as "
            "transformers' output_attentions does; DiffLlama calls attention twice per layer (same queries and keys, "
            "two halves of the values): attnscope's bridge calls it once with both halves"),
    Adapter("longcat-flash", ("longcat_flash",),
            (SiteRule("self", r"layers\.\d+\.self_attn\.\d+$", "o_proj", causal=True, layer_attribute="layer_idx"),),
            note="two attention modules per block: layer 2 i + j of the record is block i's module j, as "
            "transformers' output_attentions lists them"),
    Adapter("inkling2", ("inkling2_text", "inkling2_loop_text"), LLAMA_LIKE,
            not_tokens=("Inkling2BlockAttentionResidual", "Inkling2LoopBlockAttentionResidual",
                        "Inkling2LoopMessageAttentionResidual"),
            note="its layers' self-attention; the attention that mixes each layer's input from earlier blocks' "
            "outputs (attention over depth, not tokens) is computed and not recorded"),
    Adapter("dbrx", ("dbrx",), (SiteRule("self", r"blocks\.(\d+)\.norm_attn_norm\.attn$", "out_proj", causal=True),)),
)


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
    output, probs = attend(self, q, k, both, attention_mask, scaling=self.scaling, **kwargs)
    out_1, out_2 = torch.chunk(output, 2, dim=2)  # [batch, q_pos, head / 2, 2 d_head]: the head pairs
    lambda_1, lambda_2 = (torch.exp(torch.sum(a * b, dim=-1, dtype=torch.float32)).to(q.dtype)
                          for a, b in ((self.lambda_q1, self.lambda_k1), (self.lambda_q2, self.lambda_k2)))
    output = out_1 - (lambda_1 - lambda_2 + self.lambda_init) * out_2
    output = (1 - self.lambda_init) * self.groupnorm(output)
    return self.o_proj(output.reshape(*hidden_states.shape[:-1], -1)), probs


BRIDGES: dict[str, Bridge] = {"DiffLlamaAttention": inner_replaced("forward", _diffllama_forward)}
