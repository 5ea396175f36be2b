"""Charts and tables of probing runs: tables (CSV + one DuckDB database), PNG charts.

The result types (``DependencyResult``, ``CorefResult``, ``ProbeResult``) write their folders with
these and the experiments' summary page (:func:`attnscope.experiments.report.write_summary`); this
module knows none of them, so the dependency goes one way. Every page and chart title says whether
the dependency heads are gold or parser output (silver). Layers and heads are 0-indexed in every file.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import AttnscopeError
from ..experiments.report import finish_figure, pyplot

MAX_CHART_RELATIONS = 20  # the chart shows the most frequent relations; the tables have all of them


def write_tables(frames: Mapping[str, Any], folder: Path, database: str) -> list[Path]:
    """Each frame as ``<name>.csv`` and as table ``<name>`` of one DuckDB file ``<database>.duckdb``."""
    try:
        import duckdb
    except ImportError:
        raise AttnscopeError("writing DuckDB tables needs duckdb: pip install duckdb") from None
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, frame in frames.items():
        frame.to_csv(folder / f"{name}.csv", index=False)
        written.append(folder / f"{name}.csv")
    path = folder / f"{database}.duckdb"
    path.unlink(missing_ok=True)
    with duckdb.connect(str(path)) as connection:
        for name, frame in frames.items():
            connection.register("frame", frame)
            connection.execute(f'CREATE TABLE "{name}" AS SELECT * FROM frame')
            connection.unregister("frame")
    return [*written, path]


def _save(figure: Any, path: Path) -> Path:
    finish_figure(figure, path, dpi=120)
    return path


# ---- dependency heads ------------------------------------------------------------------------------
def plot_best_heads(best: Any, title: str, path: Path, oracle: bool = False) -> Path:
    """Bars: the chosen head's accuracy per relation next to the best fixed-offset baseline; with ``oracle``, a tick
    at the best head's accuracy on the same data (an upper bound: the head was chosen elsewhere)."""
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(max(6.0, 0.55 * len(best) + 2), 4.2))
    x = np.arange(len(best))
    label = "head chosen on dev" if oracle else "best head"
    axes.bar(x - 0.2, best.accuracy, 0.4, label=f"{label} (layer-head, 0-indexed)", color="#3a6ea5")
    if oracle:
        axes.scatter(x - 0.2, best.oracle_accuracy, marker="_", s=120, color="black",
                     label="oracle: best head here (upper bound)", zorder=3)
    axes.bar(x + 0.2, best.baseline_accuracy, 0.4, label="best fixed offset", color="#bbbbbb")
    for position, row in zip(x, best.itertuples()):
        arrow = "d→h" if row.direction == "dependent->head" else "h→d"
        axes.text(position - 0.2, row.accuracy + 0.01, f"{row.best_head}\n{arrow}", ha="center", fontsize=6)
    axes.set_xticks(x, [f"{r} ({n})" for r, n in zip(best.relation, best.arcs)], rotation=60, ha="right", fontsize=7)
    axes.set_ylim(0, 1.3)
    axes.set_yticks(np.linspace(0, 1, 6))
    axes.set_ylabel("accuracy (most-attended word is right)")
    axes.set_title(title, fontsize=8)
    axes.legend(fontsize=7, loc="upper left", ncol=2)
    return _save(figure, path)


def plot_head_grid(accuracy: np.ndarray, title: str, path: Path, label: str = "accuracy",
                   chance: float | None = None) -> Path:
    """Heatmap ``[layer, head]`` of accuracies, each cell written out; with ``chance``, coloured
    red below it and blue above it (so a chance-level grid looks pale instead of uniform)."""
    plt = pyplot()
    n_layers, n_heads = accuracy.shape
    figure, axes = plt.subplots(figsize=(1.5 + 0.5 * n_heads, 1.2 + 0.4 * n_layers))
    if chance is None:
        colours = {"cmap": "viridis", "vmin": 0.0, "vmax": max(1e-9, float(accuracy.max()))}
    else:
        spread = max(0.1, float(np.abs(accuracy - chance).max()))
        colours = {"cmap": "RdBu", "vmin": chance - spread, "vmax": chance + spread}
    image = axes.imshow(accuracy, aspect="auto", **colours)
    if n_layers * n_heads <= 400:
        for layer in range(n_layers):
            for head in range(n_heads):
                axes.text(head, layer, f"{accuracy[layer, head]:.2f}", ha="center", va="center", fontsize=5,
                          color="white" if chance is None and accuracy[layer, head] < 0.6 * accuracy.max()
                          else "black")
    axes.set_xlabel("head (0-indexed)")
    axes.set_ylabel("layer (0-indexed)")
    axes.set_title(title, fontsize=8)
    figure.colorbar(image, ax=axes, shrink=0.8).set_label(label, fontsize=7)
    return _save(figure, path)


# ---- coreference -------------------------------------------------------------------------------------
# ---- attention-only probes ------------------------------------------------------------------------
def plot_probes(frame: Any, title: str, path: Path) -> Path:
    """Grouped bars: each probe's test accuracy with attention features next to its baselines; where the frame has
    ``min`` and ``max`` (several seeds), the bar is the mean and a whisker spans the range."""
    plt = pyplot()
    probes = list(dict.fromkeys(frame.probe))
    figure, axes = plt.subplots(figsize=(7.5, 4.0))
    colours = {"attention": "#3a6ea5", "distance only": "#e0a030", "re-initialised attention": "#999999",
               "majority class": "#cccccc", "right-branching": "#cccccc"}
    for n, probe in enumerate(probes):
        rows = frame[frame.probe == probe].reset_index(drop=True)
        width = 0.8 / len(rows)
        for k, row in rows.iterrows():
            x = n - 0.4 + width * (k + 0.5)
            spread = None if "min" not in rows else [[row.test_accuracy - row["min"]], [row["max"] - row.test_accuracy]]
            axes.bar(x, row.test_accuracy, width, color=colours.get(row.features, "#777777"), label=row.features,
                     yerr=spread, capsize=2, error_kw={"elinewidth": 0.8})
            axes.text(x, row.test_accuracy + 0.01, f"{row.test_accuracy:.2f}", ha="center", fontsize=6)
    handles, labels = axes.get_legend_handles_labels()
    unique = dict(zip(labels, handles))  # one legend entry per kind of features
    axes.legend(unique.values(), unique.keys(), fontsize=7, loc="upper right")
    axes.set_xticks(range(len(probes)), probes)
    axes.set_ylim(0, 1.1)
    axes.set_ylabel("test accuracy (UAS for the parser)")
    axes.set_title(title, fontsize=8)
    return _save(figure, path)


