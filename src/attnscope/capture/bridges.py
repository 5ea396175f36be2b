"""Installing the families' bridges: each module whose attention the model computes itself is swapped for the
bridge its family declares (:mod:`attnscope.models.architectures`), built with the one attention function.

The bridges live with their families in ``models/``, a floor below this one, so they cannot import the attention
function; :func:`install_bridges` hands it to each (``bridge(original, attnscope_attention)``), which is also why
this is the one place that knows both.
"""

from __future__ import annotations

from torch import nn

from ..models.architectures import BRIDGES
from ..models.architectures.bridging import Bridge
from .attention import attnscope_attention


def install_bridges(model: nn.Module) -> int:
    """Replace every module whose class has a bridge; returns how many were replaced."""
    targets = [(name, module, bridge) for name, module in model.named_modules()
               if (bridge := _bridge_for(module)) is not None]
    for name, module, bridge in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        replacement = bridge(module, attnscope_attention)
        if getattr(replacement, "config", None) is None:  # its refusals name the model type
            replacement.config = model.config
        if (configure := getattr(replacement, "configure", None)) is not None:
            configure(model.config)  # a fact of the model the module does not keep (XLM's causal)
        setattr(parent, child, replacement)
    return len(targets)


def _bridge_for(module: nn.Module) -> Bridge | None:
    """The bridge of ``module``'s class, by its qualified name or, where that is not listed, its name."""
    cls = type(module)
    return BRIDGES.get(f"{cls.__module__}.{cls.__name__}") or BRIDGES.get(cls.__name__)
