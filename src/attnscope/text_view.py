"""A text to its views in one call: capture the record, compute the context-mixing measures, draw.

The views themselves (:mod:`attnscope.present`) take records and measures and run no model; this
module, on the top floor with the command line, is the one place that runs a model to draw it.

>>> view_text("minilm", "The cat sat on the mat.", measures=("alti",)).save("v.html")  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .models.loading import LoadedModel
    from .present.html import AttentionView


def view_text(model: LoadedModel | str, text: str, pair: str | None = None, *, measures: Sequence[str] = (),
              views: str | list[str] | tuple[str, ...] = "all", norms: bool = True, title: str | None = None,
              layer: int | None = None, heads: Sequence[int] | None = None,
              include_layers: Sequence[int] | None = None) -> AttentionView:
    """The views of ``text`` on ``model`` (a loaded model or a name), with the context-mixing
    ``measures`` (``attention``, ``norm``, ``norm_residual``/``globenc``, ``alti``,
    ``value_zeroing``; see ``attnscope.analysis.mixing``) in the page's measure control.

    The measures take one text (the input side: an encoder, a decoder, or an encoder-decoder's
    encoder), so ``pair`` goes only with encoder-decoders (their target text). Other arguments as
    :func:`attnscope.present.view`.

    >>> view_text("minilm", "The cat sat on the mat.", measures=("alti", "value_zeroing")).save("v.html")  # doctest: +SKIP
    """
    from .analysis.mixing import method_names
    from .capture.extract import as_loaded, extract
    from .experiments.mixing import check_one_text, mixing_measures
    from .present.html import view

    names = method_names(measures)
    loaded = as_loaded(model)
    if names:
        check_one_text(loaded, pair)
    wanted = [views] if isinstance(views, str) else list(views)
    record = extract(loaded, text, pair, qkv=bool({"all", "neuron"} & set(wanted)), norms=norms)
    mixing = mixing_measures(loaded, text, names) if names else None
    return view(record, views, norms=norms, title=title, layer=layer, heads=heads, include_layers=include_layers,
                mixing=mixing)
