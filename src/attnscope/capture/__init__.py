"""Capture: the one attention function, capture sessions and their recorders, interventions and extraction into records.

Names are imported on first use, so the command line's option parsing (``capture.options``) and
``--help`` do not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {name: ".attention" for name in ("ATTN_IMPLEMENTATION", "CaptureSession", "Intervention", "capture",
                                             "intervene")}
_EXPORTS.update({name: ".recorders" for name in ("AttentionCall", "Recorder", "SiteCapture")})
_EXPORTS.update({name: ".extract" for name in ("extract", "extract_corpus", "extract_to_file")})
_EXPORTS.update({name: ".plan" for name in ("CapturePlan", "QuerySelection")})

__all__ = ["ATTN_IMPLEMENTATION", "AttentionCall", "CapturePlan", "CaptureSession", "Intervention", "QuerySelection",
           "Recorder", "SiteCapture", "capture", "extract", "extract_corpus", "extract_to_file", "intervene"]

if TYPE_CHECKING:
    from .attention import ATTN_IMPLEMENTATION, CaptureSession, Intervention, capture, intervene
    from .extract import extract, extract_corpus, extract_to_file
    from .plan import CapturePlan, QuerySelection
    from .recorders import AttentionCall, Recorder, SiteCapture

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
