"""attnscope: what does this transformer's attention actually look at?

>>> import attnscope
>>> model = attnscope.load_model("minilm")                        # doctest: +SKIP
>>> rec = attnscope.extract(model, "I went to the store.", "At the store, I bought fresh strawberries.")
>>> rec.attention.shape                                           # [layer, head, q_pos, k_pos]  # doctest: +SKIP
(6, 12, 19, 19)

Names are imported on first use, so ``attnscope --help`` does not pay for importing torch.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from ._lazy import lazy_exports
from .version import __version__ as __version__

# each public name once: the imports below, served on first use (``_lazy``)
if TYPE_CHECKING:
    from .analysis.head_functions import HeadScores as HeadScores
    from .analysis.mixing import Mixing as Mixing
    from .analysis.partial import partial_statistics as partial_statistics
    from .analysis.patterns import classify_heads as classify_heads
    from .analysis.rollout import attention_flow as attention_flow
    from .analysis.rollout import attention_rollout as attention_rollout
    from .analysis.sentences import ReceiverHeads as ReceiverHeads
    from .analysis.sentences import SentenceAttention as SentenceAttention
    from .analysis.sentences import Sentences as Sentences
    from .analysis.sentences import sentence_attention as sentence_attention
    from .analysis.sentences import split_sentences as split_sentences
    from .analysis.stats import head_statistics as head_statistics
    from .attribution.dla import direct_logit_attribution as direct_logit_attribution
    from .attribution.dla import logit_lens as logit_lens
    from .attribution.qk import qk_attribution as qk_attribution
    from .attribution.routes import Routes as Routes
    from .attribution.routes import routes as routes
    from .capture.attention import Intervention as Intervention
    from .capture.attention import capture_attention as capture_attention
    from .capture.attention import intervene as intervene
    from .capture.extract import extract as extract
    from .capture.extract import extract_corpus as extract_corpus
    from .capture.extract import extract_to_file as extract_to_file
    from .capture.generate import generate as generate
    from .capture.loading import load_model as load_model
    from .capture.plan import CapturePlan as CapturePlan
    from .capture.plan import QuerySelection as QuerySelection
    from .errors import AttnscopeError as AttnscopeError
    from .experiments.head_functions import HeadScoreSettings as HeadScoreSettings
    from .experiments.head_functions import head_scores as head_scores
    from .experiments.mixing import mixing as mixing
    from .experiments.patching import activation_patching as activation_patching
    from .experiments.sentences import SuppressionResult as SuppressionResult
    from .experiments.sentences import capture_sentence_attention as capture_sentence_attention
    from .experiments.sentences import sentence_suppression as sentence_suppression
    from .models.loading import LoadedModel as LoadedModel
    from .models.registry import ALIASES as ALIASES
    from .models.registry import DEFAULT_MODEL as DEFAULT_MODEL
    from .present.html import AttentionView as AttentionView
    from .present.html import view as view
    from .present.longview import long_view as long_view
    from .present.steps import steps_view as steps_view
    from .present.widget import AttentionWidget as AttentionWidget
    from .present.widget import widget as widget
    from .records import AttentionRecord as AttentionRecord
    from .records import GenerationRecord as GenerationRecord
    from .records import ModelInfo as ModelInfo
    from .report import TopAttention as TopAttention
    from .report import top_attention as top_attention
    from .text_view import view_text as view_text

# the widget needs the notebook extra, and `from attnscope import *` must work without it
__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__, not_starred={"AttentionWidget", "widget"},
                                             also={"__version__"})


def _generation_html(gen: GenerationRecord) -> str:
    from .present.steps import steps_view

    return steps_view(gen).fragment()


def _draw_records_in_notebooks() -> None:
    """In a notebook, a :class:`GenerationRecord` shows as its step view. Records do not know their
    views, so the view is handed to IPython's HTML formatter here, by the class's name (the record
    module is not imported for it, nor the views until something is drawn)."""
    ipython: Any = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None:
        html = shell.display_formatter.formatters["text/html"]
        html.for_type_by_name("attnscope.records.generation", "GenerationRecord", _generation_html)


_draw_records_in_notebooks()
