"""Ablation sweeps: every single head, every whole layer, or "keep only one head in this layer".

One generic runner (:func:`run_sweep`) evaluates a metric under each variant and bootstraps 95%
confidence intervals of the change over examples. Two ways to get the same numbers:

* naive: one full forward pass per variant and batch;
* cached (default where the architecture allows it): the intact model runs once per batch while
  forward pre-hooks keep each block's input (hidden states and the keyword arguments the model
  passes: attention mask, rotary position embeddings, ...). The variants of layer L then run only
  blocks L..N-1 on that cached input, several variants of the layer side by side in one batch (the
  cached tensors repeated along the batch axis, each copy ablating its own heads), followed by the
  model's final modules (adapter ``final``: e.g. Llama's norm and LM head). Below L nothing is
  recomputed. The results equal the naive loop to float32 round-off (tested to 1e-5).

Encoder-decoders (and metrics that generate) always use the naive loop.
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..arguments import check_seed
from ..capture.attention import Intervention, intervene
from ..capture.hooks import local_hooks
from ..capture.running import check_attention_function
from ..errors import AttnscopeError
from ..models.adapters import find_modules
from ..models.loading import LoadedModel
from .interventions import HeadAblation, attention_shape, head_output_means, n_heads_per_kind
from .metrics import Batch, Task

SWEEPS = ("heads", "layers", "keep-one")
TOKEN_BUDGET = 1 << 12  # most (variants x batch x positions) side by side; larger groups ran slower (cache)
CONFIDENCE = 0.95
SWEEP_TITLES = {"heads": "one head ablated", "layers": "whole layer ablated",
                "keep-one": "only this head kept in its layer"}


@dataclass(frozen=True)
class Variant:
    """One intervention of a sweep: ablate ``heads`` (0-indexed) of ``layer``; shown in cell ``(layer, column)``."""

    layer: int
    column: int
    heads: tuple[int, ...]


def sweep_variants(sweep: str, n_layers: int, n_heads: int, layers: Sequence[int] | None = None) -> list[Variant]:
    """``heads``: each head alone; ``layers``: all heads of each layer (column 0); ``keep-one``: all
    heads of the layer but one (Michel et al. 2019's "only one head left")."""
    if sweep not in SWEEPS:
        raise AttnscopeError(f"unknown sweep {sweep!r}; choose one of {', '.join(SWEEPS)}")
    chosen = list(range(n_layers)) if layers is None else sorted(set(layers))
    if any(not 0 <= layer < n_layers for layer in chosen):
        raise AttnscopeError(f"layers must be between 0 and {n_layers - 1} (0-indexed)")
    if sweep == "layers":
        return [Variant(layer, 0, tuple(range(n_heads))) for layer in chosen]
    if sweep == "heads":
        return [Variant(layer, head, (head,)) for layer in chosen for head in range(n_heads)]
    return [Variant(layer, head, tuple(h for h in range(n_heads) if h != head)) for layer in chosen
            for head in range(n_heads)]


@dataclass(frozen=True, eq=False)
class SweepResult:
    """Metric change per variant, ``[layer, column]`` arrays (column = head, or 0 for whole layers).

    ``delta`` = metric under the ablation minus the intact model's ``baseline``; ``ci_low``/``ci_high``
    its bootstrap 95% interval over examples; NaN where no variant ran. Layers and heads are 0-indexed.
    """

    model: str
    metric: str
    higher_is_better: bool
    sweep: str
    mode: str
    kind: str
    baseline: float
    value: np.ndarray
    delta: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray
    n_examples: int
    n_resamples: int
    cached: bool
    seconds: float
    notes: tuple[str, ...] = ()
    variant_stats: np.ndarray | None = field(default=None, repr=False)  # [variant, example, column]

    @property
    def significant(self) -> np.ndarray:
        """True where the 95% interval excludes 0."""
        with np.errstate(invalid="ignore"):
            return (self.ci_low > 0) | (self.ci_high < 0)

    @property
    def n_layers(self) -> int:
        return int(self.delta.shape[0])

    def extremes(self) -> dict[str, tuple[int, int]]:
        """The measured cells ``(layer, column)`` whose ablation hurt (``"worst"``) and helped (``"best"``,
        or hurt least) the metric most, whatever its direction. Cells no variant ran (NaN) are never
        chosen: filled with 0 they would beat every head that hurts."""
        measured = np.isfinite(self.delta)
        if not measured.any():
            raise AttnscopeError("no variant of the sweep was measured")
        better = (self.delta if self.higher_is_better else -self.delta)[measured]  # > 0: the ablation helped
        cells = [(int(layer), int(column)) for layer, column in zip(*np.nonzero(measured))]
        return {"worst": cells[int(np.argmin(better))], "best": cells[int(np.argmax(better))]}

    def to_frame(self) -> Any:
        """One row per variant: layer, head (-1 = the whole layer), metric value, change and interval."""
        import pandas as pd

        rows = []
        for layer, column in zip(*np.nonzero(~np.isnan(self.delta))):
            rows.append({"layer": int(layer), "head": -1 if self.sweep == "layers" else int(column),
                         "sweep": self.sweep, "mode": self.mode, "kind": self.kind, "metric": self.metric,
                         "baseline": self.baseline, "value": float(self.value[layer, column]),
                         "delta": float(self.delta[layer, column]), "ci_low": float(self.ci_low[layer, column]),
                         "ci_high": float(self.ci_high[layer, column]),
                         "significant": bool(self.significant[layer, column])})
        return pd.DataFrame(rows)

    def save(self, path: str | Path) -> Path:
        """The table as ``.csv``, ``.parquet`` or ``.duckdb`` (table ``ablation``), by suffix."""
        from .report import write_table

        return write_table(self.to_frame(), Path(path), table="ablation")

    def plot(self, path: str | Path | None = None) -> Any:
        """Layers x heads heatmap of the metric change; ``*`` marks cells whose 95% interval excludes 0.

        Blue = the metric got better than the intact model, red = worse (whatever its direction).
        Returns the matplotlib figure (saved to ``path`` when given).
        """
        from .report import finish_figure, pyplot

        plt = pyplot()
        rows = [layer for layer in range(self.delta.shape[0]) if np.isfinite(self.delta[layer]).any()]
        rows = rows or list(range(self.delta.shape[0]))
        delta, significant = self.delta[rows], self.significant[rows]  # only the layers that were swept
        better = delta if self.higher_is_better else -delta  # > 0 means the ablation helped
        limit = float(np.nanmax(np.abs(delta))) if np.isfinite(delta).any() else 1.0
        n_rows, n_columns = delta.shape
        figure, axes = plt.subplots(figsize=(1.2 + 0.55 * n_columns + 1.6, 0.9 + 0.45 * n_rows + 1.0))
        image = axes.imshow(np.ma.masked_invalid(better), cmap="RdBu", vmin=-limit or -1, vmax=limit or 1,
                            aspect="auto")
        for row, column in zip(*np.nonzero(np.isfinite(delta))):
            star = "*" if significant[row, column] else ""
            dark = abs(delta[row, column]) > 0.6 * limit  # white text on the darkest cells
            axes.text(column, row, f"{delta[row, column]:+.3g}{star}", ha="center", va="center", fontsize=6,
                      color="white" if dark else "black")
        axes.set_xticks(range(n_columns), [str(c) for c in range(n_columns)] if self.sweep != "layers" else ["all"])
        axes.set_yticks(range(n_rows), [str(layer) for layer in rows])
        axes.set_xlabel("head (0-indexed)" if self.sweep != "layers" else "all heads of the layer")
        axes.set_ylabel("layer (0-indexed)")
        axes.set_title(f"{self.model}: change in {self.metric} ({SWEEP_TITLES[self.sweep]}, {self.mode})\n"
                       f"baseline {self.metric} = {self.baseline:.4g}, n = {self.n_examples}; "
                       f"* = 95% bootstrap CI excludes 0", fontsize=9)
        colorbar = figure.colorbar(image, ax=axes, shrink=0.8)
        colorbar.set_label(f"{self.metric} change ({'higher' if self.higher_is_better else 'lower'} is better; "
                           "blue = better)", fontsize=7)
        return finish_figure(figure, path)

    def _repr_html_(self) -> str:
        return str(self.to_frame().to_html(index=False, float_format=lambda v: f"{v:.4g}"))


# ---- the runner --------------------------------------------------------------------------------------
def run_sweep(loaded: LoadedModel, task: Task, sweep: str = "heads", *, mode: str = "zero", kind: str | None = None,
              layers: Sequence[int] | None = None, cached: bool | None = None, n_resamples: int = 1000,
              seed: int = 0, means: Mapping[tuple[str, int], torch.Tensor] | None = None,
              progress: bool = True) -> SweepResult:
    """Evaluate ``task`` with each variant of ``sweep`` ablated in ``mode`` at attention ``kind``.

    ``cached``: None = prefix caching where possible, False = the naive loop, True = require it.
    ``mode="mean"`` uses ``means`` or the head outputs averaged over the task's own batches.
    """
    check_seed(seed, "seed")
    check_attention_function(loaded.sites)
    kind, n_layers, n_heads = attention_shape(loaded, kind)
    variants = sweep_variants(sweep, n_layers, n_heads, layers)
    if n_resamples and task.n_examples < 2:
        raise AttnscopeError(f"a bootstrap interval needs at least 2 examples and the data gives {task.n_examples}: "
                             "give more (--data, -n), or --bootstrap 0 for the change without an interval")
    if mode == "mean" and means is None:
        means = head_output_means(loaded, (task.reference_inputs(batch) for batch in task.batches), [kind])
    make = lambda heads, layer: HeadAblation(mode, layers=[layer], heads=heads, kinds=[kind], means=means)
    make(torch.zeros(n_heads, dtype=torch.bool), 0)  # a bad mode fails now, not after the first forward pass
    reason = why_not_cached(loaded, task, kind)
    use_cache = reason is None if cached is None else cached
    if use_cache and reason is not None:
        raise AttnscopeError(f"prefix caching is not possible here: {reason}")
    notes = () if use_cache or cached is False else (f"naive loop: {reason}",)
    start = time.perf_counter()
    runner = run_cached if use_cache else run_naive
    base, stats = runner(loaded, task, variants, make, kind, progress)
    seconds = time.perf_counter() - start
    return summarise_sweep(loaded, task, sweep, str(mode), kind, variants, (n_layers, n_heads), base, stats,
                           n_resamples, seed, use_cache, seconds, notes)


AblationFactory = Callable[[torch.Tensor, int], HeadAblation]  # (bool [head] or [batch, head], layer)


def _heads_mask(variants: Sequence[Variant], n_heads: int) -> torch.Tensor:
    """Bool ``[variant, head]``: True = ablated."""
    mask = torch.zeros(len(variants), n_heads, dtype=torch.bool)
    for row, variant in enumerate(variants):
        mask[row, list(variant.heads)] = True
    return mask


def _progress(total: int, enabled: bool, what: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="run", desc=what, disable=not enabled)  # a run = one variant on one batch


def run_naive(loaded: LoadedModel, task: Task, variants: Sequence[Variant], make: AblationFactory, kind: str,
              progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """One full forward pass per variant and batch. Returns baseline ``[example, column]`` and
    ``[variant, example, column]`` statistics."""
    n_heads = n_heads_per_kind(loaded)[kind][1]
    masks = _heads_mask(variants, n_heads)
    return evaluate_under(loaded, task, [[make(masks[row], variant.layer)] for row, variant in enumerate(variants)],
                          progress, "ablating (naive)")


def evaluate_under(loaded: LoadedModel, task: Task, variants: Sequence[Sequence[Intervention]], progress: bool = True,
                   what: str = "evaluating") -> tuple[np.ndarray, np.ndarray]:
    """The intact model's statistics ``[example, column]`` and each variant's ``[variant, example, column]``,
    one full forward pass per variant and batch with the variant's interventions active (a task without batches,
    measured by a function of the model, once per variant)."""
    base = task.evaluate_all(loaded)
    stats = np.zeros((len(variants), *base.shape))
    with _progress(len(variants) * max(1, len(task.batches)), progress, what) as bar:
        for row, interventions in enumerate(variants):
            with intervene(*interventions):
                if not task.batches:
                    stats[row] = task.evaluate_all(loaded)
                    bar.update(1)
                for batch in task.batches:
                    stats[row, batch.index] = task.evaluate(loaded, batch)
                    bar.update(1)
    return base, stats


def why_not_cached(loaded: LoadedModel, task: Task, kind: str) -> str | None:
    """None when the sweep can reuse cached prefixes, else the reason it cannot."""
    if loaded.is_encoder_decoder:
        return "encoder-decoders run the decoder after the encoder's last layer"
    if not task.cacheable:
        return f"metric {task.name!r} does not work from the last hidden states"
    if loaded.adapter.final is None:
        return f"the adapter for {loaded.config.model_type!r} does not say which modules follow the last block"
    blocks = find_modules(loaded.model, loaded.adapter.blocks)
    if not any(k == kind for k, _ in blocks):
        return f"no transformer blocks of kind {kind!r} found"
    return None


def final_modules(loaded: LoadedModel) -> list[nn.Module]:
    """The modules applied after the last block, in the adapter's order (absent ones skipped)."""
    named = list(loaded.model.named_modules())
    found = []
    for pattern in loaded.adapter.final or ():
        match = next((module for name, module in named if re.search(pattern, name)), None)
        if match is not None:
            found.append(match)
    return found


@contextmanager
def block_inputs(blocks: Sequence[nn.Module]) -> Iterator[list[tuple[tuple[Any, ...], dict[str, Any]]]]:
    """Record each block's positional and keyword arguments during the forward passes inside (in
    this thread / async task only: other threads running the same model record nothing here)."""
    kept: list[tuple[tuple[Any, ...], dict[str, Any]]] = [((), {})] * len(blocks)
    index = {block: i for i, block in enumerate(blocks)}

    def keeper(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        kept[index[module]] = (args, dict(kwargs))

    with local_hooks(blocks, keeper, pre=True):
        yield kept


def repeat_batch(value: Any, batch: int, copies: int) -> Any:
    """Repeat every tensor whose first axis is the batch (``[batch, ...]`` -> ``[copies * batch, ...]``,
    copy-major); tuples, lists and dicts are walked; anything else (1-D positions, None) passes."""
    if isinstance(value, torch.Tensor):
        if value.dim() >= 2 and value.shape[0] == batch and copies > 1:
            return value.repeat(copies, *([1] * (value.dim() - 1)))
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(repeat_batch(v, batch, copies) for v in value)
    if isinstance(value, dict):
        return {k: repeat_batch(v, batch, copies) for k, v in value.items()}
    return value


def run_blocks_from(blocks: Sequence[nn.Module], kept: Sequence[tuple[tuple[Any, ...], dict[str, Any]]], first: int,
                    batch: int, copies: int, stop: int | None = None) -> torch.Tensor:
    """Run blocks ``first..stop-1`` (default: to the last) on the cached input of block ``first``,
    ``copies`` times side by side.

    Each block gets its own recorded arguments (repeated), with the running hidden states in place
    of the recorded ones. Returns the last block's output ``[copies * batch, pos, d_model]``.
    """
    args, kwargs = kept[first]
    hidden = repeat_batch(args[0] if args else kwargs["hidden_states"], batch, copies)
    for index in range(first, len(blocks) if stop is None else stop):
        args, kwargs = kept[index]
        kwargs = repeat_batch(kwargs, batch, copies)
        if args:
            out = blocks[index](hidden, *repeat_batch(args[1:], batch, copies), **kwargs)
        else:
            out = blocks[index](**{**kwargs, "hidden_states": hidden})
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden


def run_cached(loaded: LoadedModel, task: Task, variants: Sequence[Variant], make: AblationFactory, kind: str,
               progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Prefix-cached, layer-batched sweep; same returns as :func:`run_naive`."""
    n_heads = n_heads_per_kind(loaded)[kind][1]
    by_layer = find_modules(loaded.model, loaded.adapter.blocks)
    blocks = [by_layer[(kind, layer)] for layer in sorted(layer for k, layer in by_layer if k == kind)]
    finals = final_modules(loaded)
    masks = _heads_mask(variants, n_heads)
    base = np.zeros((task.n_examples, len(task.columns)))
    stats = np.zeros((len(variants), *base.shape))
    layers = sorted({variant.layer for variant in variants})
    with _progress(len(variants) * len(task.batches), progress, "ablating (cached)") as bar, torch.inference_mode():
        for batch in task.batches:
            with block_inputs(blocks) as kept:
                base[batch.index] = task.stats(task.output(loaded, batch), batch)
            for layer in layers:
                rows = [i for i, variant in enumerate(variants) if variant.layer == layer]
                for group in _groups(rows, batch):
                    _run_group(task, batch, blocks, kept, finals, layer, group, masks, make, stats)
                    bar.update(len(group))
    return base, stats


def _groups(rows: list[int], batch: Batch) -> Iterator[list[int]]:
    """Chunks of variant rows small enough to run side by side."""
    per_variant = batch.size * int(batch.inputs["input_ids"].shape[1])
    size = max(1, TOKEN_BUDGET // max(1, per_variant))
    for start in range(0, len(rows), size):
        yield rows[start : start + size]


def _run_group(task: Task, batch: Batch, blocks: Sequence[nn.Module], kept: Any, finals: Sequence[nn.Module],
               layer: int, group: list[int], masks: torch.Tensor, make: AblationFactory, stats: np.ndarray) -> None:
    """Run the variants ``group`` of ``layer`` in one batch: row ``v * batch + b`` is variant v, example b."""
    copies = len(group)
    per_row = masks[group].repeat_interleave(batch.size, dim=0)  # [copies * batch, head]
    with intervene(make(per_row, layer)):
        hidden = run_blocks_from(blocks, kept, layer, batch.size, copies)
    for slot, row in enumerate(group):
        output = hidden[slot * batch.size : (slot + 1) * batch.size]
        for module in finals:  # e.g. final norm and LM head, per variant to bound memory
            output = module(output)
        stats[row, batch.index] = task.stats(output, batch)


# ---- statistics ------------------------------------------------------------------------------------------
BOOTSTRAP_BUDGET = 1 << 24  # most resampled statistics held at once (128 MB of float64)


def bootstrap_deltas(task: Task, base: np.ndarray, stats: np.ndarray, n_resamples: int, seed: int,
                     weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Change of the metric per variant and its paired percentile bootstrap 95% interval
    (``scipy.stats.bootstrap`` over example indices, seeded, in batches of resamples that fit
    :data:`BOOTSTRAP_BUDGET`).

    ``base`` ``[example, column]``, ``stats`` ``[variant, example, column]``; each resample draws
    the same examples for the intact model and every variant. Returns ``delta``, ``low``, ``high``
    (each ``[variant]``). With ``weights`` ``[contrast, variant]`` they are of the weighted sums of the
    variants' changes instead (``[contrast]``; e.g. the mean over random draws, or top minus random),
    each resample's sums taken on that resample's changes.
    """
    from scipy.stats import DegenerateDataWarning, bootstrap

    combine = (lambda changes: changes) if weights is None else (lambda changes: weights @ changes)
    delta = combine(task.summarise(stats) - task.summarise(base))
    if n_resamples < 1:
        nan = np.full(len(delta), np.nan)
        return delta, nan, nan

    def changes(index: np.ndarray, axis: int = -1) -> np.ndarray:
        """``[resample, example]`` indices -> metric change ``[variant, resample]``.

        One variant at a time, laid out as the base is, so a variant equal to the base changes by
        exactly 0 (summed in another layout it could be off by 1e-17, and "significant")."""
        return combine(np.stack([task.summarise(variant[index]) for variant in stats]) - task.summarise(base[index]))

    batch = max(1, BOOTSTRAP_BUDGET // max(1, stats[:, :1].size * base.shape[0]))
    with warnings.catch_warnings():  # a metric that is NaN on some resamples gives a NaN bound, as before
        warnings.simplefilter("ignore", DegenerateDataWarning)
        interval = bootstrap((np.arange(base.shape[0]),), changes, n_resamples=n_resamples, batch=batch,
                             vectorized=True, confidence_level=CONFIDENCE, method="percentile",
                             rng=np.random.default_rng(seed)).confidence_interval
    return delta, interval.low, interval.high


def summarise_sweep(loaded: LoadedModel, task: Task, sweep: str, mode: str, kind: str, variants: Sequence[Variant],
                    shape: tuple[int, int], base: np.ndarray, stats: np.ndarray, n_resamples: int, seed: int,
                    cached: bool, seconds: float, notes: tuple[str, ...]) -> SweepResult:
    delta, low, high = bootstrap_deltas(task, base, stats, n_resamples, seed)
    columns = 1 if sweep == "layers" else shape[1]
    grids = [np.full((shape[0], columns), np.nan) for _ in range(4)]
    values = task.summarise(stats)
    for row, variant in enumerate(variants):
        for grid, source in zip(grids, (values, delta, low, high)):
            grid[variant.layer, variant.column] = source[row]
    value, change, ci_low, ci_high = grids
    return SweepResult(loaded.name, task.name, task.higher_is_better, sweep, mode, kind, float(task.summarise(base)),
                       value, change, ci_low, ci_high, n_examples=base.shape[0], n_resamples=n_resamples,
                       cached=cached, seconds=seconds, notes=notes, variant_stats=stats)
