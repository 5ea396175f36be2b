"""KV budgets: a cache that keeps every key only for the KV heads that need them.

A :class:`KVBudget` says, per layer and KV head (0-indexed), whether the head is **full** (its cache keeps every key
and value) or **streaming** (it keeps the first ``sink`` keys and the ``window`` most recent, StreamingLLM's attention
sinks and recent window, DuoAttention's streaming heads). :func:`choose_budget` makes one from head scores ``[layer,
kv_head]`` (the highest scores full, by a share of the heads or a memory budget in bytes), :func:`random_budget` at
random (seeded), and :func:`kv_bytes` is what such a cache holds for a text of ``T`` tokens.

:class:`BudgetedCache` is the cache itself: a transformers ``Cache`` to hand to ``model.generate(past_key_values=...)``
(``cache=`` in transformers 5.24) of a model loaded with attnscope's attention function. Its streaming heads really
hold smaller tensors, evicted as the text grows; each layer's ``update`` returns one :class:`BudgetedStates` (both
parts, the kept positions, the head maps) that :func:`~attnscope.capture.attention.attnscope_attention` recognises:
full heads attend over every key, streaming heads over their kept keys, with the mask's columns at the kept
positions (rotary embeddings are applied before caching, so a cached key keeps its position). Layers the model
already windows (Gemma 3's local layers, gpt-oss's sliding layers: transformers' ``DynamicSlidingWindowLayer``) stay
as the model caches them and count as neither full nor streaming; a learned sink (gpt-oss) is no key: untouched.

Positions are the cache's slots, as :class:`~attnscope.experiments.interventions.SinkWindow` counts them (its mask on
a full cache is the reference of this cache): one unpadded text at a time.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import AttnscopeError

DEFAULT_SINK = 4
DEFAULT_WINDOW = 64
DEFAULT_SCORE = "retrieval"  # the needle-retrieval score: DuoAttention's and RazorAttention's full heads retrieve


@dataclass(frozen=True)
class KVLayout:
    """What a model's cache is made of: ``n_layers``, ``n_kv_heads``, ``head_dim``, and per layer the sliding window
    the model itself caches it with (``windows``; 0 = a global layer, one a budget chooses for)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    windows: tuple[int, ...]

    @property
    def global_layers(self) -> list[int]:
        return [layer for layer, window in enumerate(self.windows) if not window]


def kv_layout(model: Any) -> KVLayout:
    """The :class:`KVLayout` of ``model`` (a ``LoadedModel``, a transformers model or its config), from the layers
    transformers' own cache would build for it (``DynamicCache(config=...)``)."""
    config = _config_of(model)
    text = config.get_text_config(decoder=True)
    windows = tuple(_model_window(layer) for layer in _model_layers(config))
    n_heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", 0) or text.hidden_size // n_heads)
    return KVLayout(len(windows), int(getattr(text, "num_key_value_heads", 0) or n_heads), head_dim, windows)


def _model_layers(config: Any) -> list[Any]:
    """The cache layers transformers builds for ``config``; anything but a plain or sliding-window layer is refused."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    layers = DynamicCache(config=config).layers
    if not layers:  # no layer types in the config: one plain layer per hidden layer
        layers = [DynamicLayer() for _ in range(int(config.get_text_config(decoder=True).num_hidden_layers))]
    for index, layer in enumerate(layers):
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
            raise AttnscopeError(f"a KV budget needs key/value caches of attention layers; layer {index} caches "
                                 f"{type(layer).__name__}")
    return list(layers)


def _model_window(layer: Any) -> int:
    return int(getattr(layer, "sliding_window", 0) or 0)


@dataclass(frozen=True, eq=False)
class KVBudget:
    """Which KV heads keep every key: ``full`` bool ``[layer, kv_head]`` (False in a windowed layer: the model windows
    it itself), ``sink`` + ``window`` the keys a streaming head keeps, ``windows`` per layer the model's own sliding
    window (0 = a global layer, whose heads are full or streaming)."""

    full: np.ndarray
    sink: int
    window: int
    windows: tuple[int, ...]

    def __post_init__(self) -> None:
        check_sizes(self.sink, self.window)
        if self.full.ndim != 2 or self.full.shape[0] != len(self.windows):
            raise AttnscopeError(f"a budget's full heads are [layer, kv_head] over {len(self.windows)} layers, got "
                                 f"shape {tuple(self.full.shape)}")
        if any(self.full[layer].any() for layer, window in enumerate(self.windows) if window):
            raise AttnscopeError("a layer the model windows itself has no full heads in a budget")

    @property
    def streamed(self) -> np.ndarray:
        """Bool ``[layer, kv_head]``: the streaming heads (those of global layers that are not full)."""
        global_layer = np.array([not window for window in self.windows])[:, None]
        return global_layer & ~self.full

    @property
    def share(self) -> float:
        """The share of full heads among the global layers' KV heads."""
        chosen = self.full[[not window for window in self.windows]]
        return float(chosen.mean()) if chosen.size else 1.0

    def layer_heads(self, layer: int) -> list[bool]:
        return [bool(flag) for flag in self.full[layer]]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``full`` (lists of 0/1 per layer), ``streamed`` as ``[[layer, kv_head], ...]``, sizes."""
        return {"full": self.full.astype(int).tolist(), "sink": self.sink, "window": self.window,
                "windows": list(self.windows), "share": self.share,
                "streamed": [[int(layer), int(head)] for layer, head in np.argwhere(self.streamed)]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVBudget:
        """The budget :meth:`to_dict` wrote (a record's ``settings["kv_budget"]``)."""
        return cls(np.asarray(data["full"], dtype=bool), int(data["sink"]), int(data["window"]),
                   tuple(int(w) for w in data["windows"]))

    def all_full(self) -> KVBudget:
        """The same layers with every KV head of the global layers full: what a plain cache holds."""
        global_layer = np.array([not window for window in self.windows])[:, None]
        return KVBudget(np.broadcast_to(global_layer, self.full.shape).copy(), self.sink, self.window, self.windows)

    def check_layout(self, layout: KVLayout) -> None:
        """Refuse a budget made for another model (layers, KV heads, windowed layers)."""
        if self.full.shape != (layout.n_layers, layout.n_kv_heads) or self.windows != layout.windows:
            raise AttnscopeError(f"the KV budget is for {self.full.shape[0]} layers x {self.full.shape[1]} KV heads, "
                                 f"the model has {layout.n_layers} x {layout.n_kv_heads}")


def check_sizes(sink: int, window: int) -> None:
    if sink < 0 or window < 1:
        raise AttnscopeError(f"a streaming head keeps sink >= 0 and window >= 1 keys, got sink {sink} and window "
                             f"{window}")


def check_evicts(sink: int, window: int, n_tokens: int) -> None:
    """Refuse a streaming head's ``sink`` + ``window`` that covers a whole text of ``n_tokens`` tokens (nothing
    would ever be evicted)."""
    check_sizes(sink, window)
    if sink + window >= n_tokens:
        raise AttnscopeError(f"a streaming head's sink + window ({sink} + {window} keys) covers the whole text of "
                             f"{n_tokens} tokens: nothing would be evicted; give a smaller window")


def kv_bytes(budget: KVBudget, tokens: int, head_dim: int, dtype: torch.dtype = torch.float32, batch: int = 1) -> int:
    """Bytes of keys and values a :class:`BudgetedCache` holds once a text of ``tokens`` tokens went through it: a
    full head ``tokens`` keys, a streaming head ``min(tokens, sink + window)`` (what the last query saw), a head of a
    layer the model windows ``min(tokens, window - 1)`` (transformers' sliding layer keeps one less than its window:
    the next query brings its own key)."""
    per_key = 2 * head_dim * torch.tensor([], dtype=dtype).element_size() * batch  # a key and its value
    keys = 0
    for layer, window in enumerate(budget.windows):
        n_full = int(budget.full[layer].sum())
        if window:
            keys += budget.full.shape[1] * min(tokens, window - 1)
        else:
            keys += n_full * tokens + (budget.full.shape[1] - n_full) * min(tokens, budget.sink + budget.window)
    return keys * per_key


def choose_budget(scores: Any, layout: KVLayout, *, share: float | None = None, bytes: int | None = None,
                  tokens: int | None = None, sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW,
                  dtype: torch.dtype = torch.float32) -> KVBudget:
    """Full KV heads where ``scores`` ``[layer, kv_head]`` are highest (ties: the lower layer, then head; NaN last),
    among the global layers' heads: ``share`` (0-1) of them, or as many as ``bytes`` allows for a text of ``tokens``
    tokens (:func:`kv_bytes`). Higher must mean "needs every key" (a retrieval score)."""
    values = np.asarray(scores, dtype=float)
    if values.shape != (layout.n_layers, layout.n_kv_heads):
        raise AttnscopeError(f"scores of shape {values.shape} are not this model's [layer, kv_head] = "
                             f"({layout.n_layers}, {layout.n_kv_heads}): were they computed on another model?")
    candidates = [(layer, head) for layer in layout.global_layers for head in range(layout.n_kv_heads)]
    n_full = _n_full(layout, len(candidates), share, bytes, tokens, sink, window, dtype)
    ranked = sorted(candidates, key=lambda lh: (-np.nan_to_num(values[lh], nan=-np.inf), lh))
    return _budget_of(layout, ranked[:n_full], sink, window)


def random_budget(layout: KVLayout, *, share: float | None = None, bytes: int | None = None, tokens: int | None = None,
                  seed: int = 0, sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW,
                  dtype: torch.dtype = torch.float32) -> KVBudget:
    """As many full heads as :func:`choose_budget` would choose, drawn at random (``seed``) among the global layers'."""
    candidates = [(layer, head) for layer in layout.global_layers for head in range(layout.n_kv_heads)]
    n_full = _n_full(layout, len(candidates), share, bytes, tokens, sink, window, dtype)
    drawn = np.random.default_rng(seed).permutation(len(candidates))[:n_full]
    return _budget_of(layout, [candidates[i] for i in drawn], sink, window)


def _budget_of(layout: KVLayout, full_heads: Sequence[tuple[int, int]], sink: int, window: int) -> KVBudget:
    full = np.zeros((layout.n_layers, layout.n_kv_heads), dtype=bool)
    for layer, head in full_heads:
        full[layer, head] = True
    return KVBudget(full, sink, window, layout.windows)


def _n_full(layout: KVLayout, n_candidates: int, share: float | None, bytes: int | None, tokens: int | None,
            sink: int, window: int, dtype: torch.dtype) -> int:
    """How many full heads a ``share`` or a ``bytes`` budget (for ``tokens`` tokens) allows; refuses bad budgets."""
    check_sizes(sink, window)
    if not layout.global_layers:
        raise AttnscopeError("every layer of this model is windowed already: no KV head for a budget to choose")
    if (share is None) == (bytes is None):
        raise AttnscopeError("give a KV budget as a share of full heads (0-1) or as bytes, one of them")
    if share is not None:
        if not 0.0 <= share <= 1.0:  # NaN fails too
            raise AttnscopeError(f"a share of full KV heads is between 0 and 1, got {share}")
        return math.floor(share * n_candidates + 0.5)
    assert bytes is not None
    if tokens is None or tokens < 1:
        raise AttnscopeError("a KV budget in bytes needs the text's length in tokens")
    streaming = kv_bytes(_budget_of(layout, [], sink, window), tokens, layout.head_dim, dtype)
    if bytes < streaming:
        raise AttnscopeError(f"a KV budget of {bytes:,} bytes is below what sink + window of every head cost for "
                             f"{tokens} tokens: {streaming:,} bytes")
    per_head = 2 * layout.head_dim * torch.tensor([], dtype=dtype).element_size() * \
        (tokens - min(tokens, sink + window))  # what making one streaming head full adds
    return n_candidates if per_head == 0 else min(n_candidates, (bytes - streaming) // per_head)


def kv_head_scores(source: Any, name: str = DEFAULT_SCORE, *, n_kv_heads: int | None = None) -> np.ndarray:
    """Scores ``[layer, kv_head]`` of column ``name`` from ``source``: an array ``[layer, kv_head]``, a
    ``HeadScores``, or the Parquet file ``attnscope head-functions --save`` writes (per
    query head: the group's maximum; per KV group: its ``<name>_max`` column). A ``streaming_window_k*`` score (the
    smallest window that keeps enough; NaN: none does) ranks NaN first: such a head needs every key."""
    if isinstance(source, np.ndarray | torch.Tensor | list):
        return np.asarray(source, dtype=float)
    if isinstance(source, str | Path):
        import pandas as pd

        path = Path(source)
        if not path.is_file():
            raise AttnscopeError(f"no scores file {path}")
        try:
            frame = pd.read_parquet(path)
        except Exception as error:  # noqa: BLE001 - any unreadable file is the user's input
            raise AttnscopeError(f"{path} is not a head-scores Parquet file ({type(error).__name__})") from None
    else:
        return _scores_of_groups(source, name)
    return _scores_from_frame(frame, name)


def _scores_of_groups(scores: Any, name: str) -> np.ndarray:
    """``[layer, kv_head]`` from a ``HeadScores``: the highest of each group's query heads (NaN only where all are)."""
    if name not in scores.scores:
        raise AttnscopeError(f"no score {name!r} here; these were computed: {', '.join(scores.scores)}")
    values = np.asarray(scores.scores[name], dtype=float)
    grouped = values.reshape(values.shape[0], scores.n_kv_heads, -1)  # a group's query heads are adjacent
    best = np.where(np.isnan(grouped).all(-1), np.nan, np.nan_to_num(grouped, nan=-np.inf).max(-1))
    return _nan_ranks(best, name)


def _scores_from_frame(frame: Any, name: str) -> np.ndarray:
    column = name if "head" in frame.columns else f"{name}_max"
    if column not in frame.columns or not {"layer", "kv_head"} <= set(frame.columns):
        known = sorted(c.removesuffix("_max") for c in frame.columns if c.endswith("_max") or c not in
                       ("layer", "head", "kv_head", "window", "note") and not c.endswith("_mean"))
        raise AttnscopeError(f"no score {name!r} in the scores file; it holds: {', '.join(known) or 'none'}")
    grouped = frame.groupby(["layer", "kv_head"])[column].max()  # per query head: the group's highest (NaN skipped)
    n_layers, n_kv_heads = int(frame["layer"].max()) + 1, int(frame["kv_head"].max()) + 1
    values = np.full((n_layers, n_kv_heads), np.nan)
    for (layer, head), value in grouped.items():
        values[int(layer), int(head)] = value
    return _nan_ranks(values, name)


def _nan_ranks(values: np.ndarray, name: str) -> np.ndarray:
    """A ``streaming_window_k*`` score's NaN (no window keeps enough: the head needs every key) as the highest."""
    return np.nan_to_num(values, nan=np.inf) if name.startswith("streaming_window") else values


@dataclass(frozen=True, eq=False)
class BudgetedStates:
    """What a :class:`BudgetedCache` layer hands the attention function for one call, instead of keys and values.

    ``full_keys``/``full_values``: ``[batch, n_full, k_pos, d_head]``, every key of the full KV heads
    ``full_heads``; ``stream_keys``/``stream_values``: ``[batch, n_stream, kept, d_head]`` of the streaming KV heads
    ``stream_heads``, at key slots ``positions`` (long ``[kept]``, ascending); ``n_keys``: the call's key axis
    (every position so far, the new ones included); ``sink``/``window``: what a streaming head's query sees.
    Any attention function but attnscope's fails on it in one line (it is no tensor)."""

    full_keys: torch.Tensor
    full_values: torch.Tensor
    stream_keys: torch.Tensor
    stream_values: torch.Tensor
    positions: torch.Tensor
    full_heads: tuple[int, ...]
    stream_heads: tuple[int, ...]
    n_keys: int
    sink: int
    window: int

    @property
    def n_kv_heads(self) -> int:
        return len(self.full_heads) + len(self.stream_heads)

    def __getattr__(self, name: str) -> Any:  # only for names a dataclass field is not: a tensor's
        raise AttnscopeError(f"a budgeted KV cache works only with attnscope's attention function (load the model "
                             f"with attnscope.load_model); another one asked its states for {name!r}")

    def stream_mask(self, q_len: int) -> torch.Tensor:
        """Bool ``[q_pos, kept]``: the kept keys each of the call's last ``q_len`` queries sees (its sink keys and
        its ``window`` most recent, itself included; the model's own mask is applied besides)."""
        return self.sink_window(q_len, self.positions)

    def sink_window(self, q_len: int, keys: torch.Tensor) -> torch.Tensor:
        """Bool ``[q_pos, key]``: whether key slot ``keys[j]`` is one of query ``i``'s first ``sink`` keys or its
        ``window`` most recent (the queries: the call's last ``q_len`` slots)."""
        queries = torch.arange(self.n_keys - q_len, self.n_keys, device=keys.device)[:, None]
        keys = keys[None, :]
        return (keys < self.sink) | ((keys <= queries) & (keys > queries - self.window))

    def dense_mask(self, seen: torch.Tensor, n_heads: int) -> torch.Tensor:
        """Bool ``[batch or 1, head, q_pos, k_pos]``: the keys each query head saw in this call over the whole key axis,
        ``seen`` (the model's mask, ``[batch or 1, 1, q_pos, k_pos]``) restricted to each query's sink and window for
        the query heads of streaming KV heads (for recorders that recompute attention from the call's inputs)."""
        q_len, group = seen.shape[-2], n_heads // self.n_kv_heads
        window = self.sink_window(q_len, torch.arange(self.n_keys, device=seen.device))  # [q_pos, k_pos]
        streamed = torch.zeros(n_heads, dtype=torch.bool, device=seen.device)
        streamed[[h for kv in self.stream_heads for h in range(kv * group, (kv + 1) * group)]] = True
        return seen & (window | ~streamed[:, None, None])

    def dense(self, part: str) -> torch.Tensor:
        """``part`` ("keys" or "values") over the whole key axis, ``[batch, kv_head, k_pos, d_head]``: zeros where a
        streaming head evicted the key (for recorders, which read rows and values over every position)."""
        full, stream = (self.full_keys, self.stream_keys) if part == "keys" else (self.full_values, self.stream_values)
        reference = full if full.shape[1] else stream
        out = reference.new_zeros((reference.shape[0], self.n_kv_heads, self.n_keys, reference.shape[-1]))
        out[:, list(self.full_heads)] = full
        slots = out[:, list(self.stream_heads)]
        slots[:, :, self.positions] = stream
        out[:, list(self.stream_heads)] = slots
        return out


def _make_budgeted_layer() -> type:
    """:class:`BudgetedLayer`, defined on first use so that importing this module does not import transformers."""
    from transformers.cache_utils import DynamicLayer

    class BudgetedLayer(DynamicLayer):  # type: ignore[misc, valid-type]
        """One global layer's cache under a budget: full KV heads keep every key, streaming ones the first ``sink``
        and the ``window`` most recent; ``update`` returns :class:`BudgetedStates` as both keys and values."""

        def __init__(self, full: Sequence[bool], sink: int, window: int) -> None:
            super().__init__()
            self.full_heads = tuple(i for i, flag in enumerate(full) if flag)
            self.stream_heads = tuple(i for i, flag in enumerate(full) if not flag)
            self.sink, self.window, self.seen = sink, window, 0
            self.parts: list[torch.Tensor] = []  # full keys, full values, streaming keys, streaming values
            self.positions = torch.zeros(0, dtype=torch.long)

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            if key_states.shape[1] != len(self.full_heads) + len(self.stream_heads):
                raise AttnscopeError(f"the KV budget has {len(self.full_heads) + len(self.stream_heads)} KV heads "
                                     f"per layer, the model's layer {key_states.shape[1]}")
            self.device = key_states.device
            batch, _, _, d_head = key_states.shape
            self.parts = [key_states.new_zeros((batch, len(heads), 0, d_head))
                          for heads in (self.full_heads, self.full_heads, self.stream_heads, self.stream_heads)]
            self.positions = torch.zeros(0, dtype=torch.long, device=self.device)
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[Any, Any]:  # BudgetedStates twice, in the tensors' places
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            new = key_states.shape[2]
            pieces = (key_states[:, list(self.full_heads)], value_states[:, list(self.full_heads)],
                      key_states[:, list(self.stream_heads)], value_states[:, list(self.stream_heads)])
            parts = [torch.cat([held, piece], dim=2) for held, piece in zip(self.parts, pieces, strict=True)]
            positions = torch.cat([self.positions, torch.arange(self.seen, self.seen + new, device=self.device)])
            self.seen += new
            full_keys, full_values, stream_keys, stream_values = parts
            states = BudgetedStates(full_keys, full_values, stream_keys, stream_values, positions=positions, full_heads=self.full_heads,
                                    stream_heads=self.stream_heads, n_keys=self.seen, sink=self.sink,
                                    window=self.window)
            kept = (positions < self.sink) | (positions >= self.seen - self.window)  # what the last query saw
            self.parts = [*parts[:2], parts[2][:, :, kept].contiguous(), parts[3][:, :, kept].contiguous()]
            self.positions = positions[kept]
            return states, states

        def get_seq_length(self) -> int:
            return self.seen

        def stored_bytes(self) -> int:
            return sum(part.numel() * part.element_size() for part in self.parts)

        def reset(self) -> None:
            self.parts, self.seen, self.is_initialized = [], 0, False

        def _refuse(self, *args: Any, **kwargs: Any) -> None:
            raise AttnscopeError("a budgeted KV cache cannot be cropped, reordered or repeated (beam search, "
                                 "assisted decoding): generate greedily or by sampling")

        crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _refuse
        offload = prefetch = _refuse

    return BudgetedLayer


_LAYER_CLASS: list[type] = []


def budgeted_layer_class() -> type:
    if not _LAYER_CLASS:
        _LAYER_CLASS.append(_make_budgeted_layer())
    return _LAYER_CLASS[0]


def budgeted_cache(model: Any, budget: KVBudget) -> Any:
    """A ``BudgetedCache`` for ``model`` (a ``LoadedModel``, a transformers model or its config) under ``budget``:
    hand it to ``model.generate(past_key_values=...)`` (``cache=`` from transformers 5.24). The class itself,
    ``attnscope.capture.kv_budget.BudgetedCache(model, budget)``, is the same call. Refused where the model does not
    run attnscope's attention function (only it reads the budgeted states) or the budget is another model's."""
    return _cache_class()(model, budget)


def _config_of(model: Any) -> Any:
    """The transformers config of a ``LoadedModel``, a transformers model, or a config itself."""
    return getattr(getattr(model, "model", model), "config", model)


def _make_cache_class() -> type:
    from transformers.cache_utils import Cache, DynamicLayer

    class BudgetedCache(Cache):  # type: ignore[misc, valid-type]
        """A transformers ``Cache`` under a :class:`KVBudget`: global layers cache by the budget (``BudgetedLayer``),
        layers the model windows as the model caches them. ``model``: a ``LoadedModel``, a transformers model or its
        config, loaded with attnscope's attention function."""

        def __init__(self, model: Any, budget: KVBudget) -> None:
            config = _config_of(model)
            implementation = getattr(config, "_attn_implementation", None)
            if implementation != "attnscope":
                raise AttnscopeError(f"a budgeted KV cache works only with attnscope's attention function; this "
                                     f"model runs {implementation!r} (load it with attnscope.load_model)")
            budget.check_layout(kv_layout(config))
            layer_class = budgeted_layer_class()
            layers = [layer_class(budget.layer_heads(index), budget.sink, budget.window)
                      if type(layer) is DynamicLayer else layer for index, layer in enumerate(_model_layers(config))]
            super().__init__(layers=layers)
            self.budget = budget

        def stored_bytes(self) -> int:
            """Bytes of the keys and values every layer holds now (streaming heads: their kept keys only)."""
            return sum(layer.stored_bytes() if hasattr(layer, "stored_bytes") else _held(layer)
                       for layer in self.layers)

    return BudgetedCache


def _held(layer: Any) -> int:
    if not layer.is_initialized or layer.keys is None:
        return 0
    return int(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size())


_CACHE_CLASS: list[type] = []


def _cache_class() -> type:
    if not _CACHE_CLASS:
        _CACHE_CLASS.append(_make_cache_class())
    return _CACHE_CLASS[0]


def __getattr__(name: str) -> Any:
    """``BudgetedCache`` and ``BudgetedLayer``, made on first use (they subclass transformers' classes, and importing
    this module does not import transformers)."""
    if name == "BudgetedCache":
        return _cache_class()
    if name == "BudgetedLayer":
        return budgeted_layer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def budget_from(model: Any, kv_budget: KVBudget | float, kv_scores: Any, *, score: str = DEFAULT_SCORE,
                tokens: int | None = None, sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW) -> KVBudget:
    """The budget ``kv_budget`` names for ``model``: a :class:`KVBudget` as it is, a share (0-1, a float) or bytes (an
    int above 1) of full heads chosen from ``kv_scores`` (column ``score``; :func:`kv_head_scores`)."""
    layout = kv_layout(model)
    if isinstance(kv_budget, KVBudget):
        kv_budget.check_layout(layout)
        return kv_budget
    if kv_scores is None:
        raise AttnscopeError("a KV budget given as a share or bytes needs head scores to choose from (kv_scores)")
    scores = kv_head_scores(kv_scores, score)
    if isinstance(kv_budget, int) and not isinstance(kv_budget, bool) and kv_budget > 1:
        return choose_budget(scores, layout, bytes=kv_budget, tokens=tokens, sink=sink, window=window)
    return choose_budget(scores, layout, share=float(kv_budget), sink=sink, window=window)


def parse_budget(text: str) -> float | int:
    """``--kv-budget``: a share of full heads (``0.25``, ``25%``) or bytes (``1048576``, ``64MiB``, ``2MB``)."""
    value = text.strip()
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    try:
        if value.endswith("%"):
            return float(value[:-1]) / 100
        for unit, factor in units.items():
            if value.lower().endswith(unit):
                return int(float(value[: -len(unit)]) * factor)
        number = float(value)
    except ValueError:
        raise AttnscopeError(f"--kv-budget takes a share of full heads (0-1, or 25%) or bytes (e.g. 64MiB), not "
                             f"{text!r}") from None
    return int(number) if number > 1 and number.is_integer() else number


def budget_json(budget: KVBudget) -> str:
    return json.dumps(budget.to_dict())
