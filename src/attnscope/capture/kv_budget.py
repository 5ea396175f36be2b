"""KV budgets: a cache that keeps every key only for the KV heads that need them.

A :class:`KVBudget` says, per layer and KV head (0-indexed), whether the head is **full** (its cache keeps every key
and value) or **streaming** (it keeps the first ``sink`` keys and the ``window`` most recent, StreamingLLM's attention
sinks and recent window, DuoAttention's streaming heads; a budget may give each streaming head its own window).
:func:`choose_budget` makes one from head scores ``[layer, kv_head]`` (the highest scores full, by a share of the heads
or a memory budget in bytes; :func:`kv_head_scores` reads them from any form attnscope writes), :func:`random_budget`
at random (seeded), and :func:`kv_bytes` is what such a cache holds for a text of ``T`` tokens. The KV budget curve
(:mod:`attnscope.experiments.kv_curve`) builds its budgets here too.

:class:`BudgetedCache` is the cache itself: a transformers ``Cache`` to hand to ``model.generate(past_key_values=...)``
(``cache=`` in transformers 5.24) of a model loaded with attnscope's attention function. Its streaming heads really
hold smaller tensors (the heads of one window together), evicted as the text grows; each layer's ``update`` returns
one :class:`BudgetedStates` (the full heads' keys, each window's :class:`StreamPart` with its kept positions) that :func:`~attnscope.capture.attention.attnscope_attention` recognises:
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
    """What a model's cache is made of: ``n_layers``, ``n_kv_heads``, ``head_dim``, per layer the sliding window the
    model itself caches it with (``windows``; 0 = a global layer, one a budget chooses for), and ``group`` query heads
    per KV head (adjacent, as transformers repeats them)."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    windows: tuple[int, ...]
    group: int = 1

    @property
    def global_layers(self) -> list[int]:
        return [layer for layer, window in enumerate(self.windows) if not window]

    @property
    def candidates(self) -> list[tuple[int, int]]:
        """The KV heads a budget chooses among, ``(layer, kv_head)`` in order: every KV head of the global layers."""
        return [(layer, head) for layer in self.global_layers for head in range(self.n_kv_heads)]

    def query_heads(self, kv_head: int) -> list[int]:
        """The query heads sharing ``kv_head``."""
        return list(range(kv_head * self.group, (kv_head + 1) * self.group))


def kv_layout(model: Any) -> KVLayout:
    """The :class:`KVLayout` of ``model`` (a ``LoadedModel``, a transformers model or its config), from the layers
    transformers' own cache would build for it (``DynamicCache(config=...)``)."""
    config = _config_of(model)
    text = config.get_text_config(decoder=True)
    windows = tuple(_model_window(layer) for layer in _model_layers(config))
    n_heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", 0) or text.hidden_size // n_heads)
    n_kv_heads = int(getattr(text, "num_key_value_heads", 0) or n_heads)
    return KVLayout(len(windows), n_kv_heads, head_dim, windows, n_heads // n_kv_heads)


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
    window (0 = a global layer, whose heads are full or streaming). ``recent``: int ``[layer, kv_head]``, each
    streaming head's own window where they differ (a uniform budget); None: ``window`` for each, which is then the
    smallest of them."""

    full: np.ndarray
    sink: int
    window: int
    windows: tuple[int, ...]
    recent: np.ndarray | None = None

    def __post_init__(self) -> None:
        check_sizes(self.sink, self.window)
        if self.full.ndim != 2 or self.full.shape[0] != len(self.windows):
            raise AttnscopeError(f"a budget's full heads are [layer, kv_head] over {len(self.windows)} layers, got "
                                 f"shape {tuple(self.full.shape)}")
        if any(self.full[layer].any() for layer, window in enumerate(self.windows) if window):
            raise AttnscopeError("a layer the model windows itself has no full heads in a budget")
        if self.recent is not None and (self.recent.shape != self.full.shape or
                                        (self.recent[self.streamed] < self.window).any()):
            raise AttnscopeError(f"a budget's windows per head are [layer, kv_head] = {self.full.shape}, each at "
                                 f"least its window {self.window}")

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

    def head_windows(self) -> np.ndarray:
        """Int ``[layer, kv_head]``: the recent keys each streaming head keeps besides its sink (others: 0)."""
        recent = np.full(self.full.shape, self.window) if self.recent is None else self.recent
        return np.where(self.streamed, recent, 0)

    def layer_heads(self, layer: int) -> list[bool]:
        return [bool(flag) for flag in self.full[layer]]

    def evicting(self, tokens: int) -> dict[tuple[int, int], int]:
        """``{(layer, kv_head): window}``: the streaming heads that lose keys in a text of ``tokens`` tokens (a head
        whose sink + window reach ``tokens`` keeps every key, as a full one does)."""
        windows = self.head_windows()
        return {(int(layer), int(head)): int(windows[layer, head]) for layer, head in np.argwhere(self.streamed)
                if self.sink + windows[layer, head] < tokens}

    def key(self, tokens: int) -> tuple[Any, ...]:
        """Equal for budgets that keep the same keys of a text of ``tokens`` tokens (results are reused)."""
        return self.sink, tuple(sorted(self.evicting(tokens).items())), tokens

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``full`` (lists of 0/1 per layer), ``streamed`` as ``[[layer, kv_head], ...]``, sizes; with
        windows per head, ``recent`` ``[[layer, kv_head, window], ...]`` too."""
        out = {"full": self.full.astype(int).tolist(), "sink": self.sink, "window": self.window,
               "windows": list(self.windows), "share": self.share,
               "streamed": [[int(layer), int(head)] for layer, head in np.argwhere(self.streamed)]}
        if self.recent is not None:
            windows = self.head_windows()
            out["recent"] = [[layer, head, int(windows[layer, head])] for layer, head in out["streamed"]]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVBudget:
        """The budget :meth:`to_dict` wrote (a record's ``settings["kv_budget"]``), windows per head included."""
        full = np.asarray(data["full"], dtype=bool)
        recent = None
        if "recent" in data:
            recent = np.zeros(full.shape, dtype=int)
            for layer, head, window in data["recent"]:
                recent[layer, head] = window
        return cls(full, int(data["sink"]), int(data["window"]), tuple(int(w) for w in data["windows"]), recent)

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


def key_bytes(head_dim: int, dtype: torch.dtype = torch.float32, batch: int = 1) -> int:
    """Bytes of one key and its value in one KV head."""
    return 2 * head_dim * torch.tensor([], dtype=dtype).element_size() * batch


def check_evicts(sink: int, window: int, n_tokens: int) -> None:
    """Refuse a streaming head's ``sink`` + ``window`` that covers a whole text of ``n_tokens`` tokens (nothing
    would ever be evicted)."""
    check_sizes(sink, window)
    if sink + window >= n_tokens:
        raise AttnscopeError(f"a streaming head's sink + window ({sink} + {window} keys) covers the whole text of "
                             f"{n_tokens} tokens: nothing would be evicted; give a smaller window")


def kv_bytes(budget: KVBudget, tokens: int, head_dim: int, dtype: torch.dtype = torch.float32, batch: int = 1) -> int:
    """Bytes of keys and values a :class:`BudgetedCache` holds once a text of ``tokens`` tokens went through it: a
    full head ``tokens`` keys, a streaming head ``min(tokens, sink + its window)`` (what the last query saw), a head
    of a layer the model windows ``min(tokens, window - 1)`` (transformers' sliding layer keeps one less than its
    window: the next query brings its own key)."""
    windows = budget.head_windows()
    keys = 0
    for layer, window in enumerate(budget.windows):
        if window:
            keys += budget.full.shape[1] * min(tokens, window - 1)
            continue
        for head in range(budget.full.shape[1]):
            keys += tokens if budget.full[layer, head] else min(tokens, budget.sink + int(windows[layer, head]))
    return keys * key_bytes(head_dim, dtype, batch)


def full_budget(layout: KVLayout, sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW) -> KVBudget:
    """Every global KV head full: full attention, as a budget."""
    return budget_of(layout, layout.candidates, sink, window)


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
    candidates = layout.candidates
    n_full = _n_full(layout, len(candidates), share, bytes, tokens, sink, window, dtype)
    ranked = sorted(candidates, key=lambda lh: (-np.nan_to_num(values[lh], nan=-np.inf), lh))
    return budget_of(layout, ranked[:n_full], sink, window)


def random_budget(layout: KVLayout, *, share: float | None = None, bytes: int | None = None, tokens: int | None = None,
                  seed: int = 0, sink: int = DEFAULT_SINK, window: int = DEFAULT_WINDOW,
                  dtype: torch.dtype = torch.float32) -> KVBudget:
    """As many full heads as :func:`choose_budget` would choose, drawn at random (``seed``) among the global layers'."""
    candidates = layout.candidates
    n_full = _n_full(layout, len(candidates), share, bytes, tokens, sink, window, dtype)
    drawn = np.random.default_rng(seed).permutation(len(candidates))[:n_full]
    return budget_of(layout, [candidates[i] for i in drawn], sink, window)


def budget_of(layout: KVLayout, full_heads: Sequence[tuple[int, int]], sink: int, window: int) -> KVBudget:
    full = np.zeros((layout.n_layers, layout.n_kv_heads), dtype=bool)
    for layer, head in full_heads:
        full[layer, head] = True
    return KVBudget(full, sink, window, layout.windows)


def share_count(share: float, n_candidates: int) -> int:
    """How many of ``n_candidates`` heads a share (0-1) of full heads makes full (halves round up)."""
    return math.floor(share * n_candidates + 0.5)


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
        return share_count(share, n_candidates)
    assert bytes is not None
    if tokens is None or tokens < 1:
        raise AttnscopeError("a KV budget in bytes needs the text's length in tokens")
    streaming = kv_bytes(budget_of(layout, [], sink, window), tokens, layout.head_dim, dtype)
    if bytes < streaming:
        raise AttnscopeError(f"a KV budget of {bytes:,} bytes is below what sink + window of every head cost for "
                             f"{tokens} tokens: {streaming:,} bytes")
    per_head = key_bytes(layout.head_dim, dtype) * (tokens - min(tokens, sink + window))  # one head made full
    return n_candidates if per_head == 0 else min(n_candidates, (bytes - streaming) // per_head)


def kv_head_scores(source: Any, name: str = DEFAULT_SCORE, *, layout: KVLayout | None = None,
                   reduce: str = "max") -> np.ndarray:
    """Scores ``[layer, kv_head]`` of score ``name`` from ``source``: an array ``[layer, kv_head]`` (as it is), a
    ``HeadScores``, a dict ``{name: [layer, head]}`` of query-head scores, or the Parquet file ``attnscope
    head-functions --save`` writes (or its frame): per query head, or per KV group (its ``<name>_max`` column). A
    group's score is ``reduce`` ("max" or "min") over its query heads, NaN only where all are; a per-group file holds
    only the max. A ``streaming_window_k*`` score (the smallest window that keeps enough; NaN: none does) ranks NaN
    first: such a head needs every key. ``layout``: the model's (needed to group a dict or a per-head file without
    ``kv_head``); scores of another shape are refused as another model's."""
    if isinstance(source, np.ndarray | torch.Tensor | list):
        values = np.asarray(source, dtype=float)
    elif isinstance(source, str | Path):
        values = _scores_from_frame(read_scores(source), name, layout, reduce)
    elif _is_frame(source):
        values = _scores_from_frame(source, name, layout, reduce)
    else:
        values = _scores_of_groups(source, name, layout, reduce)
    if layout is not None and values.shape != (layout.n_layers, layout.n_kv_heads):
        raise AttnscopeError(f"score {name!r} is {values.shape} layers x KV heads; the model has ({layout.n_layers}, "
                             f"{layout.n_kv_heads}): these scores come from another model")
    return values


def has_score(source: Any, name: str, reduce: str = "max") -> bool:
    """Whether ``source`` (as :func:`kv_head_scores` takes it, an array aside) holds score ``name`` for ``reduce``."""
    if _is_frame(source):
        return name in source.columns if "head" in source.columns else f"{name}_{reduce}" in source.columns
    return name in getattr(source, "scores", source)


def read_scores(path: str | Path) -> Any:
    """The frame of a head-scores Parquet file; a missing or unreadable file refused in one line."""
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise AttnscopeError(f"no scores file {path}")
    try:
        frame = pd.read_parquet(path)
    except Exception as error:  # noqa: BLE001 - any unreadable file is the user's input
        raise AttnscopeError(f"{path} is not a head-scores Parquet file ({type(error).__name__})") from None
    if "layer" not in frame.columns or not {"head", "kv_head"} & set(frame.columns):
        raise AttnscopeError(f"{path} has no layer and head columns: write it with 'attnscope head-functions --save "
                             "FILE.parquet'")
    return frame


def _is_frame(source: Any) -> bool:
    return hasattr(source, "columns") and hasattr(source, "groupby")


def _group(values: np.ndarray, n_kv_heads: int, reduce: str) -> np.ndarray:
    """``[layer, head]`` query-head scores -> ``[layer, kv_head]``: ``reduce`` over each group, NaN where all are."""
    grouped = values.reshape(values.shape[0], n_kv_heads, -1)  # a group's query heads are adjacent
    fill = -np.inf if reduce == "max" else np.inf
    best = {"max": np.max, "min": np.min}[reduce](np.nan_to_num(grouped, nan=fill), axis=-1)
    return np.where(np.isnan(grouped).all(-1), np.nan, best)


def _scores_of_groups(scores: Any, name: str, layout: KVLayout | None, reduce: str) -> np.ndarray:
    """``[layer, kv_head]`` from a ``HeadScores`` or a dict of query-head scores ``[layer, head]``."""
    found = getattr(scores, "scores", scores)
    if name not in found:
        raise AttnscopeError(f"no score {name!r} here; these were computed: {', '.join(found) or 'none'}")
    values = np.asarray(found[name], dtype=float)
    n_kv_heads = getattr(scores, "n_kv_heads", None) or (layout.n_kv_heads if layout is not None else None)
    if n_kv_heads is None:
        raise AttnscopeError("query-head scores need the model's layout to be grouped by KV head")
    if layout is not None and values.shape != (layout.n_layers, layout.n_kv_heads * layout.group):
        raise AttnscopeError(f"score {name!r} is {values.shape} layers x heads; the model has ({layout.n_layers}, "
                             f"{layout.n_kv_heads * layout.group}): these scores come from another model")
    return _nan_ranks(_group(values, n_kv_heads, reduce), name)


def _scores_from_frame(frame: Any, name: str, layout: KVLayout | None, reduce: str) -> np.ndarray:
    per_head = "head" in frame.columns
    column = name if per_head else f"{name}_{reduce}"
    if column not in frame.columns:
        known = sorted(c.removesuffix("_max") for c in frame.columns if c.endswith("_max") or c not in
                       ("layer", "head", "kv_head", "window", "note") and not c.endswith("_mean"))
        hint = "" if per_head or reduce == "max" else f" (a per-KV-group file holds each group's max, not its {reduce})"
        raise AttnscopeError(f"no score {name!r} in the scores file{hint}; it holds: {', '.join(known) or 'none'}")
    if per_head:
        values = _frame_array(frame, "head", column)
        if layout is not None and values.shape != (layout.n_layers, layout.n_kv_heads * layout.group):
            raise AttnscopeError(f"the scores file is {values.shape} layers x heads; the model has "
                                 f"({layout.n_layers}, {layout.n_kv_heads * layout.group}): these scores come from "
                                 "another model")
        n_kv_heads = layout.n_kv_heads if layout is not None else int(frame["kv_head"].max()) + 1
        return _nan_ranks(_group(values, n_kv_heads, reduce), name)
    return _nan_ranks(_frame_array(frame, "kv_head", column), name)


def _frame_array(frame: Any, head: str, column: str) -> np.ndarray:
    """Column ``column`` of ``frame`` as ``[layer, head]`` (by the frame's ``layer`` and ``head`` columns)."""
    values = np.full((int(frame["layer"].max()) + 1, int(frame[head].max()) + 1), np.nan)
    values[frame["layer"].to_numpy(int), frame[head].to_numpy(int)] = frame[column].to_numpy(float)
    return values


def _nan_ranks(values: np.ndarray, name: str) -> np.ndarray:
    """A ``streaming_window_k*`` score's NaN (no window keeps enough: the head needs every key) as the highest."""
    return np.nan_to_num(values, nan=np.inf) if name.startswith("streaming_window") else values


@dataclass(frozen=True, eq=False)
class StreamPart:
    """The streaming KV heads ``heads`` of one layer that keep the same ``window``: ``keys``/``values`` ``[batch,
    n_heads, kept, d_head]`` at key slots ``positions`` (long ``[kept]``, ascending)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    heads: tuple[int, ...]
    window: int


@dataclass(frozen=True, eq=False)
class BudgetedStates:
    """What a :class:`BudgetedCache` layer hands the attention function for one call, instead of keys and values.

    ``full_keys``/``full_values``: ``[batch, n_full, k_pos, d_head]``, every key of the full KV heads
    ``full_heads``; ``streams``: the streaming KV heads, one :class:`StreamPart` per window; ``n_keys``: the call's key
    axis (every position so far, the new ones included); ``sink``: the first keys every streaming head keeps.
    Any attention function but attnscope's fails on it in one line (it is no tensor)."""

    full_keys: torch.Tensor
    full_values: torch.Tensor
    full_heads: tuple[int, ...]
    streams: tuple[StreamPart, ...]
    n_keys: int
    sink: int

    @property
    def n_kv_heads(self) -> int:
        return len(self.full_heads) + sum(len(part.heads) for part in self.streams)

    def __getattr__(self, name: str) -> Any:  # only for names a dataclass field is not: a tensor's
        raise AttnscopeError(f"a budgeted KV cache works only with attnscope's attention function (load the model "
                             f"with attnscope.load_model); another one asked its states for {name!r}")

    def stream_mask(self, part: StreamPart, q_len: int) -> torch.Tensor:
        """Bool ``[q_pos, kept]``: the kept keys of ``part`` each of the call's last ``q_len`` queries sees (its sink
        keys and its ``window`` most recent, itself included; the model's own mask is applied besides)."""
        return self.sink_window(q_len, part.positions, part.window)

    def sink_window(self, q_len: int, keys: torch.Tensor, window: int) -> torch.Tensor:
        """Bool ``[q_pos, key]``: whether key slot ``keys[j]`` is one of query ``i``'s first ``sink`` keys or its
        ``window`` most recent (the queries: the call's last ``q_len`` slots)."""
        queries = torch.arange(self.n_keys - q_len, self.n_keys, device=keys.device)[:, None]
        keys = keys[None, :]
        return (keys < self.sink) | ((keys <= queries) & (keys > queries - window))

    def dense_mask(self, seen: torch.Tensor, n_heads: int) -> torch.Tensor:
        """Bool ``[batch or 1, head, q_pos, k_pos]``: the keys each query head saw in this call over the whole key axis,
        ``seen`` (the model's mask, ``[batch or 1, 1, q_pos, k_pos]``) restricted to each query's sink and window for
        the query heads of streaming KV heads (for recorders that recompute attention from the call's inputs)."""
        q_len, group = seen.shape[-2], n_heads // self.n_kv_heads
        slots = torch.arange(self.n_keys, device=seen.device)
        kept = torch.ones((n_heads, q_len, self.n_keys), dtype=torch.bool, device=seen.device)
        for part in self.streams:
            heads = [h for kv in part.heads for h in range(kv * group, (kv + 1) * group)]
            kept[heads] = self.sink_window(q_len, slots, part.window)
        return seen & kept

    def dense(self, which: str) -> torch.Tensor:
        """``which`` ("keys" or "values") over the whole key axis, ``[batch, kv_head, k_pos, d_head]``: zeros where a
        streaming head evicted the key (for recorders, which read rows and values over every position)."""
        full = self.full_keys if which == "keys" else self.full_values
        out = full.new_zeros((full.shape[0], self.n_kv_heads, self.n_keys, full.shape[-1]))
        out[:, list(self.full_heads)] = full
        for part in self.streams:
            slots = out[:, list(part.heads)]
            slots[:, :, part.positions] = part.keys if which == "keys" else part.values
            out[:, list(part.heads)] = slots
        return out


def _make_budgeted_layer() -> type:
    """:class:`BudgetedLayer`, defined on first use so that importing this module does not import transformers."""
    from transformers.cache_utils import DynamicLayer

    from .growing_cache import MIN_ROOM, appended

    class BudgetedLayer(DynamicLayer):  # type: ignore[misc, valid-type]
        """One global layer's cache under a budget: full KV heads keep every key, streaming ones the first ``sink``
        and their ``window`` most recent (heads of one window stored together); ``update`` returns
        :class:`BudgetedStates` as both keys and values. ``parts``: full keys, full values, then keys and values of
        each window's streaming heads; ``positions``: each window's kept key slots. The full heads' keys and values
        are views of ``full_buffers``, written in place with up to ``MIN_ROOM`` positions of room (a step copies no
        full head's cache, as ``torch.cat`` would; the room is not counted in :meth:`stored_bytes`)."""

        def __init__(self, full: Sequence[bool], windows: Sequence[int], sink: int) -> None:
            super().__init__()
            self.full_heads = tuple(i for i, flag in enumerate(full) if flag)
            by_window: dict[int, list[int]] = {}
            for head, (flag, window) in enumerate(zip(full, windows, strict=True)):
                if not flag:
                    by_window.setdefault(int(window), []).append(head)
            self.groups = tuple((tuple(heads), window) for window, heads in sorted(by_window.items()))
            self.sink, self.seen = sink, 0
            self.parts: list[torch.Tensor] = []
            self.positions: list[torch.Tensor] = []
            self.full_buffers: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)

        @property
        def part_heads(self) -> list[tuple[int, ...]]:
            """The KV heads of each of ``parts``."""
            return [self.full_heads, self.full_heads, *[heads for heads, _ in self.groups for _ in "kv"]]

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            n_heads = len(self.full_heads) + sum(len(heads) for heads, _ in self.groups)
            if key_states.shape[1] != n_heads:
                raise AttnscopeError(f"the KV budget has {n_heads} KV heads per layer, the model's layer "
                                     f"{key_states.shape[1]}")
            self.device = key_states.device
            batch, _, _, d_head = key_states.shape
            self.parts = [key_states.new_zeros((batch, len(heads), 0, d_head)) for heads in self.part_heads]
            self.positions = [torch.zeros(0, dtype=torch.long, device=self.device) for _ in self.groups]
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[Any, Any]:  # BudgetedStates twice, in the tensors' places
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            new = torch.arange(self.seen, self.seen + key_states.shape[2], device=self.device)
            grown = [appended(buffer, held, states[:, list(self.full_heads)], self.seen, MIN_ROOM)
                     for buffer, held, states in zip(self.full_buffers, self.parts, (key_states, value_states))]
            self.full_buffers = (grown[0][0], grown[1][0])
            parts = [grown[0][1], grown[1][1]]
            parts += [torch.cat([held, (key_states, value_states)[index % 2][:, list(heads)]], dim=2)
                      for index, (held, heads) in enumerate(zip(self.parts[2:], self.part_heads[2:], strict=True))]
            positions = [torch.cat([held, new]) for held in self.positions]
            self.seen += len(new)
            streams = tuple(StreamPart(parts[2 + 2 * index], parts[3 + 2 * index], positions[index], heads, window)
                            for index, (heads, window) in enumerate(self.groups))
            states = BudgetedStates(parts[0], parts[1], self.full_heads, streams, n_keys=self.seen, sink=self.sink)
            self.parts, self.positions = parts[:2], []
            for part in streams:  # keep what the last query saw
                kept = (part.positions < self.sink) | (part.positions >= self.seen - part.window)
                self.parts += [part.keys[:, :, kept].contiguous(), part.values[:, :, kept].contiguous()]
                self.positions.append(part.positions[kept])
            return states, states

        def get_seq_length(self) -> int:
            return self.seen

        def stored_bytes(self) -> int:
            return sum(part.numel() * part.element_size() for part in self.parts)

        def reset(self) -> None:
            self.parts, self.positions, self.seen, self.is_initialized = [], [], 0, False
            self.full_buffers = (None, None)

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
            windows = budget.head_windows()
            layers = [layer_class(budget.layer_heads(index), windows[index], budget.sink)
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
