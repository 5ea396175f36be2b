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
where the first key is hidden) and **KV bytes** (keys and values, counted: a full head holds ``T`` keys, a
streaming one ``min(T, sink + window)``, a windowed layer ``min(T, its window)``) at ``T`` = the longest haystack,
with the ratio full / budget.

How a budget is applied is one small piece (:data:`Applier`): by default :func:`masked`, the restriction as a mask on
a full cache (:class:`~attnscope.experiments.interventions.SinkWindow`), which the budgeted cache must equal token for
token (issue 49, item 2). A real budgeted cache can be passed instead. Layers and heads are 0-indexed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..capture.attention import intervene
from ..capture.extract import as_loaded, layer_windows
from ..capture.generate import generation_shape
from ..errors import AttnscopeError
from ..models.loading import LoadedModel
from .interventions import SinkWindow, attention_shape
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
Scores = dict[str, np.ndarray]  # column -> float [layer, head] (query heads)


# ---- the cache's shape and its bytes -------------------------------------------------------------------------
@dataclass(frozen=True)
class KVLayout:
    """What a KV cache of the model holds per key: ``n_layers`` x ``n_kv_heads`` heads of ``group`` query heads
    each, keys and values of ``d_head`` numbers of ``itemsize`` bytes; ``windows`` per layer (0 = global)."""

    n_layers: int
    n_kv_heads: int
    group: int
    d_head: int
    itemsize: int
    windows: tuple[int, ...]

    @classmethod
    def of(cls, loaded: LoadedModel) -> KVLayout:
        shape = generation_shape(loaded, 1, 1)
        windows = layer_windows(loaded) or (0,) * shape.n_layers
        itemsize = torch.empty(0, dtype=getattr(torch, str(loaded.dtype).replace("torch.", ""))).element_size()
        return cls(shape.n_layers, shape.n_kv_heads, shape.n_heads // shape.n_kv_heads, shape.d_head, itemsize,
                   tuple(windows))

    @property
    def candidates(self) -> list[KVHead]:
        """The KV heads a budget chooses among: every KV head of the global layers, in order."""
        return [(layer, kv) for layer in range(self.n_layers) if not self.windows[layer]
                for kv in range(self.n_kv_heads)]

    def key_bytes(self) -> int:
        """Bytes one key and its value take in one KV head."""
        return 2 * self.d_head * self.itemsize

    def query_heads(self, kv_head: int) -> list[int]:
        """The query heads sharing ``kv_head`` (adjacent, as transformers repeats them)."""
        return list(range(kv_head * self.group, (kv_head + 1) * self.group))


@dataclass(frozen=True)
class HeadBudget:
    """One budget at a context of ``tokens`` keys: ``recent`` ``{(layer, kv_head): w}`` the streaming KV heads and
    the recent keys each keeps (besides the first ``sink``); every other KV head is full."""

    sink: int
    recent: dict[KVHead, int]
    tokens: int

    def key(self) -> tuple[Any, ...]:
        """Equal for budgets that keep the same keys (results are reused between them): a head whose sink + recent
        keys reach ``tokens`` keeps every key, as a full one does."""
        return self.sink, tuple(sorted(self.streaming().items())), self.tokens

    def streaming(self) -> dict[KVHead, int]:
        """The heads that lose keys at ``tokens``: ``{(layer, kv_head): w}``."""
        return {head: recent for head, recent in self.recent.items() if self.sink + recent < self.tokens}


def kv_bytes(layout: KVLayout, budget: HeadBudget | None, tokens: int) -> int:
    """Bytes of keys and values a cache of ``tokens`` keys holds under ``budget`` (None: full attention): per layer
    and KV head, ``tokens`` keys (full), ``min(tokens, sink + w)`` (streaming) or ``min(tokens, window)`` (a layer
    the model windows)."""
    total = 0
    for layer in range(layout.n_layers):
        for kv in range(layout.n_kv_heads):
            kept = tokens
            if layout.windows[layer]:
                kept = min(tokens, layout.windows[layer])
            elif budget is not None and (layer, kv) in budget.recent:
                kept = min(tokens, budget.sink + budget.recent[(layer, kv)])
            total += kept
    return total * layout.key_bytes()


# ---- choosing the full heads -------------------------------------------------------------------------------
def group_scores(layout: KVLayout, values: np.ndarray, reduce: Callable[..., np.ndarray]) -> np.ndarray:
    """``[layer, head]`` query-head scores -> ``[layer, kv_head]`` by ``reduce`` over each group (NaN kept)."""
    grouped = np.asarray(values, dtype=np.float64).reshape(layout.n_layers, layout.n_kv_heads, layout.group)
    return np.asarray(reduce(grouped, axis=-1))


def retrieval_rank(layout: KVLayout, scores: Scores) -> list[KVHead]:
    """Global KV heads, highest retrieval first (NaN last; ties by position)."""
    if "retrieval" not in scores:
        raise AttnscopeError(f"no retrieval score here; these were given: {', '.join(scores) or 'none'}")
    grouped = group_scores(layout, np.nan_to_num(scores["retrieval"], nan=-np.inf), np.max)
    return _ranked(layout, -grouped)


def streaming_rank(layout: KVLayout, scores: Scores, sink: int, window: int) -> list[KVHead]:
    """Global KV heads, least streamable first (module docstring; ties by position)."""
    kept = f"locality_k{sink}_w{window}"
    if kept in scores:
        return _ranked(layout, group_scores(layout, np.nan_to_num(scores[kept], nan=-np.inf), np.min))
    smallest = f"streaming_window_k{sink}"
    if smallest in scores:
        return _ranked(layout, -group_scores(layout, np.nan_to_num(scores[smallest], nan=np.inf), np.max))
    raise AttnscopeError(f"no streaming score for sink {sink}: need {kept} or {smallest} (attnscope head-functions "
                         f"-s locality --sinks {sink} --windows {window}); these were given: {', '.join(scores)}")


def _ranked(layout: KVLayout, order_key: np.ndarray) -> list[KVHead]:
    """Global KV heads sorted by ``order_key`` ``[layer, kv_head]`` ascending, stably."""
    candidates = layout.candidates
    values = np.array([order_key[layer, kv] for layer, kv in candidates])
    return [candidates[i] for i in np.argsort(values, kind="stable")]


def n_full(layout: KVLayout, share: float) -> int:
    return round(share * len(layout.candidates))


def budget_keeping(layout: KVLayout, full: Sequence[KVHead], sink: int, window: int, tokens: int) -> HeadBudget:
    """Every global KV head not in ``full`` streaming with ``sink`` + ``window``."""
    kept = set(full)
    return HeadBudget(sink, {head: window for head in layout.candidates if head not in kept}, tokens)


def uniform_budget(layout: KVLayout, share: float, sink: int, window: int, tokens: int) -> HeadBudget:
    """Every global KV head streaming with the same key budget, sized so that the bytes equal ``share``'s at
    ``tokens`` keys (module docstring); a head whose keys reach ``tokens`` keeps them all, as a full one does."""
    heads = layout.candidates
    if not heads:
        return HeadBudget(sink, {}, tokens)
    f = n_full(layout, share)
    streaming_keys = min(tokens, sink + window)
    total = f * tokens + (len(heads) - f) * streaming_keys  # the share's keys over the global heads
    each, extra = divmod(total, len(heads))
    return HeadBudget(sink, {head: each + (index < extra) - sink for index, head in enumerate(heads)}, tokens)


@dataclass(frozen=True)
class Choice:
    """How the full heads of a point are picked: ``name`` (a choice of :data:`CHOICES`), ``draw`` (random draws)."""

    name: str
    draw: int = 0

    def budget(self, layout: KVLayout, share: float, ranks: dict[str, list[KVHead]], sink: int, window: int,
               tokens: int, seed: int) -> HeadBudget:
        if self.name == "uniform":
            return uniform_budget(layout, share, sink, window, tokens)
        if self.name == "random":
            rng = np.random.default_rng([seed, self.draw])
            order = [layout.candidates[i] for i in rng.permutation(len(layout.candidates))]
        else:
            order = ranks[self.name]
        return budget_keeping(layout, order[: n_full(layout, share)], sink, window, tokens)


# ---- applying a budget (the pluggable piece) -----------------------------------------------------------------
Applier = Callable[[LoadedModel, KVLayout, HeadBudget], AbstractContextManager[None]]


@contextmanager
def masked(loaded: LoadedModel, layout: KVLayout, budget: HeadBudget) -> Iterator[None]:
    """The budget as a mask on a full cache: each streaming KV head's query heads see only the first ``sink`` keys
    and their ``w`` most recent (:class:`SinkWindow`, one per distinct ``w``)."""
    by_window: dict[int, dict[int, list[int]]] = {}
    for (layer, kv), recent in budget.streaming().items():  # a head that keeps every key needs no mask
        by_window.setdefault(recent, {}).setdefault(layer, []).extend(layout.query_heads(kv))
    with intervene(*[SinkWindow(heads, budget.sink, recent) for recent, heads in by_window.items()]):
        yield


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
    if settings.sink < 0 or settings.window < 1:
        raise AttnscopeError(f"streaming heads need sink >= 0 and window >= 1, got {settings.sink} and "
                             f"{settings.window}")
    if not settings.lengths or settings.loss_pieces < 1 or settings.new_tokens < 1:
        raise AttnscopeError("the curve needs at least one haystack length, one loss piece and one new token")
    shortest = min(*settings.lengths, settings.text_tokens)
    if settings.sink + settings.window >= shortest:
        raise AttnscopeError(f"sink {settings.sink} + window {settings.window} keys cover the shortest text "
                             f"({shortest} tokens): streaming would keep every key; ask for a shorter window or "
                             "longer texts")


def scores_from_file(path: str | Path) -> Scores:
    """Per-head score columns ``[layer, head]`` of a Parquet file written by ``attnscope head-functions --save``."""
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise AttnscopeError(f"no scores file {path}")
    try:
        frame = pd.read_parquet(path)
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise AttnscopeError(f"cannot read {path} as Parquet: {error}") from None
    if "head" not in frame or "layer" not in frame:
        raise AttnscopeError(f"{path} has no layer and head columns: write it with 'attnscope head-functions --save "
                             "FILE.parquet' (per head, the default)")
    n_layers, n_heads = int(frame["layer"].max()) + 1, int(frame["head"].max()) + 1
    frame = frame.sort_values(["layer", "head"])
    skip = {"layer", "head", "kv_head", "window", "note"}
    return {name: frame[name].to_numpy(dtype=np.float64).reshape(n_layers, n_heads) for name in frame.columns
            if name not in skip and frame[name].dtype.kind in "fiu"}


def check_scores_shape(loaded: LoadedModel, scores: Scores) -> None:
    """Scores of another model (another layer x head shape) refused, one line."""
    _, n_layers, n_heads = attention_shape(loaded, "self")
    for name, values in scores.items():
        if np.shape(values) != (n_layers, n_heads):
            raise AttnscopeError(f"score {name!r} is {np.shape(values)} layers x heads; {loaded.name} has "
                                 f"({n_layers}, {n_heads}): these scores come from another model")


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

    def to_frame(self) -> Any:
        """One row per (share, choice): ``accuracy``, ``loss`` (for random: the mean over the draws, with
        ``*_low``/``*_high`` a Student-t 95% interval of the mean; NaN elsewhere), ``kv_bytes`` and
        ``kv_saving`` (full bytes over the budget's)."""
        import pandas as pd

        rows = []
        for share in self.settings.shares:
            for choice in self.settings.choices:
                found = [r for r in self.records if r["share"] == share and r["choice"] == choice]
                row = {"share": share, "choice": choice, "full_kv_heads": found[0]["full_kv_heads"]}
                for metric in ("accuracy", "loss"):
                    values = np.array([r[metric] for r in found])
                    row[metric], row[f"{metric}_low"], row[f"{metric}_high"] = mean_interval(values)
                row["kv_bytes"], row["kv_saving"] = found[0]["kv_bytes"], found[0]["kv_saving"]
                rows.append(row)
        return pd.DataFrame(rows)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the settings, the facts, the table and the records."""
        from dataclasses import asdict

        from ..analysis.head_functions import frame_rows

        return {"model": self.model, "settings": asdict(self.settings), "kv_tokens": self.kv_tokens,
                "full_kv_bytes": self.full_bytes, "baseline_loss": self.baseline_loss,
                "needle_trials": {"answered_by_full_model": self.trials, "asked": self.asked},
                "indexing": "layers and KV heads are 0-indexed", "table": frame_rows(self.to_frame()),
                "records": self.records}

    def plot(self, path: str | Path | None = None) -> Any:
        """Needle accuracy and loss against the share of full KV heads, one line per choice (random: its mean, the
        interval shaded); saved to ``path`` when given."""
        from .report import finish_figure, pyplot

        frame = self.to_frame()
        figure, axes = pyplot().subplots(1, 2, figsize=(10, 4))
        for ax, metric, label in zip(axes, ("accuracy", "loss"), ("needle accuracy", "loss (nats per token)")):
            for choice in self.settings.choices:
                rows = frame[frame["choice"] == choice]
                ax.plot(rows["share"], rows[metric], marker="o", label=choice)
                if choice == "random":
                    ax.fill_between(rows["share"], rows[f"{metric}_low"], rows[f"{metric}_high"], alpha=0.2)
            ax.set_xlabel("share of full KV heads (0 = StreamingLLM, 1 = full)")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        figure.suptitle(f"{self.model}: sink {self.settings.sink} + window {self.settings.window}; KV bytes at "
                        f"{self.kv_tokens} tokens", fontsize=10)
        return finish_figure(figure, path)

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
                 "indexing": "layers and KV heads 0-indexed"}
        return write_summary(path, f"KV budget curve: {self.model}", facts, [figure.name], self.to_frame())


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


class _Evaluator:
    """Accuracy and loss under budgets, each distinct budget run once."""

    def __init__(self, loaded: LoadedModel, layout: KVLayout, apply: Applier, loss: DocumentLoss,
                 new_tokens: int) -> None:
        self.loaded, self.layout, self.apply, self.loss, self.new_tokens = loaded, layout, apply, loss, new_tokens
        self.done: dict[tuple[Any, ...], float] = {}

    def answered_in_full(self, prompt: NeedlePrompt, sink: int) -> None:
        """Remember that the full model answered ``prompt``: a budget that streams no head answers it again."""
        self.done[("needle", prompt.ids, *HeadBudget(sink, {}, len(prompt.ids)).key())] = 1.0

    def full_loss(self, sink: int, tokens: int) -> float:
        """The full model's loss, remembered for budgets that stream no head."""
        return self.loss_under(HeadBudget(sink, {}, tokens))

    def answered(self, prompt: NeedlePrompt, budget: HeadBudget) -> float:
        key = ("needle", prompt.ids, *budget.key())
        if key not in self.done:
            with self.apply(self.loaded, self.layout, budget), torch.inference_mode():
                self.done[key] = float(run_trial(self.loaded, prompt, max_new_tokens=self.new_tokens).counted)
        return self.done[key]

    def loss_under(self, budget: HeadBudget) -> float:
        key = ("loss", *budget.key())
        if key not in self.done:
            with self.apply(self.loaded, self.layout, budget), torch.inference_mode():
                self.done[key] = float(self.loss.summarise(self.loss.evaluate_all(self.loaded)))
        return self.done[key]


def kv_budget_curve(model: LoadedModel | str, scores: Scores | Any | str | Path | None = None,
                    settings: CurveSettings | None = None, *, apply: Applier = masked,
                    progress: bool = False) -> KVCurve:
    """The curve of the module docstring on ``model``. ``scores``: a
    :class:`~attnscope.analysis.head_functions.HeadScores`, its ``scores`` dict, a Parquet file of ``attnscope
    head-functions --save``, or None; a missing retrieval score is computed from the full model's needle trials, a
    missing streaming score by :func:`~attnscope.head_scores` (locality at ``sink`` + ``window`` on one document).
    ``apply``: how a budget is applied (default :func:`masked`). Every premise is checked before the model runs.

    >>> curve = kv_budget_curve("smollm2", settings=CurveSettings(lengths=(512,), shares=(0, 0.5, 1)))  # doctest: +SKIP
    >>> curve.to_frame()                                                                                 # doctest: +SKIP
    """
    loaded = as_loaded(model)
    settings = settings or CurveSettings()
    check_curve_settings(settings)
    given = _given_scores(scores)
    check_scores_shape(loaded, given)
    layout = KVLayout.of(loaded)
    if not layout.candidates:
        raise AttnscopeError(f"{loaded.name} has no global layer: every layer already keeps only its window")
    prompts = trial_prompts(loaded, lengths=settings.lengths, depths=settings.depths, needles=settings.needles,
                            document_name=settings.needle_document, max_new_tokens=settings.new_tokens)
    loss = DocumentLoss(loaded, length=settings.text_tokens, n=settings.loss_pieces,
                        skip=settings.sink + settings.window)
    with torch.inference_mode():
        full_trials = [run_trial(loaded, prompt, max_new_tokens=settings.new_tokens)
                       for prompt in _bar(prompts, progress, "needle trials, full attention")]
    kept = [prompt for prompt, trial in zip(prompts, full_trials) if trial.counted]
    if not kept:
        raise AttnscopeError(f"{loaded.name} answered none of the {len(prompts)} needle trials with full attention: "
                             "no accuracy to lose (try other lengths, needles or the chat form)")
    ranks = _ranks(loaded, layout, given, full_trials, settings, progress)
    evaluator = _Evaluator(loaded, layout, apply, loss, settings.new_tokens)
    for prompt in kept:
        evaluator.answered_in_full(prompt, settings.sink)
    kv_tokens = max(settings.lengths)
    full_bytes = kv_bytes(layout, None, kv_tokens)
    baseline = evaluator.full_loss(settings.sink, settings.text_tokens)
    points = [(share, choice) for share in settings.shares for choice in _choices(settings)]
    records = [_point(evaluator, share, choice, ranks, settings, kept, full_bytes)
               for share, choice in _bar(points, progress, "KV budgets")]
    return KVCurve(loaded.name, settings, kv_tokens, full_bytes, baseline, len(kept), len(prompts), records)


def _point(evaluator: _Evaluator, share: float, choice: Choice, ranks: dict[str, list[KVHead]],
           settings: CurveSettings, prompts: Sequence[NeedlePrompt], full_bytes: int) -> dict[str, Any]:
    """One record: accuracy over ``prompts`` and loss under ``choice``'s budget at ``share`` (sized per text's length
    for the uniform choice), its bytes at the longest haystack."""
    layout = evaluator.layout

    def budget_at(tokens: int) -> HeadBudget:
        return choice.budget(layout, share, ranks, settings.sink, settings.window, tokens, settings.seed)

    kv_tokens = max(settings.lengths)
    reported = budget_at(kv_tokens)
    budget_bytes = kv_bytes(layout, reported, kv_tokens)
    full_heads = 0 if choice.name == "uniform" else len(layout.candidates) - len(reported.recent)
    return {"share": share, "choice": choice.name, "draw": choice.draw, "full_kv_heads": full_heads,
            "accuracy": float(np.mean([evaluator.answered(p, budget_at(len(p.ids))) for p in prompts])),
            "loss": evaluator.loss_under(budget_at(settings.text_tokens)), "kv_bytes": budget_bytes,
            "kv_saving": full_bytes / budget_bytes,
            "streaming": [[layer, kv, recent] for (layer, kv), recent in sorted(reported.recent.items())]}


def _given_scores(scores: Any) -> Scores:
    if scores is None:
        return {}
    if isinstance(scores, (str, Path)):
        return scores_from_file(scores)
    found = getattr(scores, "scores", scores)  # a HeadScores or its dict
    return {name: np.asarray(values, dtype=np.float64) for name, values in dict(found).items()}


def _ranks(loaded: LoadedModel, layout: KVLayout, given: Scores, full_trials: Sequence[Any],
           settings: CurveSettings, progress: bool) -> dict[str, list[KVHead]]:
    """Each scored choice's order of the global KV heads, computing what ``given`` lacks."""
    from ..analysis.retrieval import mean_retrieval_score

    scores = dict(given)
    ranks: dict[str, list[KVHead]] = {}
    if "retrieval" in settings.choices:
        if "retrieval" not in scores:
            scores["retrieval"] = mean_retrieval_score([t.scores for t in full_trials], [t.counted for t in full_trials])
        ranks["retrieval"] = retrieval_rank(layout, scores)
    if "streaming" in settings.choices:
        names = (f"locality_k{settings.sink}_w{settings.window}", f"streaming_window_k{settings.sink}")
        if not any(name in scores for name in names):
            from .head_functions import HeadScoreSettings, head_scores

            found = head_scores(loaded, ["locality"], HeadScoreSettings(
                sinks=(settings.sink,), windows=(settings.window,), max_tokens=settings.text_tokens), progress=progress)
            scores.update(found.scores)
        ranks["streaming"] = streaming_rank(layout, scores, settings.sink, settings.window)
    return ranks


def _bar(items: Sequence[Any], progress: bool, what: str) -> Any:
    """``items`` with a progress bar when asked."""
    if not progress:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=what, leave=False)
