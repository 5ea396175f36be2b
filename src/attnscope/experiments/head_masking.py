"""Is a head score right? Switch off the heads it ranks first, and k random heads, and compare what breaks.

Any score ``[layer, head]`` (induction, streaming, retrieval, ...; higher = more of that function) is checked
the same way: for each k, the k heads with the highest scores are masked together (``top k``), and, as the
baseline, k heads drawn at random (``random k #d``, ``draws`` seeded draws, Wu et al. 2024's control); with
``least``, also the k lowest-scoring heads (``bottom k``). A metric (a :class:`~.metrics.Task`: per-example
statistics and their summary) is measured on the intact model and under each set, and the change (masked
minus intact) is reported for the top set, for random sets (the mean over the draws), for the bottom set and for
top minus random, each with a paired percentile bootstrap 95% interval over the metric's examples
(:func:`~.sweeps.bootstrap_deltas`: every resample draws the same examples for every set).

Masking is an :class:`~attnscope.capture.attention.Intervention` through the one attention function, per query
head (heads of one key/value group are masked one by one):

* :class:`AblationMasking` (default ``zero``): the head's output, before the output projection, is 0 at every
  position. Zero rather than mean ablation because the three checks need no reference set that could carry the
  function itself (a retrieval or induction head's mean output over the task's own trials holds the copied
  tokens' average), it is what Wu et al. masked for retrieval heads, and it is one fixed change for every metric;
  any other mode of :func:`~.interventions.ablation_modes` may be asked for (``mean`` takes its means from the
  task's batches).
* :class:`WindowMasking`: the head sees only the first ``sink`` keys and the ``window`` most recent
  (:class:`~.interventions.SinkWindow`), the check of a streaming score: restricting the top streaming heads
  should cost little, the least streaming ones most.

Built-in checks by score name (:data:`CHECKS`): ``induction`` (:class:`~.metrics.RepeatedHalfLoss`, zero
ablation) and ``streaming`` (:class:`~.metrics.DocumentLoss` past the first ``sink + window`` positions, sink +
window restriction, with the least-scoring heads) and ``retrieval`` (needle accuracy, the share of needle trials
answered, zero ablation: :func:`needle_accuracy`, a :class:`FunctionMetric` over
:mod:`~attnscope.experiments.needles`' trials). Layers and heads are 0-indexed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ..arguments import check_seed
from ..capture.attention import Intervention
from ..capture.extract import as_loaded
from ..capture.running import check_attention_function
from ..errors import AttnscopeError
from ..models.loading import LoadedModel
from .interventions import HeadAblation, SinkWindow, attention_shape, head_output_means
from .metrics import DocumentLoss, RepeatedHalfLoss, Task
from .needles import MAX_NEW_TOKENS, NeedlePrompt, run_trials, trial_prompts
from .sweeps import bootstrap_deltas, evaluate_under

KS = (1, 3, 10)
DRAWS = 5
Head = tuple[int, int]  # (layer, head), 0-indexed


# ---- which heads --------------------------------------------------------------------------------------
def head_sets(scores: np.ndarray, ks: Sequence[int], draws: int, rng: np.random.Generator, least: bool = False
              ) -> dict[str, list[Head]]:
    """The heads to mask together, ``{name: [(layer, head), ...]}``: ``top k`` (highest ``scores`` ``[layer,
    head]`` first, ties by position), ``random k #d`` for each k and draw, and with ``least`` ``bottom k``. Heads
    whose score is NaN (not scored) are never chosen."""
    n_heads = scores.shape[1]
    flat = np.ravel(scores)
    eligible = np.flatnonzero(np.isfinite(flat))
    named = lambda indices: [(int(i) // n_heads, int(i) % n_heads) for i in indices]
    order = eligible[np.argsort(-flat[eligible], kind="stable")]
    sets = {f"top {k}": named(order[:k]) for k in ks}
    if least:
        sets.update({f"bottom {k}": named(order[::-1][:k]) for k in ks})
    for k in ks:
        for draw in range(draws):
            sets[f"random {k} #{draw}"] = named(sorted(rng.choice(eligible, size=k, replace=False)))
    return sets


def by_layer(heads: Sequence[Head]) -> dict[int, list[int]]:
    """``{layer: [head, ...]}`` of ``heads``."""
    grouped: dict[int, list[int]] = {}
    for layer, head in heads:
        grouped.setdefault(layer, []).append(head)
    return grouped


# ---- how they are masked ---------------------------------------------------------------------------------
class Masking(Protocol):
    """Turns a set of heads into the interventions that switch them off; ``kind``: the attention they act on."""

    kind: str

    def describe(self) -> str: ...

    def prepare(self, loaded: LoadedModel, task: Task) -> None: ...

    def __call__(self, heads: Sequence[Head]) -> list[Intervention]: ...


@dataclass
class AblationMasking:
    """Ablate the heads in ``mode`` (:func:`~.interventions.ablation_modes`; default ``zero``, see the module
    docstring); ``mean`` uses ``means`` or the head outputs averaged over the task's batches."""

    mode: str = "zero"
    kind: str = "self"
    means: Mapping[tuple[str, int], torch.Tensor] | None = None

    def describe(self) -> str:
        return f"{self.mode} ablation of each head's output (before the output projection), per query head"

    def prepare(self, loaded: LoadedModel, task: Task) -> None:
        if self.mode == "mean" and self.means is None:
            self.means = head_output_means(loaded, (task.reference_inputs(batch) for batch in task.batches),
                                           [self.kind])
        HeadAblation(self.mode, means=self.means)  # a bad mode fails now, not after the intact run

    def __call__(self, heads: Sequence[Head]) -> list[Intervention]:
        return [HeadAblation(self.mode, layers=[layer], heads=chosen, kinds=[self.kind], means=self.means)
                for layer, chosen in by_layer(heads).items()]


@dataclass
class WindowMasking:
    """Restrict the heads to the first ``sink`` keys and the ``window`` most recent (:class:`~.interventions.SinkWindow`)."""

    sink: int = 4
    window: int = 64
    kind: str = "self"

    def describe(self) -> str:
        return (f"each head restricted to the first {self.sink} keys and the {self.window} most recent (a mask "
                "before the softmax, over the model's own), per query head")

    def __post_init__(self) -> None:
        SinkWindow({}, self.sink, self.window, self.kind)  # bad sizes fail now, before the metric's data is built

    def prepare(self, loaded: LoadedModel, task: Task) -> None:
        pass

    def __call__(self, heads: Sequence[Head]) -> list[Intervention]:
        return [SinkWindow(by_layer(heads), self.sink, self.window, self.kind)]


# ---- metrics without batches ---------------------------------------------------------------------------
class FunctionMetric(Task):
    """A metric measured by a function of the model, ``fn(loaded) -> [example]`` values (e.g. needle trials'
    correctness, 1 or 0), run under whatever interventions are active; the metric is their mean."""

    def __init__(self, loaded: LoadedModel, fn: Callable[[LoadedModel], Any], name: str = "custom",
                 higher_is_better: bool = True) -> None:
        super().__init__(loaded, [])
        self.fn, self.name, self.higher_is_better = fn, name, higher_is_better

    def evaluate_all(self, loaded: LoadedModel | None = None) -> np.ndarray:
        with torch.inference_mode():
            values = np.asarray(self.fn(loaded or self.loaded), dtype=np.float64)
        if values.ndim != 1 or not len(values):
            raise AttnscopeError(f"metric {self.name!r} must return one value per example, got shape {values.shape}")
        return values[:, None]


# ---- the check ---------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class MaskingCheck:
    """The metric on the intact model and under each set of masked heads.

    ``base`` ``[example, column]`` and ``stats`` ``[set, example, column]`` are the metric's per-example
    statistics, ``sets`` the masked heads of each set (in ``stats``' order); :meth:`summary` gives the changes
    with intervals. Layers and heads are 0-indexed."""

    model: str
    score: str
    metric: str
    higher_is_better: bool
    masking: str
    ks: tuple[int, ...]
    draws: int
    baseline: float
    sets: dict[str, list[Head]]
    base: np.ndarray = field(repr=False)
    stats: np.ndarray = field(repr=False)
    task: Task = field(repr=False)
    n_resamples: int = 1000
    seed: int = 0

    def contrasts(self) -> tuple[list[tuple[int, str]], np.ndarray]:
        """The rows of the summary, ``[(k, heads)]`` (``top``, ``random``, ``bottom``, ``top - random``,
        ``bottom - random``), and their weights over the sets ``[row, set]``."""
        names = list(self.sets)
        rows: list[tuple[int, str]] = []
        weights: list[np.ndarray] = []
        for k in self.ks:
            single = {which: self._weights(names, [f"{which} {k}"]) for which in ("top", "bottom")
                      if f"{which} {k}" in self.sets}
            random = self._weights(names, [f"random {k} #{d}" for d in range(self.draws)])
            combined = {**single, "random": random, **{f"{which} - random": w - random for which, w in single.items()}}
            for which, row in combined.items():
                rows.append((k, which))
                weights.append(row)
        return rows, np.stack(weights)

    @staticmethod
    def _weights(names: list[str], chosen: list[str]) -> np.ndarray:
        row = np.zeros(len(names))
        row[[names.index(name) for name in chosen]] = 1.0 / len(chosen)
        return row

    def summary(self) -> list[dict[str, Any]]:
        """One dict per (k, heads): the change of the metric (masked - intact; for ``random``, the mean over the
        draws) and its bootstrap 95% interval (NaN bounds without resamples)."""
        rows, weights = self.contrasts()
        change, low, high = bootstrap_deltas(self.task, self.base, self.stats, self.n_resamples, self.seed, weights)
        masked = self.task.summarise(self.stats)  # [set]
        return [{"k": k, "heads": which, "change": float(c), "ci_low": float(lo), "ci_high": float(hi),
                 "value": float(self.baseline + c) if " - " not in which else float("nan"),
                 "sets": [self.sets[name] for name, w in zip(self.sets, row) if w > 0] if " - " not in which else [],
                 "set_changes": [float(v - self.baseline) for v, w in zip(masked, row) if w > 0]
                 if " - " not in which else []}
                for (k, which), c, lo, hi, row in zip(rows, change, low, high, weights)]

    def to_frame(self) -> Any:
        """One row per (k, heads): score, metric, baseline, masked value, change and interval, the heads masked
        (``layer.head``, 0-indexed; the random draws' sets joined by ``|``)."""
        import pandas as pd

        rows = []
        for row in self.summary():
            sets = " | ".join(" ".join(f"{layer}.{head}" for layer, head in heads) for heads in row["sets"])
            rows.append({"score": self.score, "metric": self.metric, "k": row["k"], "heads": row["heads"],
                         "baseline": self.baseline, "value": row["value"], "change": row["change"],
                         "ci_low": row["ci_low"], "ci_high": row["ci_high"], "masked": sets})
        return pd.DataFrame(rows)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the settings, the summary, each set's heads."""
        return {"model": self.model, "score": self.score, "metric": self.metric,
                "higher_is_better": self.higher_is_better, "masking": self.masking, "ks": list(self.ks),
                "random_draws": self.draws, "n_examples": int(self.base.shape[0]), "baseline": self.baseline,
                "change": "metric with the heads masked - intact metric", "indexing": "layers and heads are 0-indexed",
                "intervals": "paired percentile bootstrap 95% over the metric's examples",
                "summary": [{key: value for key, value in row.items() if key != "sets"} for row in self.summary()],
                "sets": {name: [list(head) for head in heads] for name, heads in self.sets.items()}}

    def _repr_html_(self) -> str:
        return str(self.to_frame().to_html(index=False, float_format=lambda v: f"{v:.4g}"))


def check_heads(model: LoadedModel | str, scores: np.ndarray, task: Task, *, masking: Masking | None = None,
                score: str = "score", ks: Sequence[int] = KS, draws: int = DRAWS, least: bool = False,
                n_resamples: int = 1000, seed: int = 0, progress: bool = False) -> MaskingCheck:
    """Mask the top-k heads by ``scores`` ``[layer, head]`` (higher = more of the function), k random heads
    (``draws`` seeded draws) and, with ``least``, the bottom k, for each k in ``ks``, and measure ``task``
    (see the module docstring). ``masking``: default zero ablation."""
    loaded = as_loaded(model)
    masking = masking or AblationMasking()
    scores = check_scores(loaded, scores, masking.kind, ks, draws, least)
    check_seed(seed, "seed")
    check_attention_function(loaded.sites)
    masking.prepare(loaded, task)
    sets = head_sets(scores, ks, draws, np.random.default_rng(seed), least)
    base, stats = evaluate_under(loaded, task, [masking(heads) for heads in sets.values()], progress, "masking heads")
    if n_resamples and base.shape[0] < 2:
        raise AttnscopeError(f"a bootstrap interval needs at least 2 examples and the metric gave {base.shape[0]}")
    return MaskingCheck(loaded.name, score, task.name, task.higher_is_better, masking.describe(), tuple(ks), draws,
                        float(task.summarise(base)), sets, base, stats, task, n_resamples, seed)


def check_scores(loaded: LoadedModel, scores: np.ndarray, kind: str, ks: Sequence[int], draws: int,
                 least: bool) -> np.ndarray:
    """``scores`` as float ``[layer, head]`` if they fit attention ``kind`` of ``loaded`` and every k leaves room
    for random draws; else one error line."""
    _, n_layers, n_heads = attention_shape(loaded, kind)
    scores = np.asarray(scores, dtype=np.float64)
    if scores.shape != (n_layers, n_heads):
        raise AttnscopeError(f"scores must be [layer, head] = ({n_layers}, {n_heads}) for {loaded.name}, got shape "
                             f"{scores.shape}")
    n_scored = int(np.isfinite(scores).sum())
    if not ks or any(not 1 <= k <= n_scored for k in ks):
        raise AttnscopeError(f"each k must be within 1..{n_scored} (the scored heads of {loaded.name}), got "
                             f"{list(ks)}")
    if draws < 1:
        raise AttnscopeError("the check needs at least one random draw")
    return scores


# ---- checks by score name --------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckSpec:
    """How the score ``name`` is checked: ``metric(loaded, **options) -> Task`` and ``masking(**options)``."""

    name: str
    metric: Callable[..., Task]
    masking: Callable[..., Masking]
    least: bool = False
    description: str = ""


def _streaming_metric(loaded: LoadedModel, *, sink: int = 4, window: int = 64, **options: Any) -> Task:
    return DocumentLoss(loaded, skip=sink + window, **options)


def needle_accuracy(loaded: LoadedModel, *, prompts: Sequence[NeedlePrompt] | None = None,
                    max_new_tokens: int = MAX_NEW_TOKENS, **grid: Any) -> FunctionMetric:
    """Needle accuracy as a masking check's metric: per trial 1 if the greedy answer holds the needle's answer, else 0
    (the counting rule of :func:`~.needles.answered`), under whatever heads are masked. ``prompts`` (e.g. hand-built)
    or the grid of :func:`~.needles.trial_prompts` (``lengths``, ``depths``, ``needles``, ``document_name``,
    ``form``), built and checked now, before any run."""
    chosen = list(prompts) if prompts is not None else trial_prompts(loaded, max_new_tokens=max_new_tokens, **grid)

    def answers(model: LoadedModel) -> list[float]:
        return [float(trial.counted) for trial in run_trials(model, chosen, max_new_tokens=max_new_tokens)]

    return FunctionMetric(loaded, answers, "needle accuracy")


CHECKS: dict[str, CheckSpec] = {
    "induction": CheckSpec("induction", RepeatedHalfLoss, AblationMasking,
                           description="loss on the repeated half of repeated random tokens, heads zero-ablated"),
    "streaming": CheckSpec("streaming", _streaming_metric, WindowMasking, least=True,
                           description="loss on long documents, heads restricted to first-k + recent-w keys"),
    "retrieval": CheckSpec("retrieval", needle_accuracy, AblationMasking,
                           description="share of needle trials answered (the needle's answer in the greedy answer), "
                                       "heads zero-ablated"),
}


def register_check(name: str, metric: Callable[..., Task], masking: Callable[..., Masking] = AblationMasking,
                   least: bool = False, description: str = "") -> None:
    """Add (or replace) how score ``name`` is checked, e.g. ``retrieval`` with needle trials' accuracy:
    ``register_check("retrieval", lambda loaded, **o: FunctionMetric(loaded, run_trials, "needle accuracy"))``."""
    CHECKS[name] = CheckSpec(name, metric, masking, least, description)


def check_score(model: LoadedModel | str, name: str, scores: np.ndarray, *, ks: Sequence[int] = KS,
                draws: int = DRAWS, metric_options: Mapping[str, Any] | None = None,
                masking_options: Mapping[str, Any] | None = None, n_resamples: int = 1000, seed: int = 0,
                progress: bool = False) -> MaskingCheck:
    """The built-in check of score ``name`` (:data:`CHECKS`). Options shared by the metric and the masking (the
    streaming check's ``sink`` and ``window``) go in ``masking_options`` and reach both."""
    if name not in CHECKS:
        raise AttnscopeError(f"no masking check for score {name!r}; there are checks for {', '.join(CHECKS)}")
    spec = CHECKS[name]
    loaded = as_loaded(model)
    masking = spec.masking(**(masking_options or {}))
    check_scores(loaded, scores, masking.kind, ks, draws, spec.least)  # before the metric's data is built
    shared = {key: value for key, value in (masking_options or {}).items() if key in ("sink", "window")}
    task = spec.metric(loaded, **shared, **(metric_options or {}))
    return check_heads(loaded, scores, task, masking=masking, score=name, ks=ks, draws=draws, least=spec.least,
                       n_resamples=n_resamples, seed=seed, progress=progress)
