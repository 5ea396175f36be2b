"""The figure of a sentence report (``attnscope sentences -o FILE.png``): receiver heads' kurtosis per layer and
head, the strongest receiver head's sentence x sentence attention with its vertical scores, and, when the report
has one, the matrix of mean log-probability changes under attention suppression. Draws; computes nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .figures import _colormap, _figure_class

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..experiments.sentences import SentenceReport


def plot_sentences(report: SentenceReport) -> Figure:
    """One row of panels: kurtosis ``[layer, head]``, the top receiver's ``[sentence, sentence]`` and its vertical
    scores, and the suppression matrix ``[sentence, suppressed sentence]`` if there is one (0-indexed)."""
    panels = 3 if report.suppression is None else 4
    figure = _figure_class()(figsize=(4.2 * panels, 4.0), layout="constrained")
    axes = figure.subplots(1, panels)
    receivers, attention = report.receivers, report.attention
    image = axes[0].imshow(np.ma.masked_invalid(receivers.kurtosis), cmap=_colormap("viridis"), aspect="auto",
                           interpolation="nearest")
    axes[0].set(xlabel="head (0-indexed)", ylabel="layer (0-indexed)",
                title=f"receiver score: kurtosis of vertical scores\n(proximity {receivers.proximity})")
    figure.colorbar(image, ax=axes[0], shrink=0.8)
    ranked = receivers.ranked(1)
    if ranked:
        layer, head, _ = ranked[0]
        li, hi = attention.layers.index(layer), attention.heads.index(head)
        matrix = np.ma.masked_array(attention.matrix[li, hi], mask=np.triu(np.ones_like(attention.matrix[li, hi]), 1))
        image = axes[1].imshow(matrix, cmap=_colormap("Blues"), interpolation="nearest")
        axes[1].set(xlabel="key sentence", ylabel="query sentence", title=f"layer {layer} head {head}: block means")
        figure.colorbar(image, ax=axes[1], shrink=0.8)
        vertical = receivers.vertical[li, hi]
        axes[2].bar(range(len(vertical)), np.nan_to_num(vertical), color="#4477aa")
        axes[2].set(xlabel="sentence", ylabel="mean attention from later sentences",
                    title=f"layer {layer} head {head}: vertical scores")
    if report.suppression is not None:
        changes = report.suppression.matrix
        limit = float(np.nanmax(np.abs(changes))) if np.isfinite(changes).any() else 1.0
        image = axes[3].imshow(np.ma.masked_invalid(changes), cmap=_colormap("RdBu"), vmin=-limit, vmax=limit,
                               interpolation="nearest")
        axes[3].set(xlabel="suppressed sentence", ylabel="sentence",
                    title="mean change of log p per token\n(negative: less likely without it)")
        figure.colorbar(image, ax=axes[3], shrink=0.8)
    return figure
