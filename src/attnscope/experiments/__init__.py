"""Interventions on attention and what they cost: ablation, corruption, sublayer skipping, sweeps,
head importance and pruning. Everything acts through attnscope's one attention function.

>>> from attnscope.experiments import prepare_metric, run_sweep             # doctest: +SKIP
>>> model = attnscope.load_model("minilm")                                  # doctest: +SKIP
>>> result = run_sweep(model, prepare_metric("cosine", model), "heads")     # doctest: +SKIP
>>> result.plot("heads.png"); result.save("heads.csv")                      # doctest: +SKIP

Layers and heads are 0-indexed everywhere. Names are imported on first use (torch is not needed
for ``attnscope --help``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

# public name -> module that defines it
_EXPORTS = {
    "HeadImportance": ".importance",
    "PruningCurve": ".importance",
    "head_importance": ".importance",
    "load_pruned": ".importance",
    "masked_metric": ".importance",
    "prune_heads": ".importance",
    "pruning_curve": ".importance",
    "save_pruned": ".importance",
    "HeadAblation": ".interventions",
    "HeadGates": ".interventions",
    "ablate_heads": ".interventions",
    "ablation_modes": ".interventions",
    "corrupt_attention": ".interventions",
    "head_output_means": ".interventions",
    "pattern_names": ".interventions",
    "register_pattern": ".interventions",
    "skip_sublayers": ".interventions",
    "Batch": ".metrics",
    "Task": ".metrics",
    "default_metric": ".metrics",
    "function_metric": ".metrics",
    "list_metrics": ".metrics",
    "prepare_metric": ".metrics",
    "register_metric": ".metrics",
    "SWEEPS": ".sweeps",
    "SweepResult": ".sweeps",
    "run_sweep": ".sweeps",
    "sweep_variants": ".sweeps",
}

__all__ = [
    "SWEEPS",
    "Batch",
    "HeadAblation",
    "HeadGates",
    "HeadImportance",
    "PruningCurve",
    "SweepResult",
    "Task",
    "ablate_heads",
    "ablation_modes",
    "corrupt_attention",
    "default_metric",
    "function_metric",
    "head_importance",
    "head_output_means",
    "list_metrics",
    "load_pruned",
    "masked_metric",
    "pattern_names",
    "prepare_metric",
    "prune_heads",
    "pruning_curve",
    "register_metric",
    "register_pattern",
    "run_sweep",
    "save_pruned",
    "skip_sublayers",
    "sweep_variants",
]

if TYPE_CHECKING:
    from .importance import HeadImportance as HeadImportance
    from .importance import PruningCurve as PruningCurve
    from .importance import head_importance as head_importance
    from .importance import load_pruned as load_pruned
    from .importance import masked_metric as masked_metric
    from .importance import prune_heads as prune_heads
    from .importance import pruning_curve as pruning_curve
    from .importance import save_pruned as save_pruned
    from .interventions import HeadAblation as HeadAblation
    from .interventions import HeadGates as HeadGates
    from .interventions import ablate_heads as ablate_heads
    from .interventions import ablation_modes as ablation_modes
    from .interventions import corrupt_attention as corrupt_attention
    from .interventions import head_output_means as head_output_means
    from .interventions import pattern_names as pattern_names
    from .interventions import register_pattern as register_pattern
    from .interventions import skip_sublayers as skip_sublayers
    from .metrics import Batch as Batch
    from .metrics import Task as Task
    from .metrics import default_metric as default_metric
    from .metrics import function_metric as function_metric
    from .metrics import list_metrics as list_metrics
    from .metrics import prepare_metric as prepare_metric
    from .metrics import register_metric as register_metric
    from .sweeps import SWEEPS as SWEEPS
    from .sweeps import SweepResult as SweepResult
    from .sweeps import run_sweep as run_sweep
    from .sweeps import sweep_variants as sweep_variants

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
