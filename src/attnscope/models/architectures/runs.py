"""Models that run one attention module several times per forward pass, each run a site (and a layer of the record)
of its own, named ``attention_runs.i`` in the order transformers' ``output_attentions`` lists them: ALBERT (its
layers share weights; a bridge for its layer loop) and HRM (two stacks of layers run in cycles; its attention
modules name the site of the run they are in at each call).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from ..adapters import Adapter, SiteRule
from .bridging import Attend, Bridge, attend, heads, inner_replaced

ADAPTERS: tuple[Adapter, ...] = (
    Adapter("albert", ("albert",), (SiteRule("self", r"encoder\.attention_runs\.(\d+)$", "dense"),),
            note="ALBERT shares weights across layers, running one attention module several times: each run is "
            "its own layer of the record (the i-th attention to run, as transformers' output_attentions lists "
            "them), through a bridge"),
    # no out_proj: its attention multiplies its output by a gate (gate_proj) before o_proj, and every run of a
    # layer shares that o_proj (the measures that need a head's vector are unavailable)
    Adapter("hrm", ("hrm_text",), (SiteRule("self", r"attention_runs\.(\d+)$", "", causal=True),),
            note="two stacks of layers run in cycles: each run of a layer is its own layer of the record, in the "
            "order transformers' output_attentions lists them; HRM computes the attention of each run as its own "
            "site through a bridge"),
)


class AlbertAttentionRun(nn.Module):
    """One run of a shared ``AlbertAttention``: the same weights (registered here too, so the site's output
    projection is found), attention via attnscope with this run as the module, so each run is its own site."""

    # the shared module's submodules, set in __init__: declared for type checkers
    query: nn.Module
    key: nn.Module
    value: nn.Module
    dense: nn.Module
    LayerNorm: nn.Module
    output_dropout: nn.Module

    def __init__(self, shared: nn.Module, attention: Attend) -> None:
        super().__init__()
        self.attnscope_attention = attention
        for name in ("query", "key", "value", "dense", "LayerNorm", "attention_dropout", "output_dropout"):
            setattr(self, name, getattr(shared, name))
        self.d_head, self.scaling = int(cast(int, shared.attention_head_size)), float(cast(float, shared.scaling))
        self.is_causal = False
        self.train(shared.training)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, k, v = (heads(proj(hidden_states), self.d_head) for proj in (self.query, self.key, self.value))
        output, probs = attend(self, q, k, v, attention_mask, scaling=self.scaling,
                               dropout=cast(nn.Dropout, self.attention_dropout).p if self.training else 0.0)
        output = self.output_dropout(self.dense(output.reshape(*hidden_states.shape[:2], -1)))
        return self.LayerNorm(hidden_states + output), probs


class AlbertRunsBridge(nn.Module):
    """Stands in for ``AlbertTransformer``. ALBERT shares weights across layers: its ``num_hidden_layers`` layers
    run the layers of ``num_hidden_groups`` groups, one module several times. Each run gets its own site
    (``attention_runs.i``, layer ``i`` of the record: the ``i``-th attention to run, as eager's
    ``output_attentions`` lists them); the layers' other weights are ALBERT's own, applied as ALBERT does."""

    def __init__(self, original: nn.Module, attention: Attend) -> None:
        super().__init__()
        from transformers.pytorch_utils import apply_chunking_to_forward

        self._chunked = apply_chunking_to_forward
        self.config = cast(Any, original.config)
        self.embedding_hidden_mapping_in = cast(nn.Linear, original.embedding_hidden_mapping_in)
        self.albert_layer_groups = cast(nn.ModuleList, original.albert_layer_groups)
        self.attention_runs = nn.ModuleList(AlbertAttentionRun(layer.attention, attention)
                                            for layer in self._layer_runs())
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


class AttentionRunSite(nn.Module):
    """One run of an attention module that a model runs several times per forward pass, as a site of its own (no
    weights: the module computes, and names this run's site at each call)."""

    def __init__(self, shared: nn.Module) -> None:
        super().__init__()
        self.is_causal = bool(getattr(shared, "is_causal", False))
        self.num_key_value_groups = getattr(shared, "num_key_value_groups", 1)


def _hrm_runs(original: nn.Module, attention: Attend) -> nn.Module:
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
    replaced = inner_replaced("forward", _hrm_attention_forward)
    for stack in (model.L_module, model.H_module):
        for layer in stack.layers:
            layer.self_attn = replaced(layer.self_attn, attention)
            object.__setattr__(layer.self_attn, "attnscope_runs", model.attention_runs)  # a reference, no child
    return original


def _hrm_attention_forward(self: Any, hidden_states: torch.Tensor, *args: Any, cycle_offset: int = 0,
                           **kwargs: Any) -> Any:
    """HRM's attention (its own code), as the site of the slot it runs at: ``cycle_offset + layer_idx``."""
    run = self.attnscope_runs[cycle_offset + self.layer_idx]
    self.attnscope_site = getattr(run, "attnscope_site", None)
    return super(type(self), self).forward(hidden_states, *args, cycle_offset=cycle_offset, **kwargs)


BRIDGES: dict[str, Bridge] = {"AlbertTransformer": AlbertRunsBridge, "HrmTextModel": _hrm_runs}
