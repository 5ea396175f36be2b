"""The architecture families: one module per family of model types, each holding its adapter rows (``ADAPTERS``:
where its attention modules are, see :mod:`attnscope.models.adapters`), its bridges (``BRIDGES``: class name ->
:data:`~.bridging.Bridge`, for attention the model computes itself) and the text of its refusals. This module
collects them; :func:`adapter_for` finds a type's row, and a type in no family is read from the model
(:mod:`.generic`).

The families are listed below by hand rather than discovered, so that this file says which exist;
``tests/test_architecture_families.py`` checks that every module of the package is listed and that no model type
or bridged class is claimed twice. Adding a family: docs/ARCHITECTURE.md, 'To add… An architecture'.
"""

from __future__ import annotations

from ..adapters import Adapter
from . import (
    alibi,
    bart,
    bert,
    convolutions,
    gemma,
    gpt,
    hybrids,
    llama,
    local,
    neox,
    not_tokens,
    relative,
    runs,
    t5,
    xlm,
)
from .bridging import Bridge
from .generic import GENERIC_DECODER, GENERIC_ENCODER_DECODER

FAMILIES = (bert, convolutions, relative, runs, xlm, gpt, neox, alibi, llama, gemma, hybrids, bart, t5, local,
            not_tokens)

ADAPTERS: tuple[Adapter, ...] = tuple(row for family in FAMILIES for row in family.ADAPTERS)
BRIDGES: dict[str, Bridge] = {name: bridge for family in FAMILIES for name, bridge in family.BRIDGES.items()}
# model types built with attn_implementation="eager", then bridged (they pick their attention class by its name)
LOADED_EAGER = frozenset(model_type for row in ADAPTERS if row.loaded_eager for model_type in row.model_types)


def adapter_for(model_type: str, is_encoder_decoder: bool = False) -> Adapter:
    """The adapter of ``model_type``; a type in no family is read from the model
    (:data:`~.generic.GENERIC_ENCODER_DECODER` or :data:`~.generic.GENERIC_DECODER`)."""
    for adapter in ADAPTERS:
        if model_type in adapter.model_types:
            return adapter
    return GENERIC_ENCODER_DECODER if is_encoder_decoder else GENERIC_DECODER
