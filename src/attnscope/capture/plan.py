"""What a capture keeps: the capture plan.

A full capture keeps ``[layer, head, q_pos, k_pos]`` for everything, so its cost grows with the
square of the input's length. A :class:`CapturePlan` says what to keep instead:

* a selection of layers, heads and query positions (``QuerySelection``: the last token, every
  k-th token, a span, a list); only the selected rows are ever materialised as ``[q, k]`` arrays;
* ``attention``: keep the selected rows of the attention matrix (False: keep none of it);
* ``statistics``: per selected row, the figures analysis needs (mass on the first token / sink,
  on special tokens, on the previous / next / own position, entropy, mean distance, largest
  weight) and a histogram of attention distance per head;
* ``top_k``: per selected row, the ``k`` strongest keys with their weights;
* ``overview``: the whole matrix averaged over blocks of this many tokens (a picture of it at
  ``T / block`` resolution, for the long views);
* ``chunk``: queries are processed this many at a time, so a layer's scores never exceed
  ``[batch, head, chunk, k_pos]``;
* ``sentences``: token spans ``[(start, stop), ...]`` (0-indexed, sorted, disjoint) of ONE input: the
  matrix averaged to sentence x sentence as it goes (each block's mean over its query and key tokens,
  :mod:`attnscope.analysis.sentences`), ``[layer, head, S, S]`` whatever the input's length;
* ``locality``: ``(sink, window)`` pairs ``(k, w)``: per head, the mean over the selected rows of the
  attention a first-``k`` + most-recent-``w`` key cache keeps (StreamingLLM's and DuoAttention's
  streaming heads; :mod:`attnscope.capture.rows`), ``[layer, head, pair]`` whatever the input's length.

Layers and heads are 0-indexed. The plan is passed into the one attention function
(:mod:`attnscope.capture.attention`); without a plan, capture keeps everything as before.

>>> plan = CapturePlan(layers=(0, 5), queries=QuerySelection.parse("last"), statistics=True, top_k=32)
>>> plan.wants_layer(5), plan.wants_layer(1)
(True, False)
>>> QuerySelection.parse("every:4").positions(10).tolist()
[0, 4, 8]
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..errors import AttnscopeError

if TYPE_CHECKING:
    from ..models.loading import LoadedModel

DEFAULT_CHUNK = 256
QUERY_SPECS = "all | last | last:N | every:K | span:A:B | 3,17,42"


@dataclass(frozen=True)
class QuerySelection:
    """Which query positions to keep, resolved against an input's length with :meth:`positions`.

    ``kind`` is one of ``all``, ``last`` (the last ``n`` positions), ``every`` (every ``n``-th
    position from 0), ``span`` (positions ``start`` to ``stop - 1``; negative counts from the end)
    or ``list`` (the given positions; negative counts from the end).
    """

    kind: str = "all"
    n: int = 1
    start: int = 0
    stop: int | None = None
    given: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str) -> QuerySelection:
        """``all``, ``last``, ``last:N``, ``every:K``, ``span:A:B`` or a comma-separated list of positions."""
        text = text.strip()
        head, _, rest = text.partition(":")
        try:
            if text == "all":
                return cls()
            if head == "last":
                return cls("last", n=_positive(int(rest) if rest else 1, "last:N"))
            if head == "every":
                return cls("every", n=_positive(int(rest), "every:K"))
            if head == "span":
                start, _, stop = rest.partition(":")
                return cls("span", start=int(start or 0), stop=int(stop) if stop else None)
            given = tuple(int(part) for part in text.split(",") if part.strip())
        except ValueError:
            raise AttnscopeError(f"query positions {text!r}: expected {QUERY_SPECS}") from None
        if not given:
            raise AttnscopeError(f"query positions {text!r}: expected {QUERY_SPECS}")
        return cls("list", given=given)

    @property
    def is_all(self) -> bool:
        return self.kind == "all"

    def positions(self, length: int) -> np.ndarray:
        """The selected positions of an input of ``length`` tokens, sorted and unique: int64 ``[n_q]``."""
        every = np.arange(length)
        if self.kind == "all":
            chosen = every
        elif self.kind == "last":
            chosen = every[-self.n:]
        elif self.kind == "every":
            chosen = every[:: self.n]
        elif self.kind == "span":
            chosen = every[self.start : self.stop]
        else:
            out_of_range = [p for p in self.given if not -length <= p < length]
            if out_of_range:
                raise AttnscopeError(f"query position {out_of_range[0]} is outside the input's {length} tokens")
            chosen = np.unique(np.array(self.given, dtype=np.int64) % length)
        if chosen.size == 0:
            raise AttnscopeError(f"the query selection {self.describe()} holds no position of a {length}-token input")
        return chosen.astype(np.int64)

    def describe(self) -> str:
        if self.kind in ("all",):
            return "all"
        if self.kind in ("last", "every"):
            return f"{self.kind}:{self.n}"
        if self.kind == "span":
            return f"span:{self.start}:{'' if self.stop is None else self.stop}"
        return ",".join(str(p) for p in self.given)


def _positive(value: int, what: str) -> int:
    if value < 1:
        raise AttnscopeError(f"{what} must be at least 1, got {value}")
    return value


@dataclass(frozen=True)
class CapturePlan:
    """What a capture keeps (see the module docstring). The default keeps everything."""

    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    queries: QuerySelection = field(default_factory=QuerySelection)
    attention: bool = True
    statistics: bool = False
    top_k: int = 0
    overview: int = 0
    chunk: int = DEFAULT_CHUNK
    sentences: tuple[tuple[int, int], ...] = ()
    locality: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.top_k < 0 or self.overview < 0 or self.chunk < 1:
            raise AttnscopeError("top-k and overview must be >= 0 and the query chunk >= 1")
        if not (self.attention or self.statistics or self.top_k or self.overview or self.sentences or self.locality):
            raise AttnscopeError("the capture plan keeps nothing: ask for attention, statistics, top-k, an overview, "
                                 "sentences or locality")
        _check_spans(self.sentences)
        _check_locality(self.locality)
        for name in ("layers", "heads"):
            chosen = getattr(self, name)
            if chosen is not None and (not chosen or min(chosen) < 0):
                raise AttnscopeError(f"{name} must be a non-empty list of 0-indexed numbers")

    @property
    def keeps_everything(self) -> bool:
        """True for the plan that equals a plain full capture (nothing selected, nothing extra)."""
        return (self.layers is None and self.heads is None and self.queries.is_all and self.attention
                and not (self.statistics or self.top_k or self.overview or self.sentences or self.locality))

    def wants_layer(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def check_against(self, n_layers: int | None = None, n_heads: int | None = None) -> None:
        """Refuse layers or heads the model does not have, with one clear line (None: not checked)."""
        from ..arguments import check_indices

        for name, chosen, limit in (("layer", self.layers, n_layers), ("head", self.heads, n_heads)):
            if limit is not None:
                check_indices(chosen, limit, name)

    def top_k_slots(self, n_keys: int) -> int:
        """The top-k keys kept per row of an input of ``n_keys`` keys: ``top_k``, never more than there are keys
        (``--top-k 50000`` on five tokens keeps five)."""
        return min(self.top_k, n_keys)

    def layer_numbers(self, n_layers: int) -> tuple[int, ...]:
        return tuple(range(n_layers)) if self.layers is None else tuple(sorted(set(self.layers)))

    def head_numbers(self, n_heads: int) -> tuple[int, ...]:
        return tuple(range(n_heads)) if self.heads is None else tuple(sorted(set(self.heads)))

    def describe(self) -> dict[str, object]:
        """A JSON-ready summary (stored in records)."""
        return {"layers": None if self.layers is None else list(self.layers),
                "heads": None if self.heads is None else list(self.heads),
                "queries": self.queries.describe(), "attention": self.attention, "statistics": self.statistics,
                "top_k": self.top_k, "overview": self.overview,
                **({"sentences": [list(span) for span in self.sentences]} if self.sentences else {}),
                **({"locality": [list(pair) for pair in self.locality]} if self.locality else {})}

    def check_sentences(self, n_tokens: int) -> None:
        """Refuse sentence spans beyond an input of ``n_tokens`` tokens (one line)."""
        if self.sentences and self.sentences[-1][1] > n_tokens:
            raise AttnscopeError(f"sentence span {self.sentences[-1]} is beyond the input's {n_tokens} tokens")


def _check_spans(spans: tuple[tuple[int, int], ...]) -> None:
    """Spans must be sorted, disjoint and non-empty: ``0 <= start < stop <= next start``."""
    previous = 0
    for start, stop in spans:
        if not previous <= start < stop:
            raise AttnscopeError(f"sentence spans must be sorted, disjoint and non-empty; ({start}, {stop}) is not")
        previous = stop


def _check_locality(pairs: tuple[tuple[int, int], ...]) -> None:
    """Each ``(sink, window)`` pair keeps at least the query's own key (``window >= 1``) and no negative sink."""
    for sink, window in pairs:
        if sink < 0 or window < 1:
            raise AttnscopeError(f"locality (sink, window) pairs need sink >= 0 and window >= 1; ({sink}, {window}) "
                                 "is not")


FULL_PLAN = CapturePlan()


# ---- the long view's plan: what a view of a long input needs, never the whole matrix -------------
LONG_VIEW_TOKENS = 512  # longer inputs get the long view: the line views are unreadable past this


def long_view_plan(loaded: LoadedModel, text: str, pair: str | None, max_tokens: int | None,
                   *, force: bool = False, top_k: int = 32, overview_cells: int = 256,
                   layers: tuple[int, ...] | None = None, heads: tuple[int, ...] | None = None
                   ) -> CapturePlan | None:
    """The capture plan of the long view (top-k keys of every query and an overview of about
    ``overview_cells`` blocks a side, for ``layers`` and ``heads``: all by default), or None when
    the input is short enough for the line views and no selection asks for the long view."""
    limit = min(max_tokens or loaded.max_length, loaded.max_length)
    tokens = min(len(loaded.tokenizer(text, pair)["input_ids"]), limit)
    wanted = force or layers is not None or heads is not None
    if not wanted and (tokens <= LONG_VIEW_TOKENS or loaded.is_encoder_decoder):
        return None
    return CapturePlan(layers=layers, heads=heads, attention=False, top_k=top_k,
                       overview=max(1, -(-tokens // overview_cells)))


# ---- memory: estimate before running, refuse before exhausting ---------------------------------
@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a capture is expected to need at its peak, split by what they are for."""

    kept: int  # the arrays the records keep (all layers, for the batch)
    working: int  # one layer's scores and probabilities at a time, plus the mask

    @property
    def total(self) -> int:
        return self.kept + self.working


def estimate_capture_memory(plan: CapturePlan | None, *, n_layers: int, n_heads: int, length: int, batch: int = 1,
                            qkv: bool = False, norms: bool = False, d_head: int = 64,
                            streamed: bool = False) -> MemoryEstimate:
    """What capturing ``batch`` inputs of ``length`` tokens keeps and needs while running, in bytes.

    A rough upper bound from the shapes alone (float32 everywhere, as capture computes): the
    model's own weights and activations are not included. ``streamed``: attention rows, norms and
    top-k keys go to a file as they are computed, so memory keeps none of them (but picks each chunk's top k).
    """
    plan = plan or FULL_PLAN
    layers = len(plan.layer_numbers(n_layers))
    heads = len(plan.head_numbers(n_heads))
    rows = min(length, _selected_rows(plan.queries, length))
    slots = plan.top_k_slots(length)
    per_row = 32 if plan.statistics else 0
    if not streamed:
        per_row += slots * 8 + (length * (4 + (4 if norms else 0)) if plan.attention else 0)
    # x2: the per-layer captures are stacked into one array, then cut per input (a copy each time)
    kept = 2 * batch * layers * heads * rows * per_row
    if qkv:
        kept += batch * layers * n_heads * length * d_head * 4 * 3
    if plan.overview:
        kept += batch * layers * heads * math.ceil(length / plan.overview) ** 2 * 4
    if plan.sentences:  # block sums, one extra row and column for tokens in no sentence
        kept += batch * layers * heads * (len(plan.sentences) + 1) ** 2 * 4
    kept += batch * layers * heads * len(plan.locality) * 4
    chunked = not plan.keeps_everything
    query_rows = min(length, plan.chunk) if chunked else length
    # scores, probabilities and one temporary of the same size for one layer's chunk; the additive
    # mask of a full capture is [batch, 1, q, k]
    working = 3 * batch * n_heads * query_rows * length * 4 + (0 if chunked else batch * length * length * 4)
    working += batch * heads * min(rows, query_rows) * slots * TOP_K_PICKING_BYTES
    return MemoryEstimate(kept=kept, working=working)


TOP_K_PICKING_BYTES = 4 + 3 * 8  # per slot of a chunk's rows: the weights, their int64 indices and two shifted copies


def _selected_rows(queries: QuerySelection, length: int) -> int:
    if queries.kind == "list":
        return len(set(queries.given))
    return len(queries.positions(length)) if length else 0


def available_memory() -> int | None:
    """Bytes the system can still give this process (``MemAvailable``), or None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if hasattr(os, "sysconf") and "SC_AVPHYS_PAGES" in os.sysconf_names:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return None


EXTRACT_ADVICE = ("keep less (attnscope extract with --stats, --top-k K, --layers, --heads or --queries last; "
                  "attnscope view --long) or shorten the input (--max-tokens)")


def check_memory(estimate: MemoryEstimate, *, what: str, headroom: float = 0.8,
                 available: int | None = None, advice: str = EXTRACT_ADVICE) -> None:
    """Refuse a capture whose estimate exceeds ``headroom`` of the available memory, saying by how
    much and which options reduce it (``available`` overrides the system's figure, for tests)."""
    available = available_memory() if available is None else available
    if available is None or estimate.total <= headroom * available:
        return
    raise AttnscopeError(
        f"{what} needs about {_gib(estimate.total)} of memory ({_gib(estimate.kept)} kept, {_gib(estimate.working)} "
        f"while computing) but {_gib(available)} is available; {advice}")


def _gib(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.1f} GiB"
