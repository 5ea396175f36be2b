"""What the families' bridges share: how a bridge reaches the one attention function, and the ways of standing in
for an attention module.

transformers 5 still computes some architectures' attention inline instead of through ``AttentionInterface``.
Rather than copy their modeling code or patch their classes, attnscope swaps each such module *instance* for a
bridge that reuses the module's own projections (and, where the model computes extra terms, its own methods) and
calls the one attention function, with a position bias where the model adds one. A family declares its bridges
in ``BRIDGES`` (class name, or module path and class name where the name is too common -> a :data:`Bridge`);
``attnscope.capture.bridges.install_bridges`` builds them when a model loads.

The attention function is capture's, a floor above this package: ``install_bridges`` hands it to each bridge
(``Bridge(original, attention)``), which keeps it as ``attnscope_attention`` and calls it through :func:`attend`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, cast

import torch
from torch import nn

from ...errors import AttnscopeError

# capture's attention function: (module, query, key, value, mask, scaling=, dropout=, position_bias=, is_causal=, ...)
# -> (output [batch, q_pos, head, d_head], weights [batch, head, q_pos, k_pos] or None)
Attend = Callable[..., tuple[torch.Tensor, Any]]
# (the module it stands in for, the attention function) -> the module that replaces it
Bridge = Callable[[nn.Module, Attend], nn.Module]


def attend(module: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The one attention function, called as ``module``'s (the bridge that ``install_bridges`` handed it to)."""
    return cast(Any, module).attnscope_attention(module, *args, **kwargs)


def heads(states: torch.Tensor, d_head: int) -> torch.Tensor:
    """``[batch, pos, head * d_head]`` -> ``[batch, head, pos, d_head]``."""
    return states.view(*states.shape[:2], -1, d_head).transpose(1, 2)


def cached(cache: Any, layer_idx: int | None, cross: bool, key: torch.Tensor, value: torch.Tensor,
           kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values after the model's cache, as transformers' own modules keep them: an encoder-decoder
    cache holds a self-attention and a cross-attention part, and the cross part is filled once."""
    from transformers.cache_utils import EncoderDecoderCache

    if cache is None:
        return key, value
    assert layer_idx is not None  # a module given a cache knows its layer (transformers' caches index by it)
    part = cache
    if isinstance(cache, EncoderDecoderCache):
        part = cache.cross_attention_cache if cross else cache.self_attention_cache
        if cross and cache.is_updated.get(layer_idx):
            filled = cast(Any, part.layers[layer_idx])  # a cross-attention layer, filled: its keys and values are set
            return filled.keys, filled.values
    key, value = part.update(key, value, layer_idx, kwargs=kwargs)
    if cross and isinstance(cache, EncoderDecoderCache):
        cache.is_updated[layer_idx] = True
    return key, value


def eager_scores(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                 scaling: float) -> torch.Tensor:
    """What eager's ``output_attentions`` returns where a model returns scores rather than weights (SqueezeBERT,
    ProphetNet): ``q k^T * scaling`` plus the additive mask, ``[batch, head, q_pos, k_pos]`` from ``[batch, head,
    pos, d_head]`` queries and keys. Only returned, as the model returns it; the record holds the weights."""
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    return scores if attention_mask is None else scores + attention_mask[:, :, :, : key.shape[-2]]


def inner_replaced(method: str, compute: Any, refusal: Any = None, **attributes: Any) -> Bridge:
    """A bridge for a module whose forward computes attention in one inner ``method``: the same instance state
    (weights, buffers, mode) in a subclass of its class whose ``method`` is ``compute``; the rest of its
    forward is the model's own code. ``refusal(original)``, where given, names what the bridge does not
    reproduce (None where it does): attnscope then refuses the model when it loads it."""

    def bridge(original: nn.Module, attention: Attend) -> nn.Module:
        if refusal is not None and (reason := refusal(original)) is not None:
            raise AttnscopeError(reason)
        cls = type(original)
        bridged = cast(type[nn.Module], type(f"{cls.__name__}Bridge", (cls,),  # a subclass of a module's class
                                             {method: compute, "attnscope_attention": staticmethod(attention),
                                              **attributes}))
        module = bridged.__new__(bridged)
        module.__dict__.update(original.__dict__)
        return module

    return bridge


def refused(reason: str) -> Bridge:
    """A bridge that refuses its module's model in one line (``reason``): attention attnscope's records cannot
    hold, said where the model loads rather than as a module that never called the attention function."""

    def bridge(original: nn.Module, attention: Attend) -> nn.Module:
        raise AttnscopeError(reason)

    return bridge


def adopt(bridge: nn.Module, original: nn.Module, methods: tuple[str, ...]) -> None:
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
    setattr(bridge, "is_causal", False)  # noqa: B010  (nn.Module's __setattr__ is typed for tensors and modules)
    bridge.train(original.training)
