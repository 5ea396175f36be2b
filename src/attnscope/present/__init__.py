"""Presentation: records drawn as interactive HTML views and static matplotlib figures.

Python packs a record into a JSON payload (``payload.py``, schema ``payload.schema.json``); JS
shipped in ``static/`` draws it (head, model and neuron views). Long inputs (thousands of tokens)
get their own page, drawn from a block-averaged overview and top-k rows (``longview.py``:
``long_view``, schema ``longview.schema.json``). The step view of a decoder's output, one token at
a time, for causal LMs and encoder-decoders alike, is ``steps.py`` (schema ``steps.schema.json``).
``figures.py`` draws static heatmaps with
matplotlib. Presentation computes no science: it draws what the record holds.

>>> from attnscope.present import view, plot_head       # doctest: +SKIP
>>> view(rec).save("views.html")                         # doctest: +SKIP
>>> plot_head(rec, layer=2, head=0).savefig("head.png")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

from .html import AttentionView, head_view, model_view, neuron_view, view, view_text
from .longview import (
    LONG_VIEWS,
    build_long_payload,
    downsample_attention,
    long_view,
    long_view_of,
    long_view_schema,
    top_k_rows,
)
from .payload import VIEWS, build_payload, payload_schema
from .steps import StepsView, build_steps_payload, steps_schema

# the figures need matplotlib (an optional extra): imported on first use
_FIGURES = ("FIGURES", "plot", "plot_grid", "plot_head", "plot_token_types", "save_figure")

__all__ = [
    "FIGURES",
    "LONG_VIEWS",
    "VIEWS",
    "AttentionView",
    "StepsView",
    "build_long_payload",
    "build_payload",
    "build_steps_payload",
    "downsample_attention",
    "head_view",
    "long_view",
    "long_view_of",
    "long_view_schema",
    "model_view",
    "neuron_view",
    "payload_schema",
    "plot",
    "plot_grid",
    "plot_head",
    "plot_token_types",
    "save_figure",
    "steps_schema",
    "top_k_rows",
    "view",
    "view_text",
]


def __getattr__(name: str) -> Any:
    if name in _FIGURES:
        from . import figures

        return getattr(figures, name)
    raise AttributeError(f"module 'attnscope.present' has no attribute {name!r}")
