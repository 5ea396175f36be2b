"""Capture: the one attention function, capture sessions and their recorders, interventions and extraction into records.

Names are imported on first use, so the command line's option parsing (``capture.options``) and
``--help`` do not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .attention import ATTN_IMPLEMENTATION as ATTN_IMPLEMENTATION
    from .attention import CaptureSession as CaptureSession
    from .attention import Intervention as Intervention
    from .attention import capture as capture
    from .attention import intervene as intervene
    from .extract import extract as extract
    from .extract import extract_corpus as extract_corpus
    from .extract import extract_to_file as extract_to_file
    from .plan import CapturePlan as CapturePlan
    from .plan import QuerySelection as QuerySelection
    from .recorders import AttentionCall as AttentionCall
    from .recorders import HeadOutputs as HeadOutputs
    from .recorders import Recorder as Recorder
    from .recorders import RecorderGroup as RecorderGroup
    from .recorders import SiteCapture as SiteCapture

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
