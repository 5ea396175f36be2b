"""Matplotlib figures of analysis results (drawn from computed numbers; no science here).

Every function draws on a given ``Axes`` or returns a ``Figure``; callers save them. The backend
is Agg (files), so nothing needs a display.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .patterns import pattern_colour

TOKEN_TYPE_COLOURS = {"[CLS]": "#d62728", "[SEP]": "#1f77b4", "punctuation": "#2ca02c", "other": "#7f7f7f"}


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_map(ax: Any, matrix: np.ndarray, tokens: Sequence[str], title: str, font_size: float = 7) -> None:
    """One attention map ``[q_pos, k_pos]`` as a heatmap: rows = queries, columns = keys.

    Grey level is proportional to the weight (0 white, 1 black), as in Kovaleva et al.'s figures.
    """
    ax.imshow(matrix, cmap="Greys", vmin=0.0, vmax=1.0, interpolation="nearest")
    positions = range(len(tokens))
    ax.set_xticks(positions)
    ax.set_xticklabels(tokens, rotation=90, fontsize=font_size)
    ax.set_yticks(positions)
    ax.set_yticklabels(tokens, fontsize=font_size)
    ax.set_xlabel("key (attended to)", fontsize=font_size + 1)
    ax.set_ylabel("query", fontsize=font_size + 1)
    ax.set_title(title, fontsize=font_size + 3)


def map_figure(matrix: np.ndarray, tokens: Sequence[str], title: str) -> Any:
    """A figure holding one map (size grows with the number of tokens)."""
    plt = pyplot()
    side = min(9.0, 2.5 + 0.16 * len(tokens))
    fig, ax = plt.subplots(figsize=(side, side))
    draw_map(ax, matrix, tokens, title)
    fig.tight_layout()
    return fig


def grid_figure(maps: Sequence[tuple[np.ndarray, Sequence[str], str]], columns: int = 2, panel: float = 7.5,
                diagonal_guide: bool = False) -> Any:
    """Several maps side by side: ``(matrix [q_pos, k_pos], tokens, title)`` each.

    ``diagonal_guide`` draws the main diagonal (``q_pos == k_pos``) as a thin red line, so that
    lines at offsets -1 and +1 are told apart at a glance.
    """
    plt = pyplot()
    rows = -(-len(maps) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(panel * columns, panel * rows), squeeze=False)
    for ax, (matrix, tokens, title) in zip(axes.flat, maps):
        draw_map(ax, matrix, tokens, title, font_size=8)
        if diagonal_guide:
            ax.plot([-0.5, len(tokens) - 0.5], [-0.5, len(tokens) - 0.5], color="red", linewidth=0.6, alpha=0.6)
    for ax in axes.flat[len(maps):]:
        ax.axis("off")
    fig.tight_layout()
    return fig


KOVALEVA_COLOURS = {"vertical": "#1f77b4", "diagonal": "#ff7f0e", "vertical+diagonal": "#2ca02c",
                    "block": "#9467bd", "heterogeneous": "#7f7f7f"}


def pattern_distribution_figure(map_shares: dict[str, float], kovaleva_of: dict[str, str],
                                head_shares: dict[str, float]) -> Any:
    """Left: share of (head, input) maps per pattern class, coloured by Kovaleva type (as in
    Kovaleva et al.'s figure of pattern-type ratios). Right: share of heads per Kovaleva type of
    their dominant pattern."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [2.2, 1]})
    names = list(map_shares)
    left.bar(range(len(names)), [100 * map_shares[n] for n in names],
             color=[KOVALEVA_COLOURS[kovaleva_of[n]] for n in names])
    left.set_xticks(range(len(names)))
    left.set_xticklabels([n.replace("_", " ") for n in names], rotation=35, ha="right", fontsize=9)
    left.set_ylabel("% of all (head, input) maps")
    left.set_title("pattern of each head on each input")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KOVALEVA_COLOURS.values()]
    left.legend(handles, list(KOVALEVA_COLOURS), title="Kovaleva type", fontsize=8, title_fontsize=8)
    types = list(KOVALEVA_COLOURS)
    right.bar(range(len(types)), [100 * head_shares.get(t, 0.0) for t in types], color=list(KOVALEVA_COLOURS.values()))
    right.set_xticks(range(len(types)))
    right.set_xticklabels(types, rotation=35, ha="right", fontsize=9)
    right.set_ylabel("% of heads")
    right.set_title("heads by the type of their dominant pattern")
    fig.tight_layout()
    return fig


def token_types_figure(raw: dict[str, np.ndarray], norm: dict[str, np.ndarray] | None) -> Any:
    """Mean attention to token types per layer, raw (left) and norm-weighted (right).

    ``raw``/``norm``: token type -> ``[layer, head]`` means over inputs. Lines are layer means over
    heads; dots are single heads (Clark et al. 2019's figure 2 beside Kobayashi et al. 2020's).
    """
    plt = pyplot()
    panels = [("attention weights alpha", raw)] + ([("norm-weighted ||alpha f(x)||", norm)] if norm else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.4), sharey=True, squeeze=False)
    for ax, (title, values) in zip(axes[0], panels):
        for name, per_head in values.items():
            layers = np.arange(per_head.shape[0])
            colour = TOKEN_TYPE_COLOURS[name]
            jitter = np.linspace(-0.15, 0.15, per_head.shape[1])
            ax.scatter((layers[:, None] + jitter[None, :]).ravel(), per_head.ravel(), s=7, color=colour, alpha=0.35)
            ax.plot(layers, np.nanmean(per_head, axis=1), marker="o", color=colour, label=name)
        ax.set_xlabel("layer (0-indexed)")
        ax.set_xticks(range(next(iter(values.values())).shape[0]))
        ax.set_title(title)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean share of a query's attention")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def head_map_figure(labels: np.ndarray, confidence: np.ndarray, order: list[str], short: dict[str, str],
                    kovaleva_of: dict[str, str]) -> Any:
    """Layers x heads grid; each cell coloured by the head's dominant pattern, with its short name
    and the share of inputs that got it."""
    from matplotlib.colors import ListedColormap

    plt = pyplot()
    layers, heads = labels.shape
    colours = {name: pattern_colour(name) for name in order}  # the explorer's and the report's colours
    codes = np.vectorize(order.index)(labels)
    fig, ax = plt.subplots(figsize=(1.0 + 0.85 * heads, 1.2 + 0.62 * layers))
    ax.imshow(codes, cmap=ListedColormap([colours[n] for n in order]), vmin=-0.5, vmax=len(order) - 0.5,
              aspect="auto")
    for layer in range(layers):
        for head in range(heads):
            ax.text(head, layer, f"{short[labels[layer, head]]}\n{confidence[layer, head]:.0%}", ha="center",
                    va="center", fontsize=7)
    ax.set_xticks(range(heads))
    ax.set_yticks(range(layers))
    ax.set_xlabel("head (0-indexed)")
    ax.set_ylabel("layer (0-indexed)")
    ax.set_title("dominant pattern per head (share of inputs with that label)")
    used = [n for n in order if n in set(labels.ravel())]
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in used]
    ax.legend(handles, [f"{short[n]} = {n} ({kovaleva_of[n]})" for n in used], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    return fig


CURVE_COLOURS = {"first": "#d62728", "other": "#1f77b4", "learned": "#2ca02c"}  # the sink figure's curves


def sink_figure(report: Any, path: Any = None) -> Any:
    """``report`` (a :class:`~attnscope.analysis.sinks.SinkReport`): top, layers x heads heatmaps of the
    first-token share, raw and norm-weighted; bottom, per-layer curves of first-token and other-sink shares.
    Saved to ``path`` when given."""
    plt = pyplot()
    measures, by_layer = report.measures, report.by_layer
    n_layers, n_heads = measures["first"].shape
    fig = plt.figure(figsize=(10, 4.5 + 0.12 * n_layers))
    grid = fig.add_gridspec(2, 2, height_ratios=[max(2.0, n_layers / 6), 1.6])
    for column, (name, title) in enumerate((("first", "attention weight on the first token"),
                                            ("first_norm", "norm-weighted, ‖αf(x)‖ (Kobayashi et al. 2020)"))):
        ax = fig.add_subplot(grid[0, column])
        image = ax.imshow(measures[name], cmap="Greys", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("head (0-indexed)")
        ax.set_ylabel("layer (0-indexed)")
        ax.set_xticks(range(n_heads))
    fig.colorbar(image, ax=fig.axes, shrink=0.6, label="mean share per query")
    curves = fig.add_subplot(grid[1, :])
    layers = np.arange(n_layers)
    for name, style, label in (("first", "-", "first token"), ("first_norm", "--", "first token, norm-weighted"),
                               ("other", "-", "other sinks"), ("other_norm", "--", "other sinks, norm-weighted"),
                               ("learned", ":", "learned sink (no value)")):
        if np.isfinite(by_layer[name]).any():  # learned: only for models with learned sinks (gpt-oss)
            curves.plot(layers, by_layer[name], style, marker=".", label=label,
                        color=CURVE_COLOURS[name.partition("_")[0]])
    curves.set_xlabel("layer (0-indexed)")
    curves.set_ylabel("mean over heads")
    curves.set_ylim(0, 1)
    curves.legend(fontsize=7, ncol=2)
    fig.suptitle(f"attention sinks of {report.model} over {report.n_inputs} inputs", fontsize=11)
    if path is not None:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    return fig


def sink_models_figure(by_layer: dict[str, dict[str, list]], path: Any = None) -> Any:
    """Several models' first-token share per layer, raw (left) and norm-weighted (right), against relative depth
    (layer / (layers - 1)) so that models of different depths share one axis. ``by_layer``: model name -> a
    sink report's ``by_layer`` (``to_dict()["by_layer"]``). Saved to ``path`` when given."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, (name, title) in zip(axes, (("first", "attention weight on the first token"),
                                        ("first_norm", "norm-weighted, ‖αf(x)‖ (Kobayashi et al. 2020)"))):
        for model, curves in by_layer.items():
            values = np.array([np.nan if v is None else v for v in curves[name]], dtype=float)
            ax.plot(np.linspace(0.0, 1.0, len(values)), values, marker=".", label=f"{model} ({len(values)} layers)")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("relative depth (first layer 0, last layer 1)")
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("mean over a layer's heads")
    axes[0].legend(fontsize=7)
    fig.suptitle("attention sinks by layer, model by model", fontsize=11)
    if path is not None:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    return fig
