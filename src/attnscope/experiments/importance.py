"""Head importance (Michel et al. 2019), the iterative pruning curve, and physical head pruning.

* :func:`head_importance`: a gate xi_h = 1 multiplies each head's output (through the attention
  function); importance I_h = mean over batches of |dL/dxi_h| for the metric's loss L, then
  normalised per layer by the L2 norm over its heads, as in Michel et al. 2019 (section 4.1).
* :func:`pruning_curve`: repeatedly recompute importance with the heads pruned so far masked,
  prune the least important remaining heads (10% of all heads per step) and measure the metric.
  The last head of a layer is never pruned, so every step can also be pruned physically.
* :func:`prune_heads`: slice the query/key/value rows and output-projection columns of removed
  heads (adapter ``projections``), giving a smaller model whose outputs equal the masked model's.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..capture.attention import intervene
from ..capture.loading import load_model
from ..capture.running import check_attention_function
from ..errors import AttnscopeError
from ..models.adapters import AttentionSite, HeadProjections, find_sites
from ..models.loading import LoadedModel
from .interventions import HeadGates, n_heads_per_kind
from .metrics import Task

PRUNED_HEADS_FILE = "attnscope_pruned_heads.json"

Masks = dict[str, torch.Tensor]  # attention kind -> float [layer, head]: 1 = kept, 0 = pruned


def full_masks(loaded: LoadedModel) -> Masks:
    """All heads kept, for every attention kind of the model."""
    return {kind: torch.ones(shape) for kind, shape in n_heads_per_kind(loaded).items()}


@contextmanager
def _frozen_parameters(model: nn.Module) -> Iterator[None]:
    """No parameter gradients while inside (only the gates need them); restored on exit."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for parameter, _ in flags:
            parameter.requires_grad_(False)
        yield
    finally:
        for parameter, flag in flags:
            parameter.requires_grad_(flag)


@dataclass(frozen=True, eq=False)
class HeadImportance:
    """``scores[kind]``: ``[layer, head]`` importance (normalised per layer unless ``normalised`` is False)."""

    model: str
    metric: str
    scores: dict[str, np.ndarray]
    normalised: bool

    def to_frame(self) -> Any:
        import pandas as pd

        return pd.DataFrame([{"kind": kind, "layer": layer, "head": head, "importance": float(grid[layer, head])}
                             for kind, grid in self.scores.items() for layer, head in np.ndindex(*grid.shape)])


def head_importance(loaded: LoadedModel, task: Task, masks: Masks | None = None, *, normalise: bool = True,
                    progress: bool = False) -> HeadImportance:
    """Michel et al. 2019 head importance: mean |d loss / d gate| over the task's batches.

    ``masks`` (default all ones) are the gates' values, so already-pruned heads stay pruned.
    Model parameters get no gradients; the model is left as it was.
    """
    from tqdm.auto import tqdm

    check_attention_function(loaded.sites)
    values = masks if masks is not None else full_masks(loaded)
    total = {kind: torch.zeros_like(mask) for kind, mask in values.items()}
    with _frozen_parameters(loaded.model), torch.enable_grad():
        for batch in tqdm(task.batches, desc="head importance", unit="batch", disable=not progress):
            gates = {kind: mask.clone().requires_grad_(True) for kind, mask in values.items()}
            with intervene(HeadGates(gates)):
                loss = task.loss(loaded, batch)
            loss.backward()
            for kind, gate in gates.items():
                total[kind] += gate.grad.abs() if gate.grad is not None else 0
    scores = {kind: (grid / len(task.batches)).numpy() for kind, grid in total.items()}
    if normalise:
        scores = {kind: grid / np.maximum(np.linalg.norm(grid, axis=1, keepdims=True), 1e-20)
                  for kind, grid in scores.items()}
    return HeadImportance(loaded.name, task.name, scores, normalise)


def masked_metric(loaded: LoadedModel, task: Task, masks: Masks) -> float:
    """The metric with the heads where ``masks`` is 0 removed (their outputs zeroed)."""
    check_attention_function(loaded.sites)
    with intervene(HeadGates(masks)):
        return float(task.summarise(task.evaluate_all(loaded)))


@dataclass(frozen=True, eq=False)
class PruningCurve:
    """Metric against the share of heads pruned; ``masks[i]`` are the gates after step i (0 = pruned)."""

    model: str
    metric: str
    higher_is_better: bool
    percent: list[float]
    pruned: list[int]
    values: list[float]
    masks: list[Masks]
    total_heads: int
    label: str = ""  # the metric's axis label

    def to_frame(self) -> Any:
        import pandas as pd

        return pd.DataFrame({"percent_pruned": self.percent, "heads_pruned": self.pruned,
                             "metric": [self.metric] * len(self.values), "value": self.values})

    def plot(self, path: str | Path | None = None) -> Any:
        """Metric against the share of heads pruned (Michel et al. 2019's figure)."""
        from .report import finish_figure, pyplot

        plt = pyplot()
        figure, axes = plt.subplots(figsize=(5.5, 3.6))
        axes.plot(self.percent, self.values, marker="o")
        axes.axhline(self.values[0], color="grey", linestyle=":", linewidth=1, label="intact model")
        axes.set_xlabel(f"% of the {self.total_heads} heads pruned (by importance, recomputed each step)")
        axes.set_ylabel(self.label or self.metric)
        axes.set_title(f"{self.model}: iterative head pruning ({self.metric})", fontsize=9)
        axes.legend(fontsize=7)
        return finish_figure(figure, path)

    def step_within(self, tolerance: float = 0.01) -> int:
        """The last step whose metric is within ``tolerance`` (relative) of the intact model's."""
        base = self.values[0]
        ok = [i for i, value in enumerate(self.values)
              if (value >= base - tolerance * abs(base) if self.higher_is_better else value <= base + tolerance * abs(base))]
        return max(ok)

    def removed(self, step: int) -> dict[str, dict[int, list[int]]]:
        """``kind -> layer -> [pruned heads]`` (0-indexed) at ``step``."""
        return masks_to_removed(self.masks[step])


def masks_to_removed(masks: Masks) -> dict[str, dict[int, list[int]]]:
    return {kind: {layer: [int(h) for h in np.flatnonzero(mask[layer].numpy() == 0)]
                   for layer in range(mask.shape[0]) if (mask[layer] == 0).any()}
            for kind, mask in masks.items()}


def pruning_curve(loaded: LoadedModel, task: Task, step_percent: float = 10.0, max_percent: float = 90.0,
                  progress: bool = True) -> PruningCurve:
    """Iterative pruning (Michel et al. 2019): each step prunes ``step_percent`` of all heads, the
    least important by :func:`head_importance` recomputed with the heads pruned so far masked."""
    from tqdm.auto import tqdm

    if not 0 < step_percent <= max_percent < 100:
        raise AttnscopeError("need 0 < step percent <= max percent < 100")
    masks = full_masks(loaded)
    total = sum(int(mask.numel()) for mask in masks.values())
    curve = PruningCurve(loaded.name, task.name, task.higher_is_better, [0.0], [0], [masked_metric(loaded, task, masks)],
                         [{k: m.clone() for k, m in masks.items()}], total, task.label or task.name)
    steps = int(max_percent // step_percent)
    for step in tqdm(range(1, steps + 1), desc="pruning", unit="step", disable=not progress):
        target = round(total * step * step_percent / 100)
        importance = head_importance(loaded, task, masks).scores
        masks = _prune_least_important(masks, importance, target - curve.pruned[-1])
        pruned = total - sum(int(mask.sum()) for mask in masks.values())
        curve.percent.append(100.0 * pruned / total)
        curve.pruned.append(pruned)
        curve.values.append(masked_metric(loaded, task, masks))
        curve.masks.append({k: m.clone() for k, m in masks.items()})
    return curve


def _prune_least_important(masks: Masks, importance: Mapping[str, np.ndarray], count: int) -> Masks:
    """Set the ``count`` least important kept heads to 0, never the last kept head of a layer."""
    updated = {kind: mask.clone() for kind, mask in masks.items()}
    candidates = sorted((float(importance[kind][layer, head]), kind, layer, head)
                        for kind, mask in masks.items() for layer, head in np.ndindex(*mask.shape)
                        if mask[layer, head] > 0)
    for _, kind, layer, head in candidates:
        if count <= 0:
            break
        if int(updated[kind][layer].sum()) > 1:
            updated[kind][layer, head] = 0.0
            count -= 1
    return updated


# ---- physical pruning ----------------------------------------------------------------------------------
def physical_pruning_support(loaded: LoadedModel) -> str | None:
    """None when heads can be sliced out of ``loaded``'s weights, else why not."""
    if loaded.adapter.projections is None:
        return (f"physical pruning is not supported for {loaded.config.model_type!r} models yet (supported: "
                "BERT-like encoders and Llama-like decoders); masking works everywhere")
    return None


def _projections(loaded: LoadedModel) -> HeadProjections:
    reason = physical_pruning_support(loaded)
    if reason is not None or loaded.adapter.projections is None:
        raise AttnscopeError(reason)
    return loaded.adapter.projections


def _rows(heads: Sequence[int], d_head: int, device: torch.device) -> torch.Tensor:
    """Indices of the ``[head * d_head]`` rows of ``heads``, head-major, on the weights' ``device``."""
    return torch.tensor([h * d_head + i for h in heads for i in range(d_head)], dtype=torch.long, device=device)


def _slice_linear(linear: nn.Linear, index: torch.Tensor, dim: int) -> None:
    """Keep only ``index`` along ``dim`` of the weight (0 = outputs, 1 = inputs), in place."""
    weight = linear.weight.detach().index_select(dim, index).clone()
    linear.weight = nn.Parameter(weight, requires_grad=linear.weight.requires_grad)
    if dim == 0:
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias.detach()[index].clone(), requires_grad=linear.bias.requires_grad)
        linear.out_features = len(index)
    else:
        linear.in_features = len(index)


def _kept_kv(keep: list[int], n_heads: int, n_kv: int) -> tuple[list[int], list[int]]:
    """Key/value heads for the kept query heads, and the query heads in the order that matches them.

    Query head h uses kv head h // group. If every kv head keeps the same number of query heads
    the grouping stays; otherwise each kept query head gets its own copy of its kv head (exact,
    a little more memory).
    """
    group = n_heads // n_kv
    per_kv: dict[int, list[int]] = {}
    for head in keep:
        per_kv.setdefault(head // group, []).append(head)
    sizes = {len(heads) for heads in per_kv.values()}
    if len(sizes) == 1:
        return sorted(per_kv), [h for kv in sorted(per_kv) for h in per_kv[kv]]
    return [head // group for head in keep], list(keep)


def _linear(module: nn.Module | None, what: str) -> nn.Linear:
    if not isinstance(module, nn.Linear):
        raise AttnscopeError(f"cannot prune heads: {what} is not an nn.Linear")
    return module


def _prune_site(module: nn.Module, site: AttentionSite, keep: list[int], n_heads: int,
                facts: HeadProjections) -> None:
    query, key, value = (_linear(module.get_submodule(path), f"{site.name}.{path}")
                         for path in (facts.query, facts.key, facts.value))
    out_proj = _linear(site.out_proj, f"the output projection of {site.name}")
    d_head = query.weight.shape[0] // n_heads
    n_kv = key.weight.shape[0] // d_head
    kv_heads, keep = _kept_kv(keep, n_heads, n_kv)
    device = query.weight.device  # one attention module's weights share a device, also with device="auto"
    _slice_linear(query, _rows(keep, d_head, device), 0)
    _slice_linear(key, _rows(kv_heads, d_head, device), 0)
    _slice_linear(value, _rows(kv_heads, d_head, device), 0)
    _slice_linear(out_proj, _rows(keep, d_head, device), 1)
    counts = [(facts.head_count, len(keep)), (facts.kv_head_count, len(kv_heads)),
              (facts.group_size, len(keep) // len(kv_heads)), (facts.width, len(keep) * d_head)]
    for attributes, count in counts:
        for attribute in attributes:
            if hasattr(module, attribute):
                setattr(module, attribute, count)


def prune_heads(loaded: LoadedModel, removed: Mapping[str, Mapping[int, Sequence[int]]], *,
                inplace: bool = False) -> LoadedModel:
    """A model with the ``removed`` heads (``kind -> layer -> [head]``, 0-indexed) cut out of its weights.

    Its outputs equal the masked model's (those heads' outputs zeroed). A layer must keep at least
    one head. Returns a new :class:`LoadedModel` (a deep copy unless ``inplace``).
    """
    facts = _projections(loaded)
    shapes = n_heads_per_kind(loaded)
    model = loaded.model if inplace else copy.deepcopy(loaded.model)
    sites = find_sites(model, loaded.adapter)
    for module, site in sites.items():
        module.attnscope_site = site  # type: ignore[assignment]
        n_heads = shapes[site.kind][1]
        gone = {int(h) for h in removed.get(site.kind, {}).get(site.layer, ())}
        if any(not 0 <= h < n_heads for h in gone):
            raise AttnscopeError(f"heads to prune must be between 0 and {n_heads - 1} (0-indexed)")
        keep = [h for h in range(n_heads) if h not in gone]
        if not keep:
            raise AttnscopeError(f"cannot prune every head of {site.kind} layer {site.layer}; keep at least one")
        if gone:
            _prune_site(module, site, keep, n_heads, facts)
    return dataclasses.replace(loaded, model=model, sites=sites)


def save_pruned(loaded: LoadedModel, removed: Mapping[str, Mapping[int, Sequence[int]]], folder: str | Path) -> Path:
    """Save the model with the removed heads' weights set to zero, plus ``attnscope_pruned_heads.json``.

    The folder loads anywhere as a normal Hugging Face model (same shapes, outputs equal to the
    masked model); :func:`load_pruned` loads it and slices the heads out for the speed-up.
    """
    facts = _projections(loaded)
    folder = Path(folder)
    model = copy.deepcopy(loaded.model)
    shapes = n_heads_per_kind(loaded)
    for module, site in find_sites(model, loaded.adapter).items():
        gone = sorted(int(h) for h in removed.get(site.kind, {}).get(site.layer, ()))
        if gone:
            query = _linear(module.get_submodule(facts.query), f"{site.name}.{facts.query}")
            out_proj = _linear(site.out_proj, f"the output projection of {site.name}")
            d_head = query.weight.shape[0] // shapes[site.kind][1]
            rows = _rows(gone, d_head, query.weight.device)
            with torch.no_grad():
                out_proj.weight[:, rows] = 0.0  # the heads' contribution is gone
                query.weight[rows] = 0.0
    model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    serialisable = {kind: {str(layer): list(heads) for layer, heads in layers.items()}
                    for kind, layers in removed.items()}
    (folder / PRUNED_HEADS_FILE).write_text(json.dumps({"removed_heads": serialisable, "indexing": "0-based"},
                                                       indent=1))
    return folder


def load_pruned(folder: str | Path, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """A model saved by :func:`save_pruned`, loaded (on ``device``, see :func:`load_model`) and physically pruned."""
    path = Path(folder) / PRUNED_HEADS_FILE
    try:
        saved = json.loads(path.read_text())["removed_heads"]
    except (OSError, KeyError, json.JSONDecodeError):
        raise AttnscopeError(f"{folder} has no readable {PRUNED_HEADS_FILE}; it was not saved by attnscope prune") from None
    removed = {kind: {int(layer): heads for layer, heads in layers.items()} for kind, layers in saved.items()}
    return prune_heads(load_model(str(folder), dtype=dtype, device=device), removed, inplace=True)


def save_and_time_pruned(loaded: LoadedModel, task: Task, removed: Mapping[str, Mapping[int, Sequence[int]]],
                         folder: str | Path) -> tuple[Path, float, float]:
    """Save ``loaded`` with the ``removed`` heads pruned into ``folder`` (:func:`save_pruned`), then time a pass
    over the task's data with the full and the physically pruned model (:func:`time_forwards`): the folder, the
    full model's seconds and the pruned model's."""
    saved = save_pruned(loaded, removed, folder)
    full_s, pruned_s = time_forwards([loaded, prune_heads(loaded, removed)], task)
    return saved, full_s, pruned_s


def time_forwards(models: Sequence[LoadedModel], task: Task, repeats: int = 3) -> list[float]:
    """Best-of-``repeats`` seconds per model for one pass over all the task's batches (fused attention).

    The models take turns in every round, so a burst of load from other processes hits them alike.
    """
    best = [float("inf")] * len(models)
    with torch.inference_mode():
        for _ in range(repeats):
            for index, loaded in enumerate(models):
                start = time.perf_counter()
                for batch in task.batches:
                    task.output(loaded, batch)
                best[index] = min(best[index], time.perf_counter() - start)
    return best
