"""The old import path of :mod:`attnscope.records.attention`, kept for code written against it."""

from __future__ import annotations

from .records.attention import AttentionRecord, ModelInfo, Selection

__all__ = ["AttentionRecord", "ModelInfo", "Selection"]
