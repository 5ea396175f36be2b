"""Head functions: what each head is for, as registered scores over what capture records.

A :class:`HeadFunction` is a name, a label, the definition it follows (``reference``) and its paper
(``cited``), the ``task`` whose evidence it needs (``repeated_tokens``, ``document``, ``sentences``; a
needle task registers its own) and a ``compute`` that turns that evidence into columns of ``[layer, head]``
scores. The registry is name-keyed and listable (:func:`head_functions`, :func:`get_head_function`), as the
mixing measures and pattern classes are. Layers and heads are 0-indexed. The runner that builds the tasks
and runs the model is :func:`attnscope.experiments.head_functions.head_scores`; everything here takes
arrays or records, never a model.

**Repeated random tokens** (:class:`RepeatedLayout`): ``prefix`` tokens (the tokenizer's BOS, if it has one),
then ``period`` random tokens repeated ``repeats`` times. A query ``q`` in a later copy has its earlier
copies at ``q - r * period`` (``r >= 1``). Over the queries of every copy after the first:

* ``induction``: attention on ``q - period + 1``, the token after the query's previous copy: Olsson et
  al. 2022's prefix-matching score as TransformerLens / ARENA compute it (the mean of the pattern's offset
  diagonal ``k = q - period + 1``), restricted to the later copies' queries;
* ``duplicate_token``: attention on ``q - period``, the previous copy of the query's own token (Wang et
  al. 2022's duplicate-token heads);
* ``echo``: attention summed over *every* earlier copy of the query's token, ``q - r * period`` for
  ``r >= 1`` (RazorAttention, Tang et al. 2024: echo heads attend to previous tokens identical to the
  current one; their code scores a head by the mean of its pattern times this mask over the whole
  ``T x T`` matrix, which is this score times ``n_queries / T**2``: the same ranking). With two copies it
  equals ``duplicate_token``; with more it sums all of them.

and over every query ``q >= 1``:

* ``previous_token``: attention on ``q - 1`` (the mean of the pattern's first sub-diagonal, as
  TransformerLens's previous-token detector).

**Locality** (streaming heads, StreamingLLM / DuoAttention): per ``(sink, window)`` pair ``(k, w)``, the mean
over queries of the attention a cache of the first ``k`` keys plus the ``w`` most recent (the query's own
included) keeps, computed by planned capture (``CapturePlan(locality=...)``) on long documents; a learned
sink (gpt-oss) is no key and is never evicted, so its mass counts as kept. ``streaming_window_k{k}`` is the
smallest ``w`` of the grid that keeps at least ``share`` (NaN: none does). A sliding-window layer keeps
everything once ``w`` reaches its window: its ``window`` column says so, so it is not taken for a streaming
head of a global layer.

**Receiver heads** (Bogdan et al. 2025): the kurtosis of each head's vertical scores over sentences
(:mod:`attnscope.analysis.sentences`, which computes it; registered here, not rewritten).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import AttnscopeError
from ..records.format import LOCALITY

if TYPE_CHECKING:
    import pandas as pd

    from ..records.attention import AttentionRecord, ModelInfo
    from .sentences import SentenceAttention

Columns = dict[str, np.ndarray]  # column name -> float [layer, head]


@dataclass(frozen=True)
class HeadFunction:
    """One head-function score (module docstring): ``compute(evidence)`` -> ``{column: [layer, head]}``, where
    ``evidence`` is what the runner's ``task`` builds (:class:`RepeatedEvidence`, :class:`LocalityEvidence`,
    a :class:`~attnscope.analysis.sentences.SentenceAttention`)."""

    name: str
    label: str
    task: str
    reference: str
    cited: str
    compute: Callable[[Any], Columns]


_HEAD_FUNCTIONS: dict[str, HeadFunction] = {}


def register_head_function(function: HeadFunction) -> HeadFunction:
    """Add ``function`` to the registry (its name must be new); returns it."""
    if function.name in _HEAD_FUNCTIONS:
        raise AttnscopeError(f"a head function is already registered as {function.name}")
    _HEAD_FUNCTIONS[function.name] = function
    return function


def unregister_head_function(name: str) -> HeadFunction:
    """Remove ``name`` from the registry (tests add and remove their own); returns it."""
    return _HEAD_FUNCTIONS.pop(name)


def head_functions() -> list[HeadFunction]:
    """Every registered head function, in the order registered."""
    return list(_HEAD_FUNCTIONS.values())


def get_head_function(name: str) -> HeadFunction:
    """The head function ``name``, or one line naming the known ones."""
    if name not in _HEAD_FUNCTIONS:
        raise AttnscopeError(f"unknown head score {name!r}; choose from {', '.join(_HEAD_FUNCTIONS)}")
    return _HEAD_FUNCTIONS[name]


# ---- repeated random tokens ------------------------------------------------------------------------
@dataclass(frozen=True)
class RepeatedLayout:
    """``prefix`` tokens, then one block of ``period`` tokens repeated ``repeats`` times (module docstring)."""

    prefix: int
    period: int
    repeats: int

    @property
    def length(self) -> int:
        return self.prefix + self.period * self.repeats

    def later_queries(self) -> np.ndarray:
        """int64 ``[n]``: the positions of every copy after the first."""
        return np.arange(self.prefix + self.period, self.length)

    def copies(self) -> list[int]:
        """The offsets ``r * period`` (``r >= 1``) of a later query's earlier copies, each at least ``prefix``
        back in range for the queries of the last copy (a nearer copy's query sees fewer: masked below)."""
        return [r * self.period for r in range(1, self.repeats)]


@dataclass(frozen=True)
class RepeatedEvidence:
    """Attention of repeated random-token sequences: ``attention`` float ``[sequence, layer, head, q_pos, k_pos]``
    (whole records; the sequences are short) laid out as ``layout``."""

    attention: np.ndarray
    layout: RepeatedLayout


def diagonal_mean(attention: np.ndarray, queries: np.ndarray, offset: int) -> np.ndarray:
    """``attention`` ``[..., q_pos, k_pos]`` -> ``[...]``: the mean of ``A[q, q - offset]`` over ``queries``."""
    return attention[..., queries, queries - offset].mean(-1)


def induction_scores(evidence: RepeatedEvidence) -> Columns:
    layout = evidence.layout
    per_sequence = diagonal_mean(evidence.attention, layout.later_queries(), layout.period - 1)
    return {"induction": per_sequence.mean(0)}


def duplicate_token_scores(evidence: RepeatedEvidence) -> Columns:
    layout = evidence.layout
    return {"duplicate_token": diagonal_mean(evidence.attention, layout.later_queries(), layout.period).mean(0)}


def echo_scores(evidence: RepeatedEvidence) -> Columns:
    layout = evidence.layout
    queries = layout.later_queries()
    total = np.zeros(evidence.attention.shape[:-2])
    for offset in layout.copies():  # every earlier copy of the query's token: q - offset >= prefix
        earlier = queries - offset >= layout.prefix
        cells = evidence.attention[..., queries[earlier], queries[earlier] - offset]  # [..., n_earlier]
        total = total + cells.sum(-1)
    return {"echo": (total / len(queries)).mean(0)}


def previous_token_scores(evidence: RepeatedEvidence) -> Columns:
    queries = np.arange(1, evidence.layout.length)
    return {"previous_token": diagonal_mean(evidence.attention, queries, 1).mean(0)}


# ---- locality --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LocalityEvidence:
    """Planned records of long documents, each holding ``<kind>.locality`` ``[layer, head, pair]`` for the
    ``pairs`` ``((sink, window), ...)``; ``share``: what :func:`smallest_windows` must keep."""

    records: Sequence[AttentionRecord]
    pairs: tuple[tuple[int, int], ...]
    share: float


def locality_grid(evidence: LocalityEvidence) -> np.ndarray:
    """float ``[layer, head, pair]``: the kept share per pair, averaged over the documents (each document's
    own mean over its queries)."""
    grids = []
    for record in evidence.records:
        found = record.get(record.model.main_kind, LOCALITY)
        if found is None:
            raise AttnscopeError(f"this record holds no locality ({record.holdings()}); capture it with "
                                 "CapturePlan(locality=...)")
        grids.append(np.asarray(found, dtype=np.float64))
    return np.mean(grids, axis=0)


def smallest_windows(grid: np.ndarray, pairs: Sequence[tuple[int, int]], sink: int, share: float) -> np.ndarray:
    """float ``[layer, head]``: the smallest window ``w`` of the pairs with ``sink`` whose kept share is at least
    ``share`` (NaN where none is)."""
    windows = sorted(w for k, w in pairs if k == sink)
    found = np.full(grid.shape[:2], np.nan)
    for window in reversed(windows):  # the smallest that holds is written last
        column = grid[..., list(pairs).index((sink, window))]
        found = np.where(column >= share, float(window), found)
    return found


def locality_scores(evidence: LocalityEvidence) -> Columns:
    grid = locality_grid(evidence)
    columns = {f"locality_k{k}_w{w}": grid[..., i] for i, (k, w) in enumerate(evidence.pairs)}
    for sink in dict.fromkeys(k for k, _ in evidence.pairs):
        columns[f"streaming_window_k{sink}"] = smallest_windows(grid, evidence.pairs, sink, evidence.share)
    return columns


def receiver_scores(evidence: Sequence[SentenceAttention]) -> Columns:
    """The mean over documents of each head's receiver kurtosis (NaN where no document gives one)."""
    kurtosis = np.stack([found.receiver_heads().kurtosis for found in evidence])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN heads stay NaN
        return {"receiver": np.nanmean(kurtosis, axis=0)}


for _function in (
    HeadFunction("induction", "Induction", "repeated_tokens", "attention on the token after the query's previous "
                 "copy (the offset diagonal k = q - period + 1), later copies' queries", "Olsson et al. 2022",
                 induction_scores),
    HeadFunction("previous_token", "Previous token", "repeated_tokens", "attention on q - 1, every query q >= 1",
                 "TransformerLens", previous_token_scores),
    HeadFunction("duplicate_token", "Duplicate token", "repeated_tokens", "attention on the query token's previous "
                 "copy (k = q - period), later copies' queries", "Wang et al. 2022", duplicate_token_scores),
    HeadFunction("echo", "Echo", "repeated_tokens", "attention summed over every earlier copy of the query's "
                 "token, later copies' queries", "Tang et al. 2024 (RazorAttention)", echo_scores),
    HeadFunction("locality", "Locality", "document", "share of each query's attention inside the first k + the "
                 "most recent w keys (learned sinks kept), per (k, w); the smallest w keeping a share",
                 "Xiao et al. 2024 (StreamingLLM, DuoAttention)", locality_scores),
    HeadFunction("receiver", "Receiver", "sentences", "kurtosis of the head's vertical scores over sentences",
                 "Bogdan et al. 2025", receiver_scores),
):
    register_head_function(_function)


# ---- the result ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadScores:
    """Head-function scores of one model: ``scores`` column -> float ``[layer, head]`` (0-indexed), with the
    model's facts that qualify them: ``n_kv_heads`` (a cache is kept per KV head, so scores are also given per
    KV group), ``windows`` (per layer, 0 = global) and ``learned_sinks``; ``settings``: the tasks' settings."""

    model: str
    scores: Columns
    n_kv_heads: int
    windows: tuple[int, ...] = ()
    learned_sinks: bool = False
    settings: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, info: ModelInfo, scores: Columns, settings: dict[str, Any]) -> HeadScores:
        return cls(info.name, scores, info.n_kv_heads, tuple(info.windows), info.learned_sinks, settings)

    @property
    def shape(self) -> tuple[int, int]:
        """``(layers, heads)``."""
        first = next(iter(self.scores.values()))
        return int(first.shape[0]), int(first.shape[1])

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    def note(self, layer: int) -> str:
        """What qualifies layer ``layer``'s scores: its sliding window, learned sinks."""
        parts = []
        if self.window(layer):
            parts.append(f"sliding window of {self.window(layer)} keys: no key beyond it is seen, and locality "
                         f"with w >= {self.window(layer)} is 1 by construction")
        if self.learned_sinks:
            parts.append("learned sinks: rows sum below 1 (the sink is no key, kept by any cache)")
        return "; ".join(parts)

    def ranked(self, name: str, k: int | None = None) -> list[tuple[int, int, float]]:
        """``[(layer, head, score), ...]`` for column ``name``, largest first (NaN last), the first ``k``."""
        if name not in self.scores:
            raise AttnscopeError(f"no score {name!r} here; these were computed: {', '.join(self.scores)}")
        values = self.scores[name]
        if k is not None and not 1 <= k <= values.size:
            raise AttnscopeError(f"k must be between 1 and the model's {values.size} heads, got {k}")
        order = np.argsort(-np.nan_to_num(values, nan=-np.inf).ravel(), kind="stable")[:k]
        n_heads = values.shape[1]
        return [(int(i // n_heads), int(i % n_heads), float(values.ravel()[i])) for i in order]

    def to_frame(self, per: str = "head") -> pd.DataFrame:
        """``per="head"``: one row per (layer, head) with its KV head, the layer's ``window`` and ``note`` and
        every score; ``per="kv_head"``: one row per (layer, KV head) with ``<score>_max`` and ``<score>_mean``
        over the group's query heads."""
        import pandas as pd

        n_layers, n_heads = self.shape
        group = n_heads // self.n_kv_heads
        layer, head = np.meshgrid(np.arange(n_layers), np.arange(n_heads), indexing="ij")
        facts: dict[str, np.ndarray] = {"window": np.array([self.window(i) for i in range(n_layers)]),
                                        "note": np.array([self.note(i) for i in range(n_layers)], dtype=object)}
        if per == "head":
            frame = {"layer": layer.ravel(), "head": head.ravel(), "kv_head": head.ravel() // group,
                     **{name: np.repeat(values, n_heads) for name, values in facts.items()},
                     **{name: values.ravel() for name, values in self.scores.items()}}
            return pd.DataFrame(frame)
        if per != "kv_head":
            raise AttnscopeError(f"per must be 'head' or 'kv_head', got {per!r}")
        frame = {"layer": np.repeat(np.arange(n_layers), self.n_kv_heads),
                 "kv_head": np.tile(np.arange(self.n_kv_heads), n_layers),
                 **{name: np.repeat(values, self.n_kv_heads) for name, values in facts.items()}}
        for name, values in self.scores.items():
            grouped = values.reshape(n_layers, self.n_kv_heads, group)  # query heads of a KV head are adjacent
            frame[f"{name}_max"], frame[f"{name}_mean"] = grouped.max(-1).ravel(), grouped.mean(-1).ravel()
        return pd.DataFrame(frame)

    def save(self, path: str | Path, per: str = "head") -> Path:
        """Write :meth:`to_frame` (``per`` as there) to a Parquet file; returns its path."""
        from ..files import written

        frame = self.to_frame(per)
        path = Path(path)
        with written(path) as target:
            frame.to_parquet(target, index=False)
        return path

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the model's facts, the settings, and :meth:`to_frame`'s rows per head (``heads``) and per KV
        group (``kv_heads``), NaN as None."""
        return {"model": self.model, "shape": list(self.shape), "n_kv_heads": self.n_kv_heads,
                "windows": list(self.windows), "learned_sinks": self.learned_sinks, "settings": self.settings,
                "columns": list(self.scores), "heads": frame_rows(self.to_frame("head")),
                "kv_heads": frame_rows(self.to_frame("kv_head"))}

    def _repr_html_(self) -> str:
        return self.to_frame().to_html(max_rows=20)


def frame_rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """``frame``'s rows as dicts of plain Python values (NaN as None), ready for JSON."""
    columns = {name: [None if isinstance(v, float) and math.isnan(v) else v for v in frame[name].tolist()]
               for name in frame.columns}  # tolist gives Python numbers
    return [dict(zip(columns, values)) for values in zip(*columns.values())]
