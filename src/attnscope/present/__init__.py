"""Presentation: records drawn as interactive HTML views and static matplotlib figures.

Python packs a record into a JSON payload (``payload.py``, schema ``payload.schema.json``); JS
shipped in ``static/`` draws it (head, model and neuron views). Long inputs (thousands of tokens)
get their own page, drawn from a block-averaged overview and top-k rows (``longview.py``:
``long_view``, schema ``longview.schema.json``). The step view of a decoder's output, one token at
a time, for causal LMs and encoder-decoders alike, is ``steps.py`` (schema ``steps.schema.json``).
``figures.py`` draws static heatmaps with
matplotlib (an optional extra). Names are imported on first use. Presentation computes no science: it draws what the record holds.

>>> from attnscope.present import view, plot_head       # doctest: +SKIP
>>> view(rec).save("views.html")                         # doctest: +SKIP
>>> plot_head(rec, layer=2, head=0).savefig("head.png")  # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

if TYPE_CHECKING:
    from .figures import FIGURES as FIGURES
    from .figures import plot as plot
    from .figures import plot_grid as plot_grid
    from .figures import plot_head as plot_head
    from .figures import plot_token_types as plot_token_types
    from .figures import save_figure as save_figure
    from .html import AttentionView as AttentionView
    from .html import head_view as head_view
    from .html import model_view as model_view
    from .html import neuron_view as neuron_view
    from .html import view as view
    from .longview import LONG_VIEWS as LONG_VIEWS
    from .longview import build_long_payload as build_long_payload
    from .longview import downsample_attention as downsample_attention
    from .longview import long_view as long_view
    from .longview import long_view_of as long_view_of
    from .longview import long_view_schema as long_view_schema
    from .longview import top_k_rows as top_k_rows
    from .payload import VIEWS as VIEWS
    from .payload import build_payload as build_payload
    from .payload import payload_schema as payload_schema
    from .steps import StepsView as StepsView
    from .steps import build_steps_payload as build_steps_payload
    from .steps import decoding_payload as decoding_payload
    from .steps import generation_payload as generation_payload
    from .steps import steps_schema as steps_schema
    from .steps import steps_view as steps_view

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
