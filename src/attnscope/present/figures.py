"""Static figures of a record with matplotlib: one head's heatmap, the layers x heads grid, and
attention to token types per layer (numbers from :mod:`attnscope.analysis`). Export to PNG, SVG
or PDF with :func:`save_figure`.

Figures are built on ``matplotlib.figure.Figure`` directly (no pyplot state, no GUI backend), so
they work in scripts, servers and notebooks alike (a notebook shows a returned Figure).

>>> fig = plot_head(rec, layer=2, head=0)        # doctest: +SKIP
>>> save_figure(fig, "head.svg")                 # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import AttnscopeError
from ..records.attention import AttentionRecord
from .payload import KIND_LABELS, KIND_SIDES

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from ..analysis.head_functions import HeadScores
    from ..experiments.patching import PatchingResult

FIGURE_FORMATS = ("png", "svg", "pdf")
MASKED_COLOR = "#e6e6e6"  # future keys of causal attention
MAX_TICK_LABELS = 64  # beyond this many tokens, only every n-th token is labelled


@dataclass(frozen=True)
class Matrices:
    """One kind of attention of a record, ready to draw: ``values`` ``[layer, head, q_pos, k_pos]``."""

    kind: str
    values: np.ndarray
    query_tokens: tuple[str, ...]
    key_tokens: tuple[str, ...]
    causal: bool
    norms: bool

    @property
    def value_name(self) -> str:
        return "‖αf(x)‖ (Kobayashi et al. 2020)" if self.norms else "attention weight α"


def matrices(record: AttentionRecord, kind: str | None = None, norms: bool = False) -> Matrices:
    """The attention (or, with ``norms=True``, the norms) of ``kind`` (default: the input side's)."""
    record.require_complete("the attention figures")
    kind = kind or record.model.main_kind
    if kind not in record.kinds:
        raise AttnscopeError(f"this record has no {kind} attention; it has {', '.join(record.kinds)}")
    values = record.get(kind, "norms" if norms else "attention")
    if values is None:
        raise AttnscopeError("this record has no norms: extract with norms=True (CLI: --norms)")
    query_side, key_side = KIND_SIDES[kind]
    return Matrices(kind, values, _side_tokens(record, query_side), _side_tokens(record, key_side),
                    causal=kind == "decoder" or (kind == "self" and record.model.causal), norms=norms)


def _side_tokens(record: AttentionRecord, side: str) -> tuple[str, ...]:
    if side == "target":
        assert record.target_tokens is not None  # only encoder-decoder kinds read the target side
        return record.target_tokens
    return record.tokens


def _check_head(data: Matrices, layer: int, head: int) -> None:
    n_layers, n_heads = data.values.shape[:2]
    if not 0 <= layer < n_layers:
        raise AttnscopeError(f"layer must be between 0 and {n_layers - 1} (0-indexed), got {layer}")
    if not 0 <= head < n_heads:
        raise AttnscopeError(f"head must be between 0 and {n_heads - 1} (0-indexed), got {head}")


def _masked(matrix: np.ndarray, causal: bool) -> np.ma.MaskedArray:
    """``[q_pos, k_pos]`` with the future (k_pos > q_pos) masked when attention is causal."""
    future = np.triu(np.ones(matrix.shape, dtype=bool), k=1) if causal else np.zeros(matrix.shape, dtype=bool)
    return np.ma.masked_array(matrix, mask=future)


def _figure_class() -> type[Figure]:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise AttnscopeError("static figures need matplotlib: pip install matplotlib") from None
    return Figure


def _colormap(name: str):  # type: ignore[no-untyped-def]
    import matplotlib

    return matplotlib.colormaps[name].with_extremes(bad=MASKED_COLOR)


def _label_ticks(ax: Axes, tokens: tuple[str, ...], axis: str) -> None:
    step = max(1, -(-len(tokens) // MAX_TICK_LABELS))
    positions = list(range(0, len(tokens), step))
    labels = [tokens[i] for i in positions]
    if axis == "x":
        ax.set_xticks(positions, labels, rotation=90, fontsize=8)
    else:
        ax.set_yticks(positions, labels, fontsize=8)


def plot_head(record: AttentionRecord, layer: int, head: int, *, kind: str | None = None, norms: bool = False,
              ax: Axes | None = None) -> Figure:
    """Heatmap of one head's ``[q_pos, k_pos]`` matrix: queries down, keys across (0-indexed layer/head)."""
    figure_class = _figure_class()
    data = matrices(record, kind, norms)
    _check_head(data, layer, head)
    matrix = data.values[layer, head]
    if ax is None:
        side = min(12.0, 3.0 + 0.22 * max(matrix.shape))
        figure = figure_class(figsize=(side + 1.2, side), layout="constrained")
        ax = figure.add_subplot()
    else:
        figure = ax.get_figure()  # type: ignore[assignment]
    upper = (float(matrix.max()) or 1.0) if norms else 1.0
    image = ax.imshow(_masked(matrix, data.causal), cmap=_colormap("Oranges" if norms else "Blues"), vmin=0.0,
                      vmax=upper, interpolation="nearest", aspect="auto")
    _label_ticks(ax, data.key_tokens, "x")
    _label_ticks(ax, data.query_tokens, "y")
    ax.set_xlabel("key (attended)")
    ax.set_ylabel("query (attending)")
    ax.set_title(f"{record.model.name}, {KIND_LABELS[data.kind]}: layer {layer}, head {head} (0-indexed)", fontsize=10)
    figure.colorbar(image, ax=ax, label=data.value_name, shrink=0.8)
    return figure


def plot_grid(record: AttentionRecord, *, kind: str | None = None, norms: bool = False, cell: float = 1.1) -> Figure:
    """Small heatmaps of every head: a row per layer, a column per head (both 0-indexed).

    Each cell has its own colour range 0..1 (0..the layer's largest norm with ``norms=True``).
    """
    figure_class = _figure_class()
    data = matrices(record, kind, norms)
    n_layers, n_heads = data.values.shape[:2]
    cell = min(cell, 36.0 / max(n_layers, n_heads))
    figure = figure_class(figsize=(0.6 + n_heads * cell, 0.6 + n_layers * cell), layout="constrained")
    axes = figure.subplots(n_layers, n_heads, squeeze=False)
    cmap = _colormap("Oranges" if norms else "Blues")
    for layer in range(n_layers):
        upper = (float(data.values[layer].max()) or 1.0) if norms else 1.0
        for head in range(n_heads):
            ax = axes[layer, head]
            ax.imshow(_masked(data.values[layer, head], data.causal), cmap=cmap, vmin=0.0, vmax=upper,
                      interpolation="nearest", aspect="auto")
            ax.set_xticks([])
            ax.set_yticks([])
            if layer == 0:
                ax.set_title(f"head {head}", fontsize=8)
            if head == 0:
                ax.set_ylabel(f"layer {layer}", fontsize=8)
    figure.suptitle(f"{record.model.name}, {KIND_LABELS[data.kind]}: layers x heads (0-indexed), {data.value_name}",
                    fontsize=10)
    return figure


# Token types as attnscope.analysis defines them (Clark et al. 2019, Fig. 2): statistic -> panel title
TOKEN_TYPES = {"cls": "[CLS] (leading specials)", "sep": "[SEP] (other specials)", "punct": "punctuation . and ,"}


def plot_token_types(record: AttentionRecord, *, norms: bool = False) -> Figure:
    """Average attention to [CLS], [SEP] and ". ," per layer, a dot per head and a line through their mean.

    The numbers are :func:`attnscope.analysis.head_statistics` (``cls``, ``sep``, ``punct``; the
    ``norm_`` versions with ``norms=True``) of the input side's attention; this only draws them.
    """
    from ..analysis.stats import NORM_PREFIX, head_statistics

    figure_class = _figure_class()
    if norms and record.norms is None:
        raise AttnscopeError("this record has no norms: extract with norms=True (CLI: --norms)")
    statistics = head_statistics(record)
    prefix = NORM_PREFIX if norms else ""
    n_layers, n_heads = statistics.shape
    figure = figure_class(figsize=(3.3 * len(TOKEN_TYPES) + 0.5, 3.4), layout="constrained")
    axes = figure.subplots(1, len(TOKEN_TYPES), sharey=True, squeeze=False)[0]
    layers = np.arange(n_layers)
    for ax, (name, title) in zip(axes, TOKEN_TYPES.items()):
        values = statistics[prefix + name]  # [layer, head]
        for head in range(n_heads):
            ax.scatter(layers, values[:, head], s=10, alpha=0.6, color=_head_color(head))
        ax.plot(layers, np.nanmean(values, axis=1), color="#222", linewidth=1.2, label="mean over heads")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("layer (0-indexed)")
        ax.set_xticks(layers if n_layers <= 12 else layers[:: -(-n_layers // 12)])
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("average " + ("share of \u2016\u03b1f(x)\u2016" if norms else "attention"))
    axes[0].legend(fontsize=8, loc="upper left")
    figure.suptitle(f"{record.model.name}, {KIND_LABELS[record.model.main_kind]}: attention to token types "
                    "(dots: heads)", fontsize=10)
    return figure


def _head_color(head: int) -> str:
    import matplotlib

    return str(matplotlib.colors.to_hex(matplotlib.colormaps["tab20"](head % 20)))


FIGURES = {
    "head": "heatmap of one head's attention matrix (needs --layer and --head)",
    "grid": "layers x heads grid of small heatmaps",
    "types": "average attention to [CLS], [SEP] and punctuation per layer (attnscope.analysis statistics)",
}
"""Registry of the static figures: name -> what it shows (CLI choices come from it)."""


def plot(record: AttentionRecord, figure: str = "head", *, layer: int | None = None, head: int | None = None,
         kind: str | None = None, norms: bool = False) -> Figure:
    """The static figure named ``figure`` (see :data:`FIGURES`)."""
    if figure == "head":
        if layer is None or head is None:
            raise AttnscopeError("the head figure needs a layer and a head (--layer L --head H, 0-indexed)")
        return plot_head(record, layer, head, kind=kind, norms=norms)
    if figure == "grid":
        return plot_grid(record, kind=kind, norms=norms)
    if figure == "types":
        if kind not in (None, record.model.main_kind):
            raise AttnscopeError("the token-type figure shows the input side's attention; drop --attention")
        return plot_token_types(record, norms=norms)
    raise AttnscopeError(f"unknown figure {figure!r}; choose from {', '.join(FIGURES)}")


PATCHING_PARTS = ("heads", "mlps", "residual")
TOP_HEAD_ROWS = 12  # rows of a per-position head map
_PATCHED = {"heads": "head output", "mlps": "MLP output", "residual": "residual stream after the layer",
            "queries": "head's queries", "keys": "head's keys"}


def plot_patching(result: PatchingResult, part: str = "heads", *, top: int = TOP_HEAD_ROWS) -> Figure:
    """Activation patching's mean share recovered, 0 = corrupted, 1 = clean: a layers x heads map
    (``heads``), layers x positions (``residual``, ``mlps_by_position``; the first pair's tokens across) or one
    column per layer (``mlps``). A per-position head part (``heads_by_position``, ``queries_by_position``,
    ``keys_by_position``: ``[layer, position, head]``) shows the ``top`` heads whose largest single-position
    estimate (by magnitude) is largest, one row each (``L{layer}H{head}``, in layer order), across positions.
    ``*``: the bootstrap 95% interval over pairs excludes 0."""
    if part not in result.intervals:
        raise AttnscopeError(f"the patching result has no {part!r} part; it has {', '.join(result.intervals)}")
    mean, low, high = result.intervals[part]
    with np.errstate(invalid="ignore"):
        significant = (low > 0) | (high < 0)
    rows, row_title = [str(layer) for layer in range(mean.shape[0])], "layer (0-indexed)"
    if mean.ndim == 3:
        mean, significant, rows = _top_head_rows(mean, significant, top)
        row_title = "layer L, head H (0-indexed)"
    grid = mean[:, None] if mean.ndim == 1 else mean  # [row, column]
    significant = significant[:, None] if significant.ndim == 1 else significant
    n_rows, n_columns = grid.shape
    figure = _figure_class()(figsize=(2.4 + 0.5 * n_columns, 1.4 + 0.3 * n_rows), layout="constrained")
    ax = figure.add_subplot()
    limit = max(1.0, float(np.nanmax(np.abs(grid)))) if np.isfinite(grid).any() else 1.0
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=_colormap("RdBu"), vmin=-limit, vmax=limit, aspect="auto",
                      interpolation="nearest")
    if n_columns <= 40 and n_rows <= 60:
        for row, column in zip(*np.nonzero(np.isfinite(grid))):
            star = "*" if significant[row, column] else ""
            ax.text(column, row, f"{grid[row, column]:.2f}{star}", ha="center", va="center", fontsize=6,
                    color="white" if abs(grid[row, column]) > 0.6 * limit else "black")
    node, by_position = part.removesuffix("_by_position"), part.endswith("_by_position")
    if part == "residual" or by_position:
        _label_ticks(ax, result.tokens[0][:n_columns], "x")
        ax.set_xlabel("position patched (first pair's tokens)")
    else:
        per_head = mean.ndim > 1
        ax.set_xticks(range(n_columns), [str(c) for c in range(n_columns)] if per_head else ["MLP"])
        ax.set_xlabel("head (0-indexed)" if per_head else "")
    ax.set_yticks(range(n_rows), rows, fontsize=7)
    ax.set_ylabel(row_title)
    what = _PATCHED[node] + (" at one position" if by_position else "")
    if by_position and node != "mlps":
        what += f" (the {n_rows} heads with the largest)"
    how = f"estimated ({result.method}) to be recovered" if result.method.startswith("atp") else "recovered"
    ax.set_title(f"{result.model}: {result.metric} {how} by patching each {what}\n"
                 f"mean over {result.n_pairs} pair(s); 0 = corrupted, 1 = clean; * = 95% bootstrap CI excludes 0",
                 fontsize=9)
    figure.colorbar(image, ax=ax, label="share recovered", shrink=0.8)
    return figure


def _top_head_rows(mean: np.ndarray, significant: np.ndarray, top: int
                   ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """``[layer, position, head]`` -> ``[row, position]`` of the ``top`` heads whose largest cell (by magnitude) is
    largest, in layer order, with their significance and labels ``L{layer}H{head}``."""
    peak = np.nan_to_num(np.abs(mean), nan=-1.0).max(axis=1)  # [layer, head]
    cells = sorted(divmod(int(index), mean.shape[2]) for index in np.argsort(-peak, axis=None)[:top])
    return (np.stack([mean[layer, :, head] for layer, head in cells]),
            np.stack([significant[layer, :, head] for layer, head in cells]),
            [f"L{layer}H{head}" for layer, head in cells])


def plot_attribution_check(check: Mapping[str, Any]) -> Figure:
    """The attribution check (``AttributionCheck.to_dict()``, as ``attnscope patch --evaluate`` writes it), one
    column per task: above, the drop of the target logit when the top-k heads by DLA or k random heads are
    mean-ablated (means over prompts, bars: bootstrap 95% intervals); below, each head's mean DLA term
    against its mean effect alone (patching), with Spearman's rho (mean over prompts)."""
    tasks = check["tasks"]
    figure = _figure_class()(figsize=(4.2 * len(tasks), 6.4), layout="constrained")
    axes = figure.subplots(2, len(tasks), squeeze=False)
    for column, (task, summary) in enumerate(tasks.items()):
        ks = [int(k) for k in summary["ablation"]]
        top, ax = axes[0, column], axes[1, column]
        for offset, (name, label, colour) in enumerate((("top_dla", "top-k heads by DLA", "#1e8c46"),
                                                        ("random", "k random heads", "#888888"))):
            mean, low, high = (np.array([np.nan if v is None else v for v in
                                         (summary["ablation"][str(k)][name][i] for k in ks)]) for i in range(3))
            x = np.arange(len(ks)) + (offset - 0.5) * 0.3
            top.bar(x, mean, width=0.3, color=colour, label=label,
                    yerr=np.nan_to_num(np.stack([mean - low, high - mean]), nan=0.0), capsize=3)
        top.set_xticks(range(len(ks)), [str(k) for k in ks])
        top.set_xlabel("k heads mean-ablated")
        top.set_ylabel("drop of the target logit")
        top.set_title(f"{task}: {summary['n_prompts']} prompts", fontsize=9)
        top.axhline(0, color="black", linewidth=0.5)
        top.legend(fontsize=7)
        dla, patched = np.ravel(summary["mean_dla"]), np.ravel(summary["mean_patching"])
        ax.scatter(dla, patched, s=8, color="#4a7bd0", alpha=0.7)
        n_heads = len(summary["mean_dla"][0])
        for head in summary["heads"]["by_patching"][:3] + summary["heads"]["by_dla"][:3]:
            index = head["layer"] * n_heads + head["head"]
            ax.annotate(f"L{head['layer']}H{head['head']}", (dla[index], patched[index]), fontsize=6)
        rho = summary["spearman"]
        interval = "" if rho[1] is None else f" [{rho[1]:.2f}, {rho[2]:.2f}]"
        ax.set_title(f"Spearman rho per prompt, mean {rho[0]:.2f}{interval}", fontsize=9)
        ax.axhline(0, color="black", linewidth=0.5)
        ax.axvline(0, color="black", linewidth=0.5)
        ax.set_xlabel("mean DLA term (direct effect)")
        ax.set_ylabel("mean drop, head alone mean-ablated")
    figure.suptitle(f"{check['model']}: is direct logit attribution faithful? (layers, heads 0-indexed)", fontsize=10)
    return figure


def plot_routes_check(check: Mapping[str, Any]) -> Figure:
    """The routes check (``RoutesCheck.to_dict()``, as ``attnscope routes --evaluate`` writes it), one column per
    task: above, each head score's Spearman rho with each head's effect alone (patching), of their absolute values,
    and its top-20 overlap; below, each token score's Spearman rho with erasure, and of their absolute values (means
    over prompts, bars: bootstrap 95% intervals)."""
    tasks, labels = check["tasks"], check["labels"]
    figure = _figure_class()(figsize=(4.6 * len(tasks), 6.4), layout="constrained")
    axes = figure.subplots(2, len(tasks), squeeze=False)
    for column, (task, summary) in enumerate(tasks.items()):
        heads, tokens = summary["heads"], summary["tokens"]
        _interval_bars(axes[0, column], [labels["heads"][n] for n in heads],
                       {"Spearman rho with patching": [heads[n]["spearman"] for n in heads],
                        "rho of |score|, |effect|": [heads[n]["spearman_magnitude"] for n in heads],
                        "top-20 overlap": [heads[n]["top20_overlap"] for n in heads]})
        axes[0, column].set_title(f"{task}: heads, {summary['n_prompts']} prompts", fontsize=9)
        _interval_bars(axes[1, column], [labels["tokens"][n] for n in tokens],
                       {"Spearman rho with erasure": [tokens[n]["spearman"] for n in tokens],
                        "rho of |score|, |effect|": [tokens[n]["spearman_magnitude"] for n in tokens]})
        axes[1, column].set_title(f"{task}: tokens, {summary['n_token_prompts']} prompts", fontsize=9)
    figure.suptitle(f"{check['model']}: is a route faithful? (tau {check['tau']}; 0-indexed heads)", fontsize=10)
    return figure


def _interval_bars(ax: Axes, names: list[str], series: Mapping[str, list[list[float | None]]]) -> None:
    """Grouped bars of ``[mean, low, high]`` triples (None: not measured), one group per name."""
    width = 0.8 / len(series)
    colours = ("#4a7bd0", "#dd8452", "#1e8c46")
    for offset, (label, triples) in enumerate(series.items()):
        mean, low, high = (np.array([np.nan if t[i] is None else t[i] for t in triples], dtype=float) for i in range(3))
        x = np.arange(len(names)) + (offset - (len(series) - 1) / 2) * width
        ax.bar(x, np.nan_to_num(mean), width=width, color=colours[offset % len(colours)], label=label,
               yerr=np.nan_to_num(np.stack([mean - low, high - mean]), nan=0.0), capsize=3)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.legend(fontsize=7)


HEAD_SCORE_PANELS_PER_ROW = 4
WINDOWED_COLOR = "#b8560b"  # tick labels of sliding-window layers


def plot_head_scores(scores: HeadScores, name: str | Sequence[str] | None = None) -> Figure:
    """Layers x heads grids (0-indexed; a layer down, a head across) of head-function score columns: ``name`` (one
    column, several, or None for every column of ``scores``), a panel each. Scores within 0..1 share that colour
    range; others (a kurtosis, a window size) span their own. A sliding-window layer's label carries its window
    (``5 w512``, in orange), from the table's ``window`` column: its scores only reach that far back."""
    names = list(scores.scores) if name is None else [name] if isinstance(name, str) else list(name)
    for column in names:
        if column not in scores.scores:
            raise AttnscopeError(f"no score {column!r} here; these were computed: {', '.join(scores.scores)}")
    n_layers, n_heads = scores.shape
    per_row = min(len(names), HEAD_SCORE_PANELS_PER_ROW)
    n_rows = -(-len(names) // per_row)
    width, height = 1.6 + 0.3 * n_heads, 1.2 + 0.2 * n_layers
    figure = _figure_class()(figsize=(per_row * width, n_rows * height), layout="constrained")
    axes = figure.subplots(n_rows, per_row, squeeze=False).ravel()
    windows = scores.to_frame().groupby("layer")["window"].first().to_numpy()  # [layer]
    for ax, column in zip(axes, names):
        _head_score_panel(ax, scores.scores[column], column, windows)
    for ax in axes[len(names):]:
        ax.set_axis_off()
    figure.suptitle(f"{scores.model}: head-function scores, layers x heads (0-indexed)", fontsize=10)
    return figure


def _head_score_panel(ax: Axes, values: np.ndarray, column: str, windows: np.ndarray) -> None:
    """One column's ``[layer, head]`` grid on ``ax``, windowed layers' labels marked."""
    finite = values[np.isfinite(values)]
    unit = finite.size == 0 or (finite.min() >= 0 and finite.max() <= 1)
    low, high = (0.0, 1.0) if unit else (float(finite.min()), float(finite.max()) or 1.0)
    image = ax.imshow(np.ma.masked_invalid(values), cmap=_colormap("Blues" if unit else "viridis"), vmin=low,
                      vmax=high, interpolation="nearest", aspect="auto")
    n_layers, n_heads = values.shape
    ax.set_xticks(range(n_heads), [str(h) for h in range(n_heads)], fontsize=6)
    ax.set_yticks(range(n_layers), [f"{layer} w{windows[layer]}" if windows[layer] else str(layer)
                                    for layer in range(n_layers)], fontsize=6)
    for label, window in zip(ax.get_yticklabels(), windows):
        if window:
            label.set_color(WINDOWED_COLOR)
    ax.set_xlabel("head (0-indexed)", fontsize=7)
    ax.set_ylabel("layer (0-indexed; wN: sliding window of N)" if windows.any() else "layer (0-indexed)", fontsize=7)
    ax.set_title(column, fontsize=8)
    ax.figure.colorbar(image, ax=ax, shrink=0.8)


CHECK_SETS = {"top": ("#c0392b", -0.15), "random": ("#7f8c8d", 0.0), "bottom": ("#2980b9", 0.15)}  # colour, x shift


def plot_masking_checks(checks: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> Figure:
    """Masking checks side by side: ``checks`` ``{model: {check: MaskingCheck.to_dict()}}`` (e.g. the ``checks`` of the
    shipped head lists' summaries), a row per model and a column per check. Each panel shows, per k, the metric's
    change (masked - intact) with the top k heads masked, k random heads (the mean over the draws) and, where the
    check has them, the bottom k, each with its 95% interval."""
    names = list(dict.fromkeys(name for found in checks.values() for name in found))
    figure = _figure_class()(figsize=(3.2 * len(names), 2.3 * len(checks)), layout="constrained")
    axes = figure.subplots(len(checks), len(names), squeeze=False)
    for row, (model, found) in zip(axes, checks.items()):
        for ax, name in zip(row, names):
            if name in found:
                _masking_check_panel(ax, found[name], f"{model}: {name}")
            else:
                ax.set_axis_off()
    figure.suptitle("masking the top k heads of a score against k random heads (95% intervals)", fontsize=10)
    return figure


def _masking_check_panel(ax: Axes, check: Mapping[str, Any], title: str) -> None:
    """One check's changes by k (a position per k, a colour per set of heads), the intact metric in the title."""
    ks = list(check["ks"])
    for which, (color, shift) in CHECK_SETS.items():
        rows = [row for row in check["summary"] if row["heads"] == which]
        if not rows:
            continue
        x = np.array([ks.index(row["k"]) for row in rows]) + shift
        change = np.array([row["change"] for row in rows], dtype=float)
        low = np.array([np.nan if row["ci_low"] is None else row["ci_low"] for row in rows], dtype=float)
        high = np.array([np.nan if row["ci_high"] is None else row["ci_high"] for row in rows], dtype=float)
        errors = np.nan_to_num(np.stack([change - low, high - change]).clip(min=0))
        ax.errorbar(x, change, yerr=errors, fmt="o", color=color, capsize=3, markersize=4, label=f"{which} k")
    ax.axhline(0, color="black", linewidth=0.6)
    ax.set_xticks(range(len(ks)), [f"k = {k}" for k in ks], fontsize=7)
    ax.set_xlim(-0.6, len(ks) - 0.4)
    ax.set_ylabel(f"change of {check['metric']}", fontsize=7)
    ax.tick_params(labelsize=7)
    ax.set_title(f"{title} (intact {check['baseline']:.3g})", fontsize=8)
    ax.legend(fontsize=6, loc="best")


def save_figure(figure: Figure, path: str | Path, dpi: int = 150) -> Path:
    """Write ``figure`` as PNG, SVG or PDF, chosen by the file's suffix."""
    path = Path(path)
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in FIGURE_FORMATS:
        raise AttnscopeError(f"cannot tell the format of {path}: use a .png, .svg or .pdf file name")
    from ..files import written

    with written(path) as temporary:
        figure.savefig(temporary, format=suffix, dpi=dpi)
    return path
