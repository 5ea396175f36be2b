"""Corpus-scale head analysis: read a corpus, capture it with a model, aggregate every head's
statistics and patterns, and write the report (``heads.duckdb``, figures, ``report.html`` with a
head view per finding).

A job of its own floor, above the views: it loads models and runs capture (``engines``: the
local engine and the Ray engine of ``distributed``/``ray_engine``), measures records with
:mod:`attnscope.analysis`, and draws with :mod:`attnscope.present`. Layers and heads are 0-indexed.

>>> from attnscope.corpus import analyze_heads                                  # doctest: +SKIP
>>> report = analyze_heads("brown", "heads-out", model="minilm", limit=300)      # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .engine_choice import ENGINES as ENGINES
    from .engine_choice import Engine as Engine
    from .engines import analyze_heads as analyze_heads
    from .engines import corpus_sinks as corpus_sinks
    from .report import CorpusReport as CorpusReport
    from .report import analyze_corpus as analyze_corpus
    from .report import corpus_items as corpus_items
    from .report import head_rows as head_rows
    from .report import read_corpus as read_corpus

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
