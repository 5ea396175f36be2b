"""Forward hooks that act only in the thread / async task that asked for them.

A plain ``module.register_forward_hook`` changes the module for every thread that runs it, so a
web request skipping a sublayer would change what another request computes at the same moment.
Here each module gets one dispatching hook, installed on first use and removed when no block uses
it any more; the dispatcher runs the hooks that the *current* context (a ``ContextVar``, like
:func:`~attnscope.capture.attention.intervene`) has activated on that module, and none otherwise.
Threads of :func:`~attnscope.capture.concurrency.concurrent_map` run in a copy of the caller's
context, so they see the caller's hooks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

# (module, inputs, output) -> new output or None
ForwardHook = Callable[[nn.Module, tuple[Any, ...], Any], Any]
# (module, args, kwargs) -> new (args, kwargs) or None
PreHook = Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]] | None]

_NO_HOOKS: Mapping[nn.Module, tuple[Any, ...]] = MappingProxyType({})
_ACTIVE = {
    "forward": ContextVar[Mapping[nn.Module, tuple[Any, ...]]]("attnscope_forward_hooks", default=_NO_HOOKS),
    "pre": ContextVar[Mapping[nn.Module, tuple[Any, ...]]]("attnscope_pre_hooks", default=_NO_HOOKS),
}


def _dispatch_forward(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> Any:
    """The one forward hook of a module: the current context's hooks, in the order activated."""
    hooks = _ACTIVE["forward"].get().get(module, ())
    for hook in hooks:
        changed = hook(module, inputs, output)
        output = output if changed is None else changed
    return output if hooks else None


def _dispatch_pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
    """The one forward pre-hook of a module (``kwargs`` is None only if a thread removed it mid-call:
    then no hook of the current context is on the module)."""
    hooks = _ACTIVE["pre"].get().get(module, ())
    if not hooks or kwargs is None:
        return None
    for hook in hooks:
        changed = hook(module, args, kwargs)
        args, kwargs = (args, kwargs) if changed is None else changed
    return args, kwargs


class _Installed:
    """Dispatchers installed on modules, with how many active blocks use each (guarded by a lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.handles: dict[tuple[nn.Module, str], tuple[RemovableHandle, int]] = {}

    def acquire(self, modules: list[nn.Module], phase: str) -> None:
        with self.lock:
            for module in modules:
                handle, users = self.handles.get((module, phase)) or (self._install(module, phase), 0)
                self.handles[(module, phase)] = (handle, users + 1)

    def release(self, modules: list[nn.Module], phase: str) -> None:
        with self.lock:
            for module in modules:
                handle, users = self.handles.pop((module, phase))
                if users > 1:
                    self.handles[(module, phase)] = (handle, users - 1)
                else:
                    handle.remove()

    @staticmethod
    def _install(module: nn.Module, phase: str) -> RemovableHandle:
        if phase == "pre":
            return module.register_forward_pre_hook(_dispatch_pre, with_kwargs=True)
        return module.register_forward_hook(_dispatch_forward)


_INSTALLED = _Installed()


@contextmanager
def local_hooks(modules: Iterable[nn.Module], hook: ForwardHook | PreHook, *, pre: bool = False) -> Iterator[None]:
    """Run ``hook`` on every module in ``modules``, in this thread / async task only, inside the block.

    A forward hook gets ``(module, inputs, output)`` and returns a new output or None; with
    ``pre=True`` it runs before the module with ``(module, args, kwargs)`` and returns new
    ``(args, kwargs)`` or None. Nested blocks add up; everything is removed on exit, even after an
    error, and the model is left exactly as it was once no block uses it.
    """
    modules = list(modules)
    phase = "pre" if pre else "forward"
    active = _ACTIVE[phase]
    _INSTALLED.acquire(modules, phase)
    try:
        current = dict(active.get())
        for module in modules:
            current[module] = (*current.get(module, ()), hook)
        token = active.set(MappingProxyType(current))
        try:
            yield
        finally:
            active.reset(token)
    finally:
        _INSTALLED.release(modules, phase)


@contextmanager
def hooks_paused() -> Iterator[None]:
    """No local hook runs inside the block (this thread / async task): a recorder that computes from a finished
    pass while the next one runs (a generation's step) calls the model's norms without its own hooks keeping
    their inputs."""
    tokens = [(active, active.set(_NO_HOOKS)) for active in _ACTIVE.values()]
    try:
        yield
    finally:
        for active, token in reversed(tokens):
            active.reset(token)
