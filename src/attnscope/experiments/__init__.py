"""Interventions on attention and what they cost: ablation, corruption, sublayer skipping, sweeps,
head importance and pruning; what heads do to the prediction: activation patching, its estimate from
gradients (AtP, AtP*) and whether direct logit attribution (``attnscope.attribution``, the floor below) is
faithful. Everything acts through attnscope's
one attention function.

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


if TYPE_CHECKING:
    from .atp import AtPResult as AtPResult
    from .atp import attribution_patching as attribution_patching
    from .atp import verify_estimates as verify_estimates
    from .head_masking import AblationMasking as AblationMasking
    from .head_masking import FunctionMetric as FunctionMetric
    from .head_masking import MaskingCheck as MaskingCheck
    from .head_masking import WindowMasking as WindowMasking
    from .head_masking import check_heads as check_heads
    from .head_masking import check_score as check_score
    from .head_masking import register_check as register_check
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
    from .interventions import SinkWindow as SinkWindow
    from .interventions import ablate_heads as ablate_heads
    from .interventions import ablation_modes as ablation_modes
    from .interventions import corrupt_attention as corrupt_attention
    from .interventions import head_output_means as head_output_means
    from .interventions import pattern_names as pattern_names
    from .interventions import register_pattern as register_pattern
    from .interventions import skip_sublayers as skip_sublayers
    from .kv_curve import CurveSettings as CurveSettings
    from .kv_curve import KVCurve as KVCurve
    from .kv_curve import kv_budget_curve as kv_budget_curve
    from .metrics import Batch as Batch
    from .metrics import DocumentLoss as DocumentLoss
    from .metrics import RepeatedHalfLoss as RepeatedHalfLoss
    from .metrics import Task as Task
    from .metrics import default_metric as default_metric
    from .metrics import function_metric as function_metric
    from .metrics import list_metrics as list_metrics
    from .metrics import prepare_metric as prepare_metric
    from .metrics import register_metric as register_metric
    from .needles import NeedlePrompt as NeedlePrompt
    from .needles import NeedleTrials as NeedleTrials
    from .needles import needle_prompt as needle_prompt
    from .needles import needle_trials as needle_trials
    from .patching import PatchHeads as PatchHeads
    from .patching import PatchingResult as PatchingResult
    from .patching import PromptPair as PromptPair
    from .patching import activation_patching as activation_patching
    from .sweeps import SWEEPS as SWEEPS
    from .sweeps import SweepResult as SweepResult
    from .sweeps import run_sweep as run_sweep
    from .sweeps import sweep_variants as sweep_variants

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
