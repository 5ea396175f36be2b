"""A key/value cache layer that grows in place: generation without copying the whole cache at every step.

transformers' ``DynamicLayer`` appends a step's keys and values with ``torch.cat``, so every step of every layer
allocates the whole cache again and frees the old one (SmolLM2 at 1,536 tokens: about 69 MB per step). Beside a
record that also grows, those freed blocks stay with the process (glibc keeps them for reuse, fragmented), so
``attnscope.generate`` had to hand the heap back after every token (``malloc_trim``, about 18 ms a step at a
thousand generated tokens), and the copies themselves took a sixth of a plain step. :class:`GrowingLayer` keeps each
layer's keys and values in buffers with room to spare (half again as large when full) and writes a step's keys into
place: the keys and values it returns are views of the first ``length`` positions, equal to the concatenation.

:func:`growing_caches` swaps it in for the full-attention layers of the cache ``generate`` prepares (sliding-window
layers, other caches and a cache the caller gives are left as they are).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

MIN_ROOM = 256  # positions a buffer holds at least


def appended(buffer: torch.Tensor | None, cached: torch.Tensor | None, new: torch.Tensor, length: int,
             spare: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``new`` ``[..., added, d]`` written after the ``length`` cached positions (axis -2): into ``buffer`` where it
    has room (``cached`` is then the view of its first ``length``), else into a new buffer with ``spare`` positions
    of room beyond them, ``cached`` copied in. Returns the buffer and the view of its first ``length + added``
    positions, equal to ``torch.cat([cached, new], -2)``; views handed out earlier keep their values."""
    added = new.shape[-2]
    if buffer is None or length + added > buffer.shape[-2]:
        grown = new.new_empty((*new.shape[:-2], length + added + spare, new.shape[-1]))
        if length:
            assert cached is not None
            grown[..., :length, :] = cached[..., :length, :]
        buffer = grown
    buffer[..., length : length + added, :] = new
    return buffer, buffer[..., : length + added, :]


class GrowingLayer(DynamicLayer):
    """A :class:`~transformers.cache_utils.DynamicLayer` whose keys and values ``[batch, kv_head, pos, d_head]`` are
    views of buffers with room to grow along ``pos``."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys and values after the cached ones; return every cached position's (views)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, added = self.get_seq_length(), key_states.shape[-2]
        needed = length + added
        spare = max(needed // 2, MIN_ROOM - needed)  # a new buffer holds half again, at least MIN_ROOM positions
        buffers = self.buffers or (None, None)
        (keys, self.keys), (values, self.values) = (
            appended(buffer, cached, new, length, spare)
            for buffer, cached, new in zip(buffers, (self.keys, self.values), (key_states, value_states)))
        self.buffers = keys, values
        return self.keys, self.values

    def _dropped_buffers(self) -> None:
        """After an operation that replaces the views (crop, batch selection), the next update starts new buffers."""
        self.buffers = None

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self._dropped_buffers()

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._dropped_buffers()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._dropped_buffers()

    def reset(self) -> None:
        super().reset()
        self.buffers = None


def swap_layers(cache: Any) -> None:
    """Replace the not yet used full-attention ``DynamicLayer``\\ s of a ``DynamicCache`` (or of an encoder-decoder
    cache's self-attention part) with :class:`GrowingLayer`\\ s; any other cache is left as it is."""
    inner = getattr(cache, "self_attention_cache", cache)
    if type(inner) is not DynamicCache:
        return
    for index, layer in enumerate(inner.layers):
        if type(layer) is DynamicLayer and not layer.is_initialized:
            inner.layers[index] = GrowingLayer()


_GROWING: ContextVar[bool] = ContextVar("attnscope_growing_caches", default=False)


def _install(model: Any) -> None:
    """Wrap ``model``'s cache preparation once, for good: the wrapper swaps layers only inside
    :func:`growing_caches` (a context variable, so a generation in another thread is not touched, and no thread's
    exit can undo what another installed)."""
    if getattr(model, "_attnscope_grows", False):
        return
    prepare = model._prepare_cache_for_generation

    def prepared(generation_config: Any, model_kwargs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        result = prepare(generation_config, model_kwargs, *args, **kwargs)
        if _GROWING.get():
            for name in ("cache", "past_key_values"):
                if model_kwargs.get(name) is not None and not getattr(model_kwargs[name], "_is_user_defined", False):
                    swap_layers(model_kwargs[name])
        return result

    model._prepare_cache_for_generation = prepared
    model._attnscope_grows = True


@contextmanager
def growing_caches(model: Any) -> Iterator[None]:
    """While open, the cache ``model.generate`` prepares for itself grows in place (:func:`swap_layers`)."""
    _install(model)
    token = _GROWING.set(True)
    try:
        yield
    finally:
        _GROWING.reset(token)
