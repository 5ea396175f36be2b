"""The KV-budget curve: needle accuracy and next-token loss against the share of full KV heads (issue 49, item 3).

A *budget* keeps, per layer and KV head, either every key (a *full* head) or the first ``sink`` keys and the
``window`` most recent (a *streaming* head, StreamingLLM / DuoAttention). A KV head is full or streaming as a whole:
all the query heads of its group are restricted together. Only the KV heads of global layers are chosen; a layer
the model already windows (Gemma 3's local layers) is left as the model has it and holds its own window.

For each share ``s`` of full KV heads (0 = StreamingLLM, every global head streaming; 1 = full attention), the
``round(s * n)`` full heads of the ``n`` global KV heads are chosen

* ``retrieval``: the highest retrieval scores (a group's score: the max over its query heads);
* ``streaming``: the least streamable heads, i.e. the lowest ``locality_k{sink}_w{window}`` (the share of attention
  a sink + window cache keeps; a group's: the min over its query heads), or where that column is missing the
  largest ``streaming_window_k{sink}`` (NaN: no window of the grid was enough, the least streamable);
* ``random``: ``draws`` seeded draws (a draw orders the heads once, so its full heads at a larger share hold those
  at a smaller one); their mean and a Student-t 95% interval of the mean over the draws;
* ``uniform``: no head is full; every global KV head keeps ``sink`` + ``w`` keys, with ``w`` sized so that the total
  KV bytes equal the share's at the context's length (the remainder spread as one more key on the first heads).
  It depends on the length, so it is sized per needle prompt and per loss piece; at share 0 it is StreamingLLM,
  at share 1 full attention.

At each point: **needle accuracy** (:mod:`~attnscope.experiments.needles` trials over lengths x depths x needles,
only the trials the full model answers, so full attention scores 1), **next-token loss** on pieces of the shipped
long documents (:class:`~attnscope.experiments.metrics.DocumentLoss`, the predictions at ``sink + window`` and later,
where the first key is hidden), **KV bytes** at ``T`` = the longest haystack
(:func:`~attnscope.capture.kv_budget.kv_bytes`: what the budgeted cache holds, counted: a full head ``T`` keys, a
streaming one ``min(T, sink + w)``, a windowed layer ``min(T, its window - 1)``) with the ratio full / budget, and
the **peak RSS** of the point's runs (the process's ``VmHWM``, reset before each run: the model's weights included).

A budget is one :class:`~attnscope.capture.kv_budget.KVBudget` (the uniform choice's with windows per head), and how
it is applied is one small piece (:class:`Applier`): by default :class:`CacheApplier`, the real
:class:`~attnscope.capture.kv_budget.BudgetedCache` (which equals the mask: same tokens, rows to 1e-5, and stores
less), or :class:`MaskApplier`, the restriction as a mask on a full cache
(:class:`~attnscope.experiments.interventions.SinkWindow`), the reference. The loss of a piece is one forward pass
under either: within a pass the cache's streaming heads see exactly their sink + window, but every key of the piece
exists until the pass ends, so only generation's memory is bounded by the budget. Layers and heads are 0-indexed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np
import torch

from ..capture.attention import intervene
from ..capture.extract import as_loaded
from ..capture.generate import cache_keyword
from ..capture.kv_budget import (
    KVBudget,
    KVLayout,
    budget_of,
    budgeted_cache,
    check_sizes,
    full_budget,
    has_score,
    kv_bytes,
    kv_head_scores,
    kv_layout,
    read_scores,
    share_count,
)
from ..errors import AttnscopeError
from ..memory import peak_mb, reset_peak
from ..models.loading import LoadedModel
from .interventions import SinkWindow
from .metrics import DocumentLoss
from .needles import (
    DEFAULT_DEPTHS,
    DEFAULT_DOCUMENT,
    DEFAULT_NEEDLES,
    MAX_NEW_TOKENS,
    NeedlePrompt,
    run_trial,
    trial_prompts,
)

SHARES = (0.0, 0.25, 0.5, 0.75, 1.0)
CHOICES = ("retrieval", "streaming", "random", "uniform")
DRAWS = 5
SINK, WINDOW = 4, 64
KVHead = tuple[int, int]  # (layer, kv_head), 0-indexed
KVScores = dict[str, np.ndarray]  # score -> float [layer, kv_head]


# ---- choosing the full heads -------------------------------------------------------------------------------
def _ranked(layout: KVLayout, order_key: np.ndarray) -> list[KVHead]:
    """Global KV heads sorted by ``order_key`` ``[layer, kv_head]`` ascending, stably (ties by position)."""
    candidates = layout.candidates
    values = np.array([order_key[head] for head in candidates])
    return [candidates[i] for i in np.argsort(values, kind="stable")]


def retrieval_rank(layout: KVLayout, scores: KVScores) -> list[KVHead]:
    """Global KV heads, highest retrieval first (a group's: its highest query head; NaN last)."""
    if "retrieval" not in scores:
        raise AttnscopeError(f"no retrieval score here; these were given: {', '.join(scores) or 'none'}")
    return _ranked(layout, -np.nan_to_num(scores["retrieval"], nan=-np.inf))


def streaming_rank(layout: KVLayout, scores: KVScores, sink: int, window: int) -> list[KVHead]:
    """Global KV heads, least streamable first (module docstring; ties by position)."""
    kept, smallest = streaming_names(sink, window)
    if kept in scores:
        return _ranked(layout, np.nan_to_num(scores[kept], nan=-np.inf))
    if smallest in scores:
        return _ranked(layout, -scores[smallest])  # NaN (no window keeps enough) is +inf already: first
    raise AttnscopeError(f"no streaming score for sink {sink}: need {kept} or {smallest} (attnscope head-functions "
                         f"-s locality --sinks {sink} --windows {window}); these were given: {', '.join(scores)}")


def streaming_names(sink: int, window: int) -> tuple[str, str]:
    """The streaming scores a choice reads: the share kept by sink + window (a group's: its lowest query head) and
    the smallest window that keeps enough (a group's: its largest)."""
    return f"locality_k{sink}_w{window}", f"streaming_window_k{sink}"


def budget_keeping(layout: KVLayout, full: Sequence[KVHead], sink: int, window: int) -> KVBudget:
    """Every global KV head not in ``full`` streaming with ``sink`` + ``window``."""
    return budget_of(layout, full, sink, window)


def uniform_budget(layout: KVLayout, share: float, sink: int, window: int, tokens: int) -> KVBudget:
    """Every global KV head streaming with the same key budget, sized so that the bytes equal ``share``'s at
    ``tokens`` keys (module docstring): windows per head, the remainder one key more on the first heads."""
    heads = layout.candidates
    n_full = share_count(share, len(heads))
    total = n_full * tokens + (len(heads) - n_full) * min(tokens, sink + window)  # the share's keys
    each, extra = divmod(total, len(heads))
    recent = np.zeros((layout.n_layers, layout.n_kv_heads), dtype=int)
    for index, head in enumerate(heads):
        recent[head] = each + (index < extra) - sink
    return KVBudget(np.zeros_like(recent, dtype=bool), sink, int(recent[tuple(zip(*heads))].min()), layout.windows,
                    recent)


@dataclass(frozen=True)
class Choice:
    """How the full heads of a point are picked: ``name`` (a choice of :data:`CHOICES`), ``draw`` (random draws)."""

    name: str
    draw: int = 0

    def budget(self, layout: KVLayout, share: float, ranks: dict[str, list[KVHead]], sink: int, window: int,
               tokens: int, seed: int) -> KVBudget:
        if self.name == "uniform":
            return uniform_budget(layout, share, sink, window, tokens)
        if self.name == "random":
            rng = np.random.default_rng([seed, self.draw])
            order = [layout.candidates[i] for i in rng.permutation(len(layout.candidates))]
        else:
            order = ranks[self.name]
        return budget_keeping(layout, order[: share_count(share, len(layout.candidates))], sink, window)


# ---- applying a budget (the pluggable piece) -----------------------------------------------------------------
@contextmanager
def masked(loaded: LoadedModel, layout: KVLayout, budget: KVBudget) -> Iterator[None]:
    """The budget as a mask on a full cache: each streaming KV head's query heads see only the first ``sink`` keys
    and their ``w`` most recent (:class:`SinkWindow`, one per distinct ``w``)."""
    by_window: dict[int, dict[int, list[int]]] = {}
    windows = budget.head_windows()
    for layer, kv in np.argwhere(budget.streamed):
        by_window.setdefault(int(windows[layer, kv]), {}).setdefault(int(layer), []).extend(layout.query_heads(kv))
    with intervene(*[SinkWindow(heads, budget.sink, recent) for recent, heads in by_window.items()]):
        yield


class Applier(Protocol):
    """How a budget is applied to one needle trial (its answer counted or not) and to the loss on documents."""

    name: str

    def answer(self, loaded: LoadedModel, prompt: NeedlePrompt, budget: KVBudget, new_tokens: int) -> bool: ...

    def loss(self, loaded: LoadedModel, task: DocumentLoss, budget: KVBudget) -> float: ...


class MaskApplier:
    """The budget as a mask on a full cache (:func:`masked`): the reference; stores every key."""

    name = "mask"

    def answer(self, loaded: LoadedModel, prompt: NeedlePrompt, budget: KVBudget, new_tokens: int) -> bool:
        with masked(loaded, kv_layout(loaded), budget):
            return run_trial(loaded, prompt, max_new_tokens=new_tokens).counted

    def loss(self, loaded: LoadedModel, task: DocumentLoss, budget: KVBudget) -> float:
        with masked(loaded, kv_layout(loaded), budget):
            return float(task.summarise(task.evaluate_all(loaded)))


class CacheApplier:
    """The budget as a :class:`~attnscope.capture.kv_budget.BudgetedCache`: needle answers generated with it (its
    streaming heads evict as the text grows); the loss of a piece is one forward pass through a fresh one, whose
    streaming heads see their sink + window within the pass (equal to the mask) and evict after it, so the pass's
    memory is not bounded by the budget (every key of the piece exists during the pass)."""

    name = "cache"

    def answer(self, loaded: LoadedModel, prompt: NeedlePrompt, budget: KVBudget, new_tokens: int) -> bool:
        return run_trial(loaded, prompt, max_new_tokens=new_tokens, kv_budget=budget).counted

    def loss(self, loaded: LoadedModel, task: DocumentLoss, budget: KVBudget) -> float:
        stats = np.zeros((task.n_examples, len(task.columns)))
        keyword = cache_keyword(loaded.model.forward)
        for batch in task.batches:
            output = loaded.model(**batch.inputs, use_cache=True, **{keyword: budgeted_cache(loaded, budget)})
            stats[batch.index] = task.stats(output.logits, batch)
        return float(task.summarise(stats))


APPLIERS: dict[str, Applier] = {"cache": CacheApplier(), "mask": MaskApplier()}
DEFAULT_APPLY = "cache"  # equal to the mask (tokens, rows to 1e-5), fused attention, and it really stores less


# ---- the curve ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CurveSettings:
    """The curve's grid: ``shares`` of full KV heads, ``choices``, ``draws`` random draws from ``seed``, streaming
    heads' ``sink`` + ``window``; needle trials over ``lengths`` x ``depths`` x ``needles`` in ``needle_document``
    (answers of at most ``new_tokens``); the loss over ``loss_pieces`` pieces of ``loss_tokens`` tokens (None: the
    longest haystack) of the shipped documents."""

    shares: tuple[float, ...] = SHARES
    choices: tuple[str, ...] = CHOICES
    draws: int = DRAWS
    seed: int = 0
    sink: int = SINK
    window: int = WINDOW
    lengths: tuple[int, ...] = (1024,)
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    needles: tuple[str, ...] = DEFAULT_NEEDLES
    needle_document: str = DEFAULT_DOCUMENT
    new_tokens: int = MAX_NEW_TOKENS
    loss_pieces: int = 4
    loss_tokens: int | None = None

    @property
    def text_tokens(self) -> int:
        return self.loss_tokens if self.loss_tokens is not None else max(self.lengths)


def check_curve_settings(settings: CurveSettings) -> None:
    """The premises that need no model, one line each."""
    if not settings.shares or any(not 0.0 <= s <= 1.0 for s in settings.shares):
        raise AttnscopeError(f"each share of full KV heads must be within 0..1, got {list(settings.shares)}")
    unknown = [name for name in settings.choices if name not in CHOICES]
    if not settings.choices or unknown:
        raise AttnscopeError(f"unknown choice {unknown[0] if unknown else None!r}; choose from {', '.join(CHOICES)}")
    if settings.draws < 1:
        raise AttnscopeError(f"random choices need at least 1 draw, got {settings.draws}")
    check_sizes(settings.sink, settings.window)
    if not settings.lengths or settings.loss_pieces < 1 or settings.new_tokens < 1:
        raise AttnscopeError("the curve needs at least one haystack length, one loss piece and one new token")
    shortest = min(*settings.lengths, settings.text_tokens)
    if settings.sink + settings.window >= shortest:
        raise AttnscopeError(f"sink {settings.sink} + window {settings.window} keys cover the shortest text "
                             f"({shortest} tokens): streaming would keep every key; ask for a shorter window or "
                             "longer texts")


@dataclass(frozen=True, eq=False)
class KVCurve:
    """The curve's ``records`` (one per share, choice and draw: accuracy, loss, KV bytes, the full KV heads) on
    ``model``; ``baseline``: full attention's loss; ``trials``: the needle trials the full model answered of
    ``asked``. :meth:`to_frame` gives the table (random draws as a mean with an interval)."""

    model: str
    settings: CurveSettings
    kv_tokens: int
    full_bytes: int
    baseline_loss: float
    trials: int
    asked: int
    records: list[dict[str, Any]] = field(repr=False)
    applied: str = DEFAULT_APPLY

    def to_frame(self) -> Any:
        """One row per (share, choice): ``accuracy``, ``loss`` (for random: the mean over the draws, with
        ``*_low``/``*_high`` a Student-t 95% interval of the mean, the accuracy's clipped to 0..1; NaN elsewhere),
        ``kv_bytes`` and ``kv_saving`` (full bytes over the budget's), ``peak_rss_mb`` (the highest of the point's
        runs, MB; NaN where not measured)."""
        import pandas as pd

        rows = []
        for share in self.settings.shares:
            for choice in self.settings.choices:
                found = [r for r in self.records if r["share"] == share and r["choice"] == choice]
                row = {"share": share, "choice": choice, "full_kv_heads": found[0]["full_kv_heads"]}
                for metric in ("accuracy", "loss"):
                    values = np.array([r[metric] for r in found])
                    mean, low, high = mean_interval(values)
                    if metric == "accuracy":  # a share of trials: its interval cannot leave 0..1
                        low, high = (float(np.clip(bound, 0.0, 1.0)) for bound in (low, high))  # NaN stays
                    row[metric], row[f"{metric}_low"], row[f"{metric}_high"] = mean, low, high
                row["kv_bytes"], row["kv_saving"] = found[0]["kv_bytes"], found[0]["kv_saving"]
                peaks = [r["peak_rss_mb"] for r in found if r.get("peak_rss_mb") is not None]
                row["peak_rss_mb"] = max(peaks) if peaks else float("nan")
                rows.append(row)
        return pd.DataFrame(rows)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the settings, the facts, the table and the records."""
        from dataclasses import asdict

        from ..analysis.head_functions import frame_rows

        return {"model": self.model, "settings": asdict(self.settings), "kv_tokens": self.kv_tokens,
                "full_kv_bytes": self.full_bytes, "baseline_loss": self.baseline_loss, "applied_as": self.applied,
                "needle_trials": {"answered_by_full_model": self.trials, "asked": self.asked},
                "indexing": "layers and KV heads are 0-indexed", "table": frame_rows(self.to_frame()),
                "records": self.records}

    def plot(self, path: str | Path | None = None) -> Any:
        """Needle accuracy and loss against the share of full KV heads (:func:`plot_curve`); saved to ``path`` when
        given."""
        return plot_curve(self.to_frame(), self.settings.choices, self.title(), path)

    def title(self) -> str:
        return curve_title(self.model, self.settings.sink, self.settings.window, self.kv_tokens)

    def write_html(self, path: str | Path) -> Path:
        """A page with the facts, the curve (drawn beside it, ``<name>.png``) and the table."""
        from .report import write_summary

        path = Path(path)
        figure = path.with_suffix(".png")
        self.plot(figure)
        facts = {"model": self.model, "streaming heads keep": f"the first {self.settings.sink} keys + the "
                 f"{self.settings.window} most recent", "needle trials (answered by the full model / asked)":
                 f"{self.trials} / {self.asked}", "KV bytes counted at": f"{self.kv_tokens} tokens",
                 "full attention's KV bytes": self.full_bytes, "full attention's loss": f"{self.baseline_loss:.4f}",
                 "applied as": self.applied, "indexing": "layers and KV heads 0-indexed"}
        return write_summary(path, f"KV budget curve: {self.model}", facts, [figure.name], self.to_frame())


def curve_title(model: str, sink: int, window: int, kv_tokens: int) -> str:
    return f"{model}: sink {sink} + window {window}; KV bytes at {kv_tokens} tokens"


def plot_curve(frame: Any, choices: Sequence[str], title: str, path: str | Path | None = None) -> Any:
    """Needle accuracy and loss of a curve's table (:meth:`KVCurve.to_frame`, or a recorded one) against the share of
    full KV heads, one line per choice (random: its mean, the interval shaded; an accuracy's band drawn within 0..1,
    since tables recorded before :meth:`KVCurve.to_frame` clipped it may leave it); saved to ``path`` when given."""
    from .report import finish_figure, pyplot

    figure, axes = pyplot().subplots(1, 2, figsize=(10, 4))
    for ax, metric, label in zip(axes, ("accuracy", "loss"), ("needle accuracy", "loss (nats per token)")):
        for choice in choices:
            rows = frame[frame["choice"] == choice]
            ax.plot(rows["share"], rows[metric], marker="o", label=choice)
            if choice == "random":
                low, high = (rows[f"{metric}_{end}"].astype(float) for end in ("low", "high"))
                if metric == "accuracy":
                    low, high = low.clip(0.0, 1.0), high.clip(0.0, 1.0)
                ax.fill_between(rows["share"], low, high, alpha=0.2)
        ax.set_xlabel("share of full KV heads (0 = StreamingLLM, 1 = full)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    return finish_figure(figure, path)


def mean_interval(values: np.ndarray) -> tuple[float, float, float]:
    """The mean of ``values`` and a Student-t 95% interval of it (NaN bounds for a single value)."""
    mean = float(np.mean(values))
    if len(values) < 2:
        return mean, float("nan"), float("nan")
    from scipy import stats

    half = float(stats.t.ppf(0.975, len(values) - 1) * np.std(values, ddof=1) / np.sqrt(len(values)))
    return mean, mean - half, mean + half


def _choices(settings: CurveSettings) -> list[Choice]:
    return [Choice(name, draw) for name in settings.choices
            for draw in (range(settings.draws) if name == "random" else [0])]


class RunStore:
    """Runs already done, kept in a JSON-lines file so that a long curve resumes where it stopped: one line per run,
    ``{"key": digest, "run": {...}}``. A digest covers the run's key (the text's tokens and the keys the budget keeps)
    and ``context`` (the model, how budgets are applied, the answer length, the loss pieces), so a file written under
    other settings is never read back as this curve's."""

    def __init__(self, path: str | Path, context: tuple[Any, ...]) -> None:
        self.path, self.context = Path(path), context
        # checked before any slow work, and without making the file: a run lost at the end would be run again; and
        # before reading, which may mend a cut-off last line
        if self.path.exists() and not self.path.is_file():
            raise AttnscopeError(f"{self.path} is not a file: give a file for the curve's runs")
        if not self.path.parent.is_dir() or not os.access(self.path if self.path.exists() else self.path.parent,
                                                           os.W_OK):
            raise AttnscopeError(f"cannot write the curve's runs to {self.path}: make its folder, or give another")
        self.runs: dict[str, dict[str, Any]] = self._read() if self.path.is_file() else {}

    def _read(self) -> dict[str, dict[str, Any]]:
        """The runs the file holds; a last line cut off as it was written (the run stopped) is dropped from the file,
        and that run runs again. Anything else that is no run is refused, the file left as it is."""
        text = self.path.read_text()
        lines = text.split("\n")
        tail = lines.pop()  # "" when the file ends with a newline
        runs = dict(self._entry(line, number) for number, line in enumerate(lines, start=1))
        if tail:
            try:
                runs.update([self._entry(tail, len(lines) + 1)])
                self.path.write_text(text + "\n")
            except AttnscopeError:
                if not tail.startswith('{"key": '):
                    raise
                self.path.write_text(text[: len(text) - len(tail)])
        return runs

    def _entry(self, line: str, number: int) -> tuple[str, dict[str, Any]]:
        try:
            entry = json.loads(line)
            return str(entry["key"]), dict(entry["run"])
        except (ValueError, KeyError, TypeError):
            raise AttnscopeError(f"{self.path} line {number} is not a run of a KV budget curve") from None

    def digest(self, key: tuple[Any, ...]) -> str:
        return hashlib.sha256(repr((self.context, key)).encode()).hexdigest()

    def get(self, key: tuple[Any, ...]) -> dict[str, Any] | None:
        return self.runs.get(self.digest(key))

    def put(self, key: tuple[Any, ...], run: dict[str, Any]) -> None:
        digest = self.digest(key)
        self.runs[digest] = run
        with self.path.open("a") as out:
            out.write(json.dumps({"key": digest, "run": run}) + "\n")


def check_runs(path: str | Path) -> None:
    """Refuse in one line a runs file that cannot be read back or written (:class:`RunStore`), making no file (a
    last line cut off as it was written is dropped, as the curve would drop it)."""
    RunStore(path, ())


@dataclass(frozen=True)
class FullRun:
    """A needle trial under full attention, as the curve needs it: whether it ``counted``, each head's retrieval
    ``scores`` ``[layer, head]``, the run's ``peak`` RSS (MB)."""

    counted: bool
    scores: np.ndarray
    peak: float | None


class _Evaluator:
    """Accuracy and loss under budgets, each distinct budget run once, with the peak resident memory of its run
    (MB, the model's weights included; None where not measured); ``store``: where runs are kept between calls."""

    def __init__(self, loaded: LoadedModel, apply: Applier, loss: DocumentLoss, new_tokens: int,
                 store: RunStore | None = None) -> None:
        self.loaded, self.apply, self.loss, self.new_tokens, self.store = loaded, apply, loss, new_tokens, store
        self.done: dict[tuple[Any, ...], tuple[float, float | None]] = {}

    def full_run(self, prompt: NeedlePrompt) -> FullRun:
        """The full model's trial on ``prompt``."""
        def trial() -> dict[str, Any]:
            found = run_trial(self.loaded, prompt, max_new_tokens=self.new_tokens)
            return {"counted": found.counted, "scores": found.scores.tolist()}

        kept = self._kept(("full", prompt.ids), trial)
        return FullRun(bool(kept["counted"]), np.array(kept["scores"], dtype=float), kept["peak"])

    def needle_tokens(self, prompt: NeedlePrompt) -> int:
        """The most keys a trial's queries see: its prompt and answer."""
        return len(prompt.ids) + self.new_tokens

    def answered_in_full(self, prompt: NeedlePrompt, full: KVBudget, peak: float | None) -> None:
        """Remember that the full model answered ``prompt``: a budget that evicts no key answers it again."""
        self.done[("needle", prompt.ids, *full.key(self.needle_tokens(prompt)))] = (1.0, peak)

    def answered(self, prompt: NeedlePrompt, budget: KVBudget) -> tuple[float, float | None]:
        return self._once(("needle", prompt.ids, *budget.key(self.needle_tokens(prompt))),
                          lambda: self.apply.answer(self.loaded, prompt, budget, self.new_tokens))

    def loss_under(self, budget: KVBudget, tokens: int) -> tuple[float, float | None]:
        return self._once(("loss", *budget.key(tokens)), lambda: self.apply.loss(self.loaded, self.loss, budget))

    def _once(self, key: tuple[Any, ...], run: Callable[[], float]) -> tuple[float, float | None]:
        if key not in self.done:
            kept = self._kept(key, lambda: {"value": float(run())})
            self.done[key] = (float(kept["value"]), kept["peak"])
        return self.done[key]

    def _kept(self, key: tuple[Any, ...], run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """What ``run()`` gives for ``key``, with its ``peak`` RSS: read back where the store holds it, else run and
        kept."""
        kept = self.store.get(key) if self.store is not None else None
        if kept is None:
            reset_peak()
            with torch.inference_mode():
                kept = {**run(), "peak": peak_mb()}
            if self.store is not None:
                self.store.put(key, kept)
        return kept


def kv_budget_curve(model: LoadedModel | str, scores: Any = None, settings: CurveSettings | None = None, *,
                    apply: Applier | str = DEFAULT_APPLY, progress: bool = False,
                    runs: str | Path | None = None) -> KVCurve:
    """The curve of the module docstring on ``model``. ``scores``: a
    :class:`~attnscope.analysis.head_functions.HeadScores`, its ``scores`` dict, a Parquet file of ``attnscope
    head-functions --save`` (per head or per KV group), or None; a missing retrieval score is computed from the full
    model's needle trials, a missing streaming score by :func:`~attnscope.head_scores` (locality at ``sink`` +
    ``window`` on one document). ``apply``: how a budget is applied, ``"cache"`` (default: the real
    :class:`~attnscope.capture.kv_budget.BudgetedCache`) or ``"mask"`` (:func:`masked`), or an :class:`Applier`.
    ``runs``: a JSON-lines file that keeps every run as it ends (:class:`RunStore`); a curve given the same file
    again reads back the runs it holds and runs only the rest. Every premise is checked before the model runs.

    >>> curve = kv_budget_curve("smollm2", settings=CurveSettings(lengths=(512,), shares=(0, 0.5, 1)))  # doctest: +SKIP
    >>> curve.to_frame()                                                                                 # doctest: +SKIP
    """
    applier = applier_named(apply) if isinstance(apply, str) else apply
    loaded = as_loaded(model)
    settings = settings or CurveSettings()
    check_curve_settings(settings)
    layout = kv_layout(loaded)
    if not layout.candidates:
        raise AttnscopeError(f"{loaded.name} has no global layer: every layer already keeps only its window")
    given = _given_scores(scores, layout, settings)
    prompts = trial_prompts(loaded, lengths=settings.lengths, depths=settings.depths, needles=settings.needles,
                            document_name=settings.needle_document, max_new_tokens=settings.new_tokens)
    loss = DocumentLoss(loaded, length=settings.text_tokens, n=settings.loss_pieces,
                        skip=settings.sink + settings.window)
    store = None if runs is None else RunStore(runs, _run_context(loaded, applier, settings))
    evaluator = _Evaluator(loaded, applier, loss, settings.new_tokens, store)
    full = full_budget(layout, settings.sink, settings.window)
    full_trials = []
    for prompt in _bar(prompts, progress, "needle trials, full attention"):
        full_trials.append(evaluator.full_run(prompt))
        if full_trials[-1].counted:
            evaluator.answered_in_full(prompt, full, full_trials[-1].peak)
    kept = [prompt for prompt, trial in zip(prompts, full_trials) if trial.counted]
    if not kept:
        raise AttnscopeError(f"{loaded.name} answered none of the {len(prompts)} needle trials with full attention: "
                             "no accuracy to lose (try other lengths, needles or the chat form)")
    ranks = _ranks(loaded, layout, given, full_trials, settings, progress)
    kv_tokens = max(settings.lengths)
    dtype = cache_dtype(loaded)
    full_bytes = kv_bytes(full, kv_tokens, layout.head_dim, dtype)
    baseline = evaluator.loss_under(full, settings.text_tokens)[0]
    points = [(share, choice) for share in settings.shares for choice in _choices(settings)]
    records = [_point(evaluator, layout, share, choice, ranks, settings, kept, full_bytes, dtype)
               for share, choice in _bar(points, progress, "KV budgets")]
    return KVCurve(loaded.name, settings, kv_tokens, full_bytes, baseline, len(kept), len(prompts), records,
                   applier.name)


def _run_context(loaded: LoadedModel, applier: Applier, settings: CurveSettings) -> tuple[Any, ...]:
    """What a run's value depends on beyond its key: the model, how budgets are applied, the answers' length, the
    loss pieces (how many, how long, the first prediction counted)."""
    return (loaded.name, str(loaded.dtype), applier.name, settings.new_tokens, settings.loss_pieces,
            settings.text_tokens, settings.sink + settings.window)


def applier_named(name: str) -> Applier:
    if name not in APPLIERS:
        raise AttnscopeError(f"unknown way to apply a KV budget {name!r}; choose from {', '.join(APPLIERS)}")
    return APPLIERS[name]


def cache_dtype(loaded: LoadedModel) -> torch.dtype:
    """The dtype the model's keys and values are cached in (its own)."""
    return cast(torch.dtype, getattr(torch, str(loaded.dtype).replace("torch.", "")))


def _point(evaluator: _Evaluator, layout: KVLayout, share: float, choice: Choice, ranks: dict[str, list[KVHead]],
           settings: CurveSettings, prompts: Sequence[NeedlePrompt], full_bytes: int,
           dtype: torch.dtype) -> dict[str, Any]:
    """One record: accuracy over ``prompts`` and loss under ``choice``'s budget at ``share`` (sized per text's length
    for the uniform choice), its bytes at the longest haystack, the highest peak RSS of its runs."""

    def budget_at(tokens: int) -> KVBudget:
        return choice.budget(layout, share, ranks, settings.sink, settings.window, tokens, settings.seed)

    kv_tokens = max(settings.lengths)
    reported = budget_at(kv_tokens)
    budget_bytes = kv_bytes(reported, kv_tokens, layout.head_dim, dtype)
    answers = [evaluator.answered(p, budget_at(len(p.ids))) for p in prompts]
    loss = evaluator.loss_under(budget_at(settings.text_tokens), settings.text_tokens)
    peaks = [peak for _, peak in (*answers, loss) if peak is not None]
    windows = reported.head_windows()
    return {"share": share, "choice": choice.name, "draw": choice.draw, "full_kv_heads": int(reported.full.sum()),
            "accuracy": float(np.mean([value for value, _ in answers])), "loss": loss[0], "kv_bytes": budget_bytes,
            "kv_saving": full_bytes / budget_bytes, "peak_rss_mb": max(peaks) if peaks else None,
            "streaming": [[int(layer), int(kv), int(windows[layer, kv])] for layer, kv in np.argwhere(reported.streamed)]}


def _given_scores(scores: Any, layout: KVLayout, settings: CurveSettings) -> KVScores:
    """The scores the choices read, ``[layer, kv_head]`` each, from what was given (another model's refused)."""
    if scores is None:
        return {}
    source = read_scores(scores) if isinstance(scores, str | Path) else scores
    kept, smallest = streaming_names(settings.sink, settings.window)
    wanted = {"retrieval": "max", kept: "min", smallest: "max"}
    return {name: kv_head_scores(source, name, layout=layout, reduce=reduce) for name, reduce in wanted.items()
            if has_score(source, name, reduce)}


def _ranks(loaded: LoadedModel, layout: KVLayout, given: KVScores, full_trials: Sequence[FullRun],
           settings: CurveSettings, progress: bool) -> dict[str, list[KVHead]]:
    """Each scored choice's order of the global KV heads, computing what ``given`` lacks."""
    from ..analysis.retrieval import mean_retrieval_score

    scores = dict(given)
    ranks: dict[str, list[KVHead]] = {}
    if "retrieval" in settings.choices:
        if "retrieval" not in scores:
            per_head = mean_retrieval_score([t.scores for t in full_trials], [t.counted for t in full_trials])
            scores["retrieval"] = kv_head_scores({"retrieval": per_head}, "retrieval", layout=layout)
        ranks["retrieval"] = retrieval_rank(layout, scores)
    if "streaming" in settings.choices:
        kept, smallest = streaming_names(settings.sink, settings.window)
        if kept not in scores and smallest not in scores:
            from .head_functions import HeadScoreSettings, head_scores

            found = head_scores(loaded, ["locality"], HeadScoreSettings(
                sinks=(settings.sink,), windows=(settings.window,), max_tokens=settings.text_tokens), progress=progress)
            scores[kept] = kv_head_scores(found, kept, layout=layout, reduce="min")
        ranks["streaming"] = streaming_rank(layout, scores, settings.sink, settings.window)
    return ranks


def _bar(items: Sequence[Any], progress: bool, what: str) -> Any:
    """``items`` with a progress bar when asked."""
    if not progress:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=what, leave=False)
