"""attnscope: what does this transformer's attention actually look at?

>>> import attnscope
>>> model = attnscope.load_model("minilm")                        # doctest: +SKIP
>>> rec = attnscope.extract(model, "I went to the store.", "At the store, I bought fresh strawberries.")
>>> rec.attention.shape                                           # [layer, head, q_pos, k_pos]  # doctest: +SKIP
(6, 12, 19, 19)

Names are imported on first use, so ``attnscope --help`` does not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "ALIASES": "attnscope.models.registry",
    "DEFAULT_MODEL": "attnscope.models.registry",
    "AttentionRecord": "attnscope.record",
    "ModelInfo": "attnscope.record",
    "AttnscopeError": "attnscope.errors",
    "LoadedModel": "attnscope.models.loading",
    "load_model": "attnscope.models.loading",
    "capture_attention": "attnscope.capture.attention",
    "intervene": "attnscope.capture.attention",
    "Intervention": "attnscope.capture.attention",
    "extract": "attnscope.capture.extract",
    "extract_corpus": "attnscope.capture.extract",
    "extract_to_file": "attnscope.capture.extract",
    "CapturePlan": "attnscope.capture.plan",
    "generate": "attnscope.capture.generate",
    "GenerationRecord": "attnscope.generation",
    "QuerySelection": "attnscope.capture.plan",
    "partial_statistics": "attnscope.analysis.partial",
    "long_view": "attnscope.present.longview",
    "TopAttention": "attnscope.report",
    "view": "attnscope.present.html",
    "view_text": "attnscope.present.html",
    "AttentionView": "attnscope.present.html",
    # not in __all__: they need the notebook extra, and `from attnscope import *` must work without it
    "widget": "attnscope.present.widget",
    "AttentionWidget": "attnscope.present.widget",
    "classify_heads": "attnscope.analysis.patterns",
    "head_statistics": "attnscope.analysis.stats",
    "attention_rollout": "attnscope.analysis.rollout",
    "attention_flow": "attnscope.analysis.rollout",
    "mixing": "attnscope.experiments.mixing",
    "Mixing": "attnscope.analysis.mixing",
    "top_attention": "attnscope.report",
}

__all__ = [
    "ALIASES",
    "DEFAULT_MODEL",
    "AttentionRecord",
    "AttentionView",
    "AttnscopeError",
    "CapturePlan",
    "GenerationRecord",
    "Intervention",
    "LoadedModel",
    "Mixing",
    "ModelInfo",
    "QuerySelection",
    "TopAttention",
    "__version__",
    "attention_flow",
    "attention_rollout",
    "capture_attention",
    "classify_heads",
    "extract",
    "extract_corpus",
    "extract_to_file",
    "generate",
    "head_statistics",
    "intervene",
    "load_model",
    "long_view",
    "mixing",
    "partial_statistics",
    "top_attention",
    "view",
    "view_text",
]

if TYPE_CHECKING:
    from .analysis.mixing import Mixing as Mixing
    from .analysis.partial import partial_statistics as partial_statistics
    from .analysis.patterns import classify_heads as classify_heads
    from .analysis.rollout import attention_flow as attention_flow
    from .analysis.rollout import attention_rollout as attention_rollout
    from .analysis.stats import head_statistics as head_statistics
    from .capture.attention import Intervention as Intervention
    from .capture.attention import capture_attention as capture_attention
    from .capture.attention import intervene as intervene
    from .capture.extract import extract as extract
    from .capture.extract import extract_corpus as extract_corpus
    from .capture.extract import extract_to_file as extract_to_file
    from .capture.generate import generate as generate
    from .capture.plan import CapturePlan as CapturePlan
    from .capture.plan import QuerySelection as QuerySelection
    from .errors import AttnscopeError as AttnscopeError
    from .experiments.mixing import mixing as mixing
    from .generation import GenerationRecord as GenerationRecord
    from .models.loading import LoadedModel as LoadedModel
    from .models.loading import load_model as load_model
    from .models.registry import ALIASES as ALIASES
    from .models.registry import DEFAULT_MODEL as DEFAULT_MODEL
    from .present.html import AttentionView as AttentionView
    from .present.html import view as view
    from .present.html import view_text as view_text
    from .present.longview import long_view as long_view
    from .present.widget import AttentionWidget as AttentionWidget
    from .present.widget import widget as widget
    from .record import AttentionRecord as AttentionRecord
    from .record import ModelInfo as ModelInfo
    from .report import TopAttention as TopAttention
    from .report import top_attention as top_attention


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
