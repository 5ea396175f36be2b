"""The old import path of :mod:`attnscope.records.generation`, kept for code written against it."""

from __future__ import annotations

from .records.generation import Candidate, GenerationRecord, packed_length, row_offset

__all__ = ["Candidate", "GenerationRecord", "packed_length", "row_offset"]
