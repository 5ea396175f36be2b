"""What an encoder-decoder's step-by-step decoding produced: :class:`DecodeTrace` (plain data; made by
:func:`attnscope.capture.decode.decode_steps`, drawn by :func:`attnscope.present.steps.steps_view`).

Every step keeps the prefix, the top-k next tokens (:class:`~attnscope.records.generation.Candidate`,
with their logits) and the newest decoder position's cross-attention over the source,
``[layer, head, source_pos]``. Steps are 0-indexed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .generation import Candidate


@dataclass(frozen=True)
class Step:
    """One decoding step of the best hypothesis.

    ``cross_attention``: ``[layer, head, source_pos]``, the newest decoder position's attention.
    ``beams``: for beam search, every live hypothesis after this step as (text, log-probability).
    """

    index: int
    prefix: tuple[str, ...]
    candidates: tuple[Candidate, ...]
    chosen: str
    cross_attention: np.ndarray = field(repr=False)
    beams: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class DecodeTrace:
    """The whole decoding of one source sentence."""

    source: str
    source_tokens: tuple[str, ...]
    steps: tuple[Step, ...]
    output: str
    method: str
    model: str = ""
