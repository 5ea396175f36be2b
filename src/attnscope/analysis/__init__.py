"""Head analysis on attention records: statistics, pattern classification, rollout and flow, sinks.

Everything here takes records (or arrays), never a model (corpus jobs, which load one, are
:mod:`attnscope.corpus`). Layers and heads are 0-indexed.

>>> from attnscope.analysis import classify_heads, head_statistics, attention_flow   # doctest: +SKIP
>>> rec = attnscope.extract("minilm", "I went to the store.", "At the store, I bought fresh strawberries.",
...                         norms=True)                                              # doctest: +SKIP
>>> print(classify_heads(rec))                # a label and a confidence per head    # doctest: +SKIP
>>> head_statistics(rec)["norm_sep"]          # [layer, head]                        # doctest: +SKIP
>>> attention_flow(rec).values                # [output token, input token]          # doctest: +SKIP
>>> print(sink_report([rec]).to_text())       # first-token and other sink shares     # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .partial import partial_statistics as partial_statistics
    from .patterns import PATTERNS as PATTERNS
    from .patterns import CorpusPatterns as CorpusPatterns
    from .patterns import HeadPatterns as HeadPatterns
    from .patterns import classify_heads as classify_heads
    from .patterns import pattern_names as pattern_names
    from .retrieval import retrieval_score as retrieval_score
    from .rollout import Flow as Flow
    from .rollout import Rollout as Rollout
    from .rollout import attention_flow as attention_flow
    from .rollout import attention_rollout as attention_rollout
    from .sinks import SinkReport as SinkReport
    from .sinks import sink_report as sink_report
    from .stats import HeadStatistics as HeadStatistics
    from .stats import describe_statistics as describe_statistics
    from .stats import head_statistics as head_statistics
    from .stats import statistic_names as statistic_names
    from .store import HeadStore as HeadStore

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
