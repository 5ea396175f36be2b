"""Whether attnscope's attention function is the one running: checked before a forward pass (the implementation
each attention module's config names) and after it (whether any call reached the function).

A model loaded by :func:`attnscope.load_model` is built with ``attn_implementation="attnscope"``, and each
attention module looks its attention function up by its config's ``_attn_implementation`` at every call.
Anything that changes that config afterwards takes attnscope out of the model without a word:
``AutoModelForCausalLM.from_config(loaded.model.config, attn_implementation="eager")`` sets the shared config
(and its sub-configs) in place, as ``model.set_attn_implementation`` does. Nothing would then be recorded and no
intervention applied, so patching would answer 0 for every head. Every analysis therefore refuses such a model:

* :func:`check_attention_function` before any pass (``load_model``'s ``as_loaded``, ``capture()``, the sweeps);
* :func:`calls_heard` after a pass, where only the pass can tell (``capture()`` and ``intervene()`` blocks).

Bridged modules (``models/architectures/bridging.py``) call the function themselves, whatever their config says
(Falcon and GPT-Neo are even built with ``"eager"``), so only a pass tells about them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import Any

from torch import nn

from ..errors import AttnscopeError
from ..models.adapters import HOW_TO_ADD, AttentionSite
from .hooks import local_hooks

ATTN_IMPLEMENTATION = "attnscope"  # the name attnscope's attention function is registered under
FIX = ("load the model with attnscope.load_model, and build other models from a copy of its config "
       "(copy.deepcopy(loaded.model.config)), not from the config itself")


def dispatched_implementation(module: nn.Module) -> str | None:
    """The attention implementation ``module``'s calls are dispatched to (its config's ``_attn_implementation``),
    or None where the config does not decide: a bridge, or a module that keeps no config."""
    if hasattr(module, "attnscope_attention"):  # a bridge calls attnscope's function itself
        return None
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return None
    return str(config._attn_implementation)


def check_attention_function(sites: Mapping[nn.Module, AttentionSite]) -> None:
    """Refuse, before any forward pass, a model whose attention modules (``sites``, as ``load_model`` found them)
    no longer dispatch their calls to attnscope's attention function."""
    for module, site in sites.items():
        implementation = dispatched_implementation(module)
        if implementation is not None and implementation != ATTN_IMPLEMENTATION:
            raise AttnscopeError(
                f"the model's attention ({type(module).__name__}, {site.kind} layer {site.layer}) now runs "
                f"transformers' {implementation!r} implementation, not attnscope's: its config was changed after "
                f"loading (from_config(config, attn_implementation=...) and set_attn_implementation change a config "
                f"in place), so nothing would be recorded or changed; {FIX}")


class _Block:
    """What one ``capture()`` / ``intervene()`` block saw: the first site module that ran, whether a call arrived."""

    def __init__(self) -> None:
        self.first_ran: nn.Module | None = None
        self.heard = False

    def module_ran(self, module: nn.Module, *_: Any) -> None:
        if self.first_ran is None:
            self.first_ran = module


_OPEN_BLOCKS: ContextVar[tuple[_Block, ...]] = ContextVar("attnscope_open_blocks", default=())


def call_heard() -> None:
    """Noted by the attention function at each call from a known site: every open block has heard one."""
    for block in _OPEN_BLOCKS.get():
        block.heard = True


@contextmanager
def calls_heard(sites: Mapping[nn.Module, AttentionSite] | None, block: str) -> Iterator[None]:
    """Refuse, when the block ends without an error, a ``block`` (``"capture"`` or ``"intervene"``) in which no
    call reached attnscope's attention function although the model ran: with ``sites``, although one of their
    modules ran (a block with no forward pass is fine); without them (``intervene()`` does not know the model),
    any block with no call, which changed nothing. Threads of ``concurrent_map`` share the caller's blocks."""
    seen = _Block()
    token = _OPEN_BLOCKS.set((*_OPEN_BLOCKS.get(), seen))
    try:
        with local_hooks(sites, seen.module_ran, pre=True) if sites is not None else nullcontext():
            yield
    finally:
        _OPEN_BLOCKS.reset(token)
    if seen.heard:
        return
    if sites is None:
        raise AttnscopeError(f"no call reached attnscope's attention function inside this intervene() block, so it "
                             f"changed nothing: the model it ran is not wired to attnscope's attention; {FIX}")
    if seen.first_ran is not None:
        check_attention_function(sites)  # a config changed inside the block says so
        raise AttnscopeError(
            f"the model's attention modules ran (e.g. {sites[seen.first_ran].name}) but never called attnscope's "
            f"attention function, so nothing was recorded: they compute attention inside their own forward (the "
            f"model type then needs a bridge: {HOW_TO_ADD}), or the function registered as "
            f"{ATTN_IMPLEMENTATION!r} was replaced; {FIX}")
