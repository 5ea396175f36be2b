"""Which heads track which dependency relation (Clark et al. 2019, section 4.2).

For each relation, each head and each direction, the accuracy is the share of arcs for which the
word attends most (among the sentence's words; special tokens excluded) to the word at the other
end of the arc:

* ``dependent->head``: the dependent's most-attended word is its syntactic head;
* ``head->dependent``: the head's most-attended word is this dependent.

The baseline is Clark et al.'s fixed offset: always predict the word ``k`` positions away, with
the best ``k`` for that relation (the same in both directions, up to sign). Arcs with a word that
has no word piece (see :mod:`attnscope.probing.alignment`) are left out and counted.
Layers and heads are 0-indexed.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .alignment import AlignedSentence

DIRECTIONS = ("dependent->head", "head->dependent")
ANY_RELATION = "(any relation)"
MIN_ARCS = 50  # relations with fewer arcs are in the tables but not in the headline figures


def head_name(layer: int, head: int) -> str:
    """``"layer-head"``, both 0-indexed (Clark et al. write 1-indexed names)."""
    return f"{layer}-{head}"


@dataclass
class DependencyCounts:
    """Running counts: per relation ``[direction, layer, head]`` correct arcs, arcs, and offsets."""

    n_layers: int
    n_heads: int
    correct: dict[str, np.ndarray] = field(default_factory=dict)
    arcs: Counter[str] = field(default_factory=Counter)
    offsets: dict[str, Counter[int]] = field(default_factory=lambda: defaultdict(Counter))
    dropped_arcs: int = 0
    sentences: int = 0

    def add(self, sentence: AlignedSentence) -> None:
        """Score every arc of one sentence whose two words are aligned."""
        tree = sentence.words
        most = sentence.most_attended()  # [layer, head, word]
        self.sentences += 1
        for dep, head, relation in tree.arcs():
            if not (sentence.aligned[dep] and sentence.aligned[head]):
                self.dropped_arcs += 1
                continue
            hits = np.stack([most[:, :, dep] == head, most[:, :, head] == dep])  # [direction, layer, head]
            for name in (relation, ANY_RELATION):
                if name not in self.correct:
                    self.correct[name] = np.zeros((2, self.n_layers, self.n_heads), dtype=np.int64)
                self.correct[name] += hits
                self.arcs[name] += 1
                self.offsets[name][head - dep] += 1


def count_dependency_heads(sentences: Iterable[AlignedSentence]) -> DependencyCounts:
    """Accumulate :class:`DependencyCounts` over word-level attention of parsed sentences."""
    counts: DependencyCounts | None = None
    for sentence in sentences:
        if counts is None:
            counts = DependencyCounts(*sentence.attention.shape[:2])
        counts.add(sentence)
    if counts is None:
        from ..errors import AttnscopeError

        raise AttnscopeError("no sentences to score")
    return counts


def best_offset(offsets: Counter[int]) -> tuple[int, float]:
    """The fixed offset (head position - dependent position) that is right most often, and how often.

    >>> best_offset(Counter({1: 3, -2: 1}))
    (1, 0.75)
    """
    total = sum(offsets.values())
    offset, hits = max(offsets.items(), key=lambda pair: (pair[1], -abs(pair[0])))
    return offset, hits / total


@dataclass(frozen=True)
class DependencyResult:
    """Per relation x direction x head accuracy, fixed-offset baselines and the headline figures."""

    counts: DependencyCounts
    model: str
    annotation: str
    silver: bool
    mismatches: dict[str, int]
    min_arcs: int = MIN_ARCS

    def accuracy(self, relation: str) -> np.ndarray:
        """``[direction, layer, head]`` accuracy for ``relation``."""
        return self.counts.correct[relation] / self.counts.arcs[relation]

    def to_frame(self) -> Any:
        """One row per relation, direction, layer and head (0-indexed)."""
        import pandas as pd

        rows = []
        for relation in self.relations(min_arcs=1):
            accuracy = self.accuracy(relation)
            for d, direction in enumerate(DIRECTIONS):
                for layer in range(self.counts.n_layers):
                    for head in range(self.counts.n_heads):
                        rows.append({"relation": relation, "direction": direction, "layer": layer, "head": head,
                                     "correct": int(self.counts.correct[relation][d, layer, head]),
                                     "arcs": self.counts.arcs[relation], "accuracy": float(accuracy[d, layer, head])})
        return pd.DataFrame(rows)

    def relations(self, min_arcs: int | None = None) -> list[str]:
        """Relations with at least ``min_arcs`` arcs, most frequent first (the any-relation row last)."""
        limit = self.min_arcs if min_arcs is None else min_arcs
        kept = [r for r, n in self.counts.arcs.most_common() if n >= limit and r != ANY_RELATION]
        return kept + ([ANY_RELATION] if ANY_RELATION in self.counts.arcs else [])

    def best_heads(self, min_arcs: int | None = None) -> Any:
        """Per relation: the best head and direction, its accuracy, and the best fixed-offset baseline."""
        import pandas as pd

        rows = []
        for relation in self.relations(min_arcs):
            accuracy = self.accuracy(relation)
            direction, layer, head = np.unravel_index(int(np.argmax(accuracy)), accuracy.shape)
            offset, baseline = best_offset(self.counts.offsets[relation])
            rows.append({"relation": relation, "arcs": self.counts.arcs[relation],
                         "best_head": head_name(int(layer), int(head)), "layer": int(layer), "head": int(head),
                         "direction": DIRECTIONS[direction], "accuracy": float(accuracy[direction, layer, head]),
                         "baseline_offset": offset, "baseline_accuracy": baseline})
        return pd.DataFrame(rows)

    def offsets_frame(self) -> Any:
        """How often each offset (head position - dependent position) occurs, per relation."""
        import pandas as pd

        return pd.DataFrame([{"relation": relation, "offset": offset, "arcs": count,
                              "share": count / self.counts.arcs[relation]}
                             for relation in self.relations(min_arcs=1)
                             for offset, count in sorted(self.counts.offsets[relation].items())])

    def save(self, folder: str | Path) -> Path:
        """Tables (CSV + DuckDB), charts and ``index.html`` in ``folder``; returns the page."""
        import pandas as pd

        from ..experiments.report import write_summary
        from .report import MAX_CHART_RELATIONS, plot_best_heads, plot_head_grid, write_tables

        folder = Path(folder)
        best = self.best_heads()
        note = f"heads: {self.annotation}"
        mismatches = {"kind": list(self.mismatches), "count": list(self.mismatches.values())}
        write_tables({"best_heads": best, "head_accuracy": self.to_frame(), "offsets": self.offsets_frame(),
                      "mismatches": pd.DataFrame(mismatches)}, folder, "probe_deps")
        per_relation = best[best.relation != ANY_RELATION].head(MAX_CHART_RELATIONS)
        plot_best_heads(per_relation, f"{self.model}: best single head per relation vs fixed-offset baseline "
                        f"({len(per_relation)} most frequent relations)\n{note}", folder / "best_heads.png")
        overall = self.accuracy(ANY_RELATION).max(axis=0)  # [layer, head], better of the two directions
        plot_head_grid(overall, f"{self.model}: any relation, better direction per head\n{note}",
                       folder / "any_relation_heads.png")
        headline = self.headline()
        facts = {"annotation": note, "model": self.model, "sentences": headline["sentences"],
                 "arcs scored": headline["arcs"],
                 "arcs left out (a word without word pieces)": headline["arcs_left_out"],
                 "any relation: best head": f"{headline['any_relation_head']} ({headline['any_relation_direction']}) "
                 f"{headline['any_relation_acc']:.3f} vs fixed offset {headline['any_relation_baseline']:.3f}",
                 **{f"alignment: {kind}": count for kind, count in self.mismatches.items()},
                 "layers and heads": "0-indexed (layer-head)"}
        return write_summary(folder / "index.html", f"Dependency heads: {self.model} — {note}", facts,
                             ["best_heads.png", "any_relation_heads.png"], best, "Best head per relation")

    def _repr_html_(self) -> str:
        return str(self.best_heads().to_html(index=False, float_format=lambda v: f"{v:.3f}"))

    def headline(self) -> dict[str, Any]:
        """The JSON figures: ``best_head_acc`` {relation: {head, acc, baseline, ...}}, ``any_relation_acc``."""
        best = self.best_heads()
        per_relation = {row.relation: {"head": row.best_head, "acc": round(row.accuracy, 4),
                                       "baseline": round(row.baseline_accuracy, 4), "direction": row.direction,
                                       "arcs": int(row.arcs)}
                        for row in best.itertuples() if row.relation != ANY_RELATION}
        overall = best[best.relation == ANY_RELATION].iloc[0]
        return {"model": self.model, "annotation": self.annotation, "silver": self.silver,
                "heads_indexing": "layer-head, both 0-indexed", "sentences": self.counts.sentences,
                "best_head_acc": per_relation, "any_relation_acc": round(float(overall.accuracy), 4),
                "any_relation_head": overall.best_head, "any_relation_direction": overall.direction,
                "any_relation_baseline": round(float(overall.baseline_accuracy), 4),
                "arcs": int(overall.arcs), "arcs_left_out": self.counts.dropped_arcs, "mismatches": self.mismatches}
