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

from .partial import partial_statistics
from .patterns import PATTERNS, CorpusPatterns, HeadPatterns, classify_heads, pattern_names
from .rollout import Flow, Rollout, attention_flow, attention_rollout
from .sinks import SinkReport, sink_report
from .stats import HeadStatistics, describe_statistics, head_statistics, statistic_names
from .store import HeadStore

__all__ = [
    "PATTERNS",
    "CorpusPatterns",
    "Flow",
    "HeadPatterns",
    "HeadStatistics",
    "HeadStore",
    "Rollout",
    "SinkReport",
    "attention_flow",
    "attention_rollout",
    "classify_heads",
    "describe_statistics",
    "head_statistics",
    "partial_statistics",
    "pattern_names",
    "sink_report",
    "statistic_names",
]
