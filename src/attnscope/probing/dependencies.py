"""Which heads track which dependency relation (Clark et al. 2019, section 4.2).

For each relation, each head and each direction, the accuracy is the share of arcs for which the
word attends most (among the sentence's words; special tokens excluded) to the word at the other
end of the arc:

* ``dependent->head``: the dependent's most-attended word is its syntactic head;
* ``head->dependent``: the head's most-attended word is this dependent.

The baseline is Clark et al.'s fixed offset: always predict the word ``k`` positions away, with
the best ``k`` for that relation and direction, on the same arcs as the heads. Arcs are scored
under their relation, its base and Clark et al.'s name (:mod:`attnscope.probing.relations`).

Decoders (``causal``): a word can only attend to itself and earlier words, so a direction is
defined only for the arcs where it points backwards (``dependent->head`` when the head comes
first, ``head->dependent`` when the dependent does); each direction has its own number of arcs.
Encoders score every arc in both directions.

Left out, and counted: arcs with a word that has no word piece (see
:mod:`attnscope.probing.alignment`), and whole sentences longer than the model's limit (never cut).
Each head's accuracy comes with a 95% Wilson interval over its arcs. Which head is reported: with
other data to choose on (``selection``, e.g. the treebank's dev split), the head that is best there,
scored here, so its accuracy and interval are honest estimates; beside it the best head on the scored
data itself (the *oracle*), an upper bound, named so. Without such data the head is the best on the
scored data (``selected_on`` says so), and the interval is optimistic: it does not correct for having
picked the best of all heads. Layers and heads are 0-indexed.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .alignment import AlignedSentence
from .relations import BASE_SUFFIX, CLARK_MAPPING, labelled_arcs

DIRECTIONS = ("dependent->head", "head->dependent")
Z_95 = 1.959963984540054  # two-sided 95% normal quantile
ANY_RELATION = "(any relation)"
MIN_ARCS = 50  # relations with fewer arcs are in the tables but not in the headline figures
SELECTED_ON_DEV = "dev"
SELECTED_ON_SCORED = "scored data"  # no other data chose the head: the best on the data it is scored on
NO_DEV_ARCS = "scored data (no dev arcs)"  # dev data was given, but holds none of this relation and direction


def head_name(layer: int, head: int) -> str:
    """``"layer-head"``, both 0-indexed (Clark et al. write 1-indexed names)."""
    return f"{layer}-{head}"


def wilson_interval(hits: float, n: int, z: float = Z_95) -> tuple[float, float]:
    """95% Wilson score interval of a share ``hits / n`` (``(0, 1)`` when ``n`` is 0).

    >>> [round(v, 3) for v in wilson_interval(8, 10)]
    [0.49, 0.943]
    """
    if n == 0:
        return 0.0, 1.0
    share = hits / n
    centre = (share + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(share * (1 - share) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    low, high = max(0.0, centre - half), min(1.0, centre + half)
    return float(0.0 if hits == 0 else low), float(1.0 if hits == n else high)  # exact ends, not 0.99999...


class ScoredHeads:
    """A result whose ``correct`` is ``[item, layer, head]`` bool: each head's accuracy and the best head."""

    if TYPE_CHECKING:  # read-only here, so that a subclass's field or property may give it
        @property
        def correct(self) -> np.ndarray: ...

    @property
    def accuracy(self) -> np.ndarray:
        """``[layer, head]`` share of items the head got right."""
        return self.correct.mean(axis=0)

    def best_head(self) -> tuple[int, int]:
        """``(layer, head)`` with the highest accuracy on this data (the oracle)."""
        return _argmax(self.accuracy)


@dataclass(frozen=True)
class HeadChoice:
    """One head chosen on ``selected_on`` data and scored on this data (``hits`` of ``n``), beside the best head on
    this data (the oracle, ``oracle_hits``: an upper bound). ``selection_accuracy``: the chosen head's accuracy on
    the data that chose it (with ``selected_on`` :data:`SELECTED_ON_SCORED`, its accuracy here)."""

    layer: int
    head: int
    hits: int
    n: int
    oracle_layer: int
    oracle_head: int
    oracle_hits: int
    selected_on: str
    selection_accuracy: float

    @property
    def name(self) -> str:
        return head_name(self.layer, self.head)

    @property
    def oracle_name(self) -> str:
        return head_name(self.oracle_layer, self.oracle_head)

    @property
    def accuracy(self) -> float:
        return self.hits / max(self.n, 1)

    @property
    def oracle_accuracy(self) -> float:
        return self.oracle_hits / max(self.n, 1)

    def interval(self) -> tuple[float, float]:
        """95% Wilson interval of the chosen head's accuracy on this data."""
        return wilson_interval(self.hits, self.n)


def selection_note(source: str | None, amount: str) -> str:
    """One sentence for reports: where the heads were chosen (on ``source``, which holds ``amount``; None: on the
    data they are scored on), and what the oracle is."""
    if source is None:
        return ("heads chosen on the data they are scored on (the best of all heads there, so optimistic; "
                "choose them on other data with a dev file)")
    return f"heads chosen on {source} ({amount}), scored here; the oracle head is the best head here, an upper bound"


def _argmax(values: np.ndarray) -> tuple[int, int]:
    """``(layer, head)`` of the largest value of ``[layer, head]`` (the first one on ties)."""
    layer, head = np.unravel_index(int(np.argmax(values)), values.shape)
    return int(layer), int(head)


def choose_head(hits: np.ndarray, n: int, selection: np.ndarray | None = None,
                selected_on: str = SELECTED_ON_DEV) -> HeadChoice:
    """The head to report from ``hits`` ``[layer, head]`` (items right of ``n`` on the scored data).

    ``selection``: ``[layer, head]`` accuracies on other data (dev); the head best there is chosen and
    ``selected_on`` names that data. Without it the best head on the scored data is chosen
    (:data:`SELECTED_ON_SCORED`). The oracle is always the best head on the scored data.

    >>> choice = choose_head(np.array([[3, 9]]), 10, selection=np.array([[0.8, 0.6]]))
    >>> choice.name, choice.accuracy, choice.oracle_name, choice.oracle_accuracy
    ('0-0', 0.3, '0-1', 0.9)
    """
    oracle = _argmax(hits)
    if selection is None:
        chosen, selected_on, selection_accuracy = oracle, SELECTED_ON_SCORED, hits[oracle] / max(n, 1)
    else:
        chosen = _argmax(selection)
        selection_accuracy = selection[chosen]
    return HeadChoice(*chosen, int(hits[chosen]), int(n), *oracle, int(hits[oracle]), selected_on,
                      float(selection_accuracy))


@dataclass
class DependencyCounts:
    """Running counts per label: ``correct[label]`` ``[direction, layer, head]``, ``arcs[label]``
    ``[direction]`` and per direction how often each offset (target - source position) occurs.

    ``causal``: the model is a decoder, so a direction counts only arcs where it points backwards.
    """

    n_layers: int
    n_heads: int
    causal: bool = False
    correct: dict[str, np.ndarray] = field(default_factory=dict)
    arcs: dict[str, np.ndarray] = field(default_factory=dict)
    offsets: dict[str, tuple[Counter[int], Counter[int]]] = field(
        default_factory=lambda: defaultdict(lambda: (Counter(), Counter())))
    dropped_arcs: int = 0
    sentences: int = 0
    too_long: int = 0

    def add(self, sentence: AlignedSentence) -> None:
        """Score every arc of one sentence whose two words are aligned (nothing of a sentence cut by the limit)."""
        if sentence.truncated:
            self.too_long += 1
            return
        most = sentence.most_attended()  # [layer, head, word]
        self.sentences += 1
        aligned = sentence.aligned
        for dep, head, _ in sentence.words.arcs():  # each tree arc once
            if aligned[dep] and aligned[head]:
                self._count(ANY_RELATION, dep, head, most)
            else:
                self.dropped_arcs += 1
        for dep, head, label in labelled_arcs(sentence.words):  # as written, base:*, Clark's names
            if aligned[dep] and aligned[head]:
                self._count(label, dep, head, most)

    def _count(self, name: str, dep: int, head: int, most: np.ndarray) -> None:
        if name not in self.correct:
            self.correct[name] = np.zeros((2, self.n_layers, self.n_heads), dtype=np.int64)
            self.arcs[name] = np.zeros(2, dtype=np.int64)
        for d, (source, target) in enumerate(((dep, head), (head, dep))):
            if self.causal and target > source:
                continue  # a decoder's word cannot attend forwards
            self.correct[name][d] += most[:, :, source] == target
            self.arcs[name][d] += 1
            self.offsets[name][d][target - source] += 1


def count_dependency_heads(sentences: Iterable[AlignedSentence], causal: bool = False) -> DependencyCounts:
    """Accumulate :class:`DependencyCounts` over word-level attention of parsed sentences."""
    counts: DependencyCounts | None = None
    for sentence in sentences:
        if counts is None:
            n_layers, n_heads = sentence.attention.shape[:2]
            counts = DependencyCounts(n_layers, n_heads, causal=causal)
        counts.add(sentence)
    if counts is None:
        from ..errors import AttnscopeError

        raise AttnscopeError("no sentences to score")
    return counts


def best_offset(offsets: Counter[int]) -> tuple[int, float]:
    """The fixed offset (target position - source position) that is right most often, and how often.

    >>> best_offset(Counter({1: 3, -2: 1}))
    (1, 0.75)
    """
    total = sum(offsets.values())
    if not total:
        return 0, 0.0
    offset, hits = max(offsets.items(), key=lambda pair: (pair[1], -abs(pair[0])))
    return offset, hits / total


@dataclass(frozen=True)
class DependencyResult:
    """Per relation x direction x head accuracy, fixed-offset baselines and the headline figures.

    ``selection``: the same model's counts on other data (``selection_source``, e.g. the dev split), where
    each relation's head is chosen; without it, heads are chosen on the data they are scored on.
    """

    counts: DependencyCounts
    model: str
    annotation: str
    silver: bool
    mismatches: dict[str, int]
    min_arcs: int = MIN_ARCS
    selection: DependencyCounts | None = None
    selection_source: str = ""

    @property
    def selected_on(self) -> str:
        """Where the heads were chosen: :data:`SELECTED_ON_DEV` or :data:`SELECTED_ON_SCORED`."""
        return SELECTED_ON_SCORED if self.selection is None else SELECTED_ON_DEV

    def selection_note(self) -> str:
        """One sentence for reports: where the heads were chosen, and what the oracle is."""
        return selection_note(None if self.selection is None else self.selection_source,
                              f"{self.selection.sentences} sentences" if self.selection is not None else "")

    def choice(self, relation: str, direction: int) -> HeadChoice:
        """The head reported for ``relation`` in ``direction`` (an index of :data:`DIRECTIONS`)."""
        counts = self.counts
        hits, n = counts.correct[relation][direction], int(counts.arcs[relation][direction])
        if self.selection is None:
            return choose_head(hits, n)
        dev_arcs = self.selection.arcs.get(relation, np.zeros(2, dtype=np.int64))[direction]
        if not dev_arcs:
            return choose_head(hits, n, hits / max(n, 1), NO_DEV_ARCS)
        return choose_head(hits, n, self.selection.correct[relation][direction] / dev_arcs)

    def accuracy(self, relation: str) -> np.ndarray:
        """``[direction, layer, head]`` accuracy for ``relation`` (0 in a direction without arcs)."""
        arcs = self.counts.arcs[relation][:, None, None]  # [direction, 1, 1]
        return self.counts.correct[relation] / np.maximum(arcs, 1)

    def total_arcs(self, relation: str) -> int:
        """Arcs of ``relation`` scored in at least one direction."""
        return int(self.counts.arcs[relation].max())

    def to_frame(self) -> Any:
        """One row per relation, direction, layer and head (0-indexed); directions without arcs left out."""
        import pandas as pd

        rows = []
        for relation in self.relations(min_arcs=1):
            accuracy = self.accuracy(relation)
            for d, direction in enumerate(DIRECTIONS):
                arcs = int(self.counts.arcs[relation][d])
                for layer in range(self.counts.n_layers * bool(arcs)):
                    for head in range(self.counts.n_heads):
                        rows.append({"relation": relation, "direction": direction, "layer": layer, "head": head,
                                     "correct": int(self.counts.correct[relation][d, layer, head]),
                                     "arcs": arcs, "accuracy": float(accuracy[d, layer, head])})
        return pd.DataFrame(rows)

    def relations(self, min_arcs: int | None = None) -> list[str]:
        """Relations with at least ``min_arcs`` arcs, most frequent first (the any-relation row last).

        A base group (``nmod:*``) is left out when it holds no subtype (it would repeat ``nmod``)."""
        limit = self.min_arcs if min_arcs is None else min_arcs
        totals = {r: self.total_arcs(r) for r in self.counts.arcs}
        kept = [r for r, n in sorted(totals.items(), key=lambda pair: -pair[1])
                if n >= limit and r != ANY_RELATION and not self._repeats_its_base(r, totals)]
        return kept + ([ANY_RELATION] if ANY_RELATION in totals else [])

    @staticmethod
    def _repeats_its_base(relation: str, totals: dict[str, int]) -> bool:
        return relation.endswith(BASE_SUFFIX) and totals[relation] == totals.get(relation[:-len(BASE_SUFFIX)], -1)

    def direction_rows(self, relation: str) -> list[dict[str, Any]]:
        """Per direction with arcs: the chosen head (``best_head``: see :meth:`choice`), its accuracy and 95%
        interval here, where it was chosen and its accuracy there, the oracle head, and the best fixed offset."""
        total = self.total_arcs(relation)
        rows = []
        for d, direction in enumerate(DIRECTIONS):
            arcs = int(self.counts.arcs[relation][d])
            if not arcs:
                continue
            choice = self.choice(relation, d)
            offset, baseline = best_offset(self.counts.offsets[relation][d])
            low, high = choice.interval()
            rows.append({"relation": relation, "direction": direction, "arcs": arcs, "arcs_share": arcs / total,
                         "best_head": choice.name, "layer": choice.layer, "head": choice.head,
                         "accuracy": choice.accuracy, "ci_low": low, "ci_high": high,
                         "selected_on": choice.selected_on, "selection_accuracy": choice.selection_accuracy,
                         "oracle_head": choice.oracle_name, "oracle_direction": direction,
                         "oracle_accuracy": choice.oracle_accuracy,
                         "baseline_offset": offset, "baseline_accuracy": baseline})
        return rows

    def directions_frame(self, min_arcs: int | None = None) -> Any:
        """One row per relation and direction (see :meth:`direction_rows`)."""
        import pandas as pd

        return pd.DataFrame([row for relation in self.relations(min_arcs) for row in self.direction_rows(relation)])

    def best_heads(self, min_arcs: int | None = None) -> Any:
        """Per relation: the chosen head over both directions (the direction whose chosen head did best where it
        was chosen), its accuracy and interval, the oracle over both directions, and the best fixed-offset
        baseline on the same arcs. A direction with fewer than ``min_arcs`` arcs competes only when no direction
        has that many (a decoder sees few det arcs from determiner to noun)."""
        import pandas as pd

        limit = self.min_arcs if min_arcs is None else min_arcs
        rows = []
        for relation in self.relations(min_arcs):
            candidates = self.direction_rows(relation)
            enough = [row for row in candidates if row["arcs"] >= limit]
            pool = enough or [max(candidates, key=lambda row: row["arcs"])]
            oracle = max(pool, key=lambda row: row["oracle_accuracy"])
            rows.append({**max(pool, key=lambda row: row["selection_accuracy"]),
                         **{key: oracle[key] for key in ("oracle_head", "oracle_direction", "oracle_accuracy")}})
        return pd.DataFrame(rows)

    def offsets_frame(self) -> Any:
        """How often each offset (target position - source position) occurs, per relation and direction."""
        import pandas as pd

        return pd.DataFrame([{"relation": relation, "direction": direction, "offset": offset, "arcs": count,
                              "share": count / self.counts.arcs[relation][d]}
                             for relation in self.relations(min_arcs=1)
                             for d, direction in enumerate(DIRECTIONS)
                             for offset, count in sorted(self.counts.offsets[relation][d].items())])

    def save(self, folder: str | Path) -> Path:
        """Tables (CSV + DuckDB), charts and ``index.html`` in ``folder``; returns the page."""
        import pandas as pd

        from ..experiments.report import write_summary
        from .report import MAX_CHART_RELATIONS, plot_best_heads, plot_head_grid, write_tables

        folder = Path(folder)
        best = self.best_heads()
        note = f"heads: {self.annotation}"
        mismatches = {"kind": list(self.mismatches), "count": list(self.mismatches.values())}
        write_tables({"best_heads": best, "directions": self.directions_frame(), "head_accuracy": self.to_frame(),
                      "offsets": self.offsets_frame(), "mismatches": pd.DataFrame(mismatches)}, folder, "probe_deps")
        per_relation = best[best.relation != ANY_RELATION].head(MAX_CHART_RELATIONS)
        chosen = "best single head" if self.selection is None else f"head chosen on {self.selection_source}"
        plot_best_heads(per_relation, f"{self.model}: {chosen} per relation vs fixed-offset baseline "
                        f"({len(per_relation)} most frequent relations)\n{note}", folder / "best_heads.png",
                        oracle=self.selection is not None)
        overall = self.accuracy(ANY_RELATION).max(axis=0)  # [layer, head], better of the two directions
        plot_head_grid(overall, f"{self.model}: any relation, better direction per head\n{note}",
                       folder / "any_relation_heads.png")
        headline = self.headline()
        facts = {"annotation": note, "model": self.model, "heads": self.selection_note(),
                 "sentences": headline["sentences"],
                 "arcs scored": headline["arcs"],
                 "arcs left out (a word without word pieces)": headline["arcs_left_out"],
                 "sentences left out (longer than the model's limit)": headline["sentences_too_long"],
                 "directions": "decoder: only the backward direction of each arc is scored" if self.counts.causal
                 else "encoder: every arc in both directions",
                 **{f"Clark et al.'s {name}": ud for name, ud in CLARK_MAPPING.items()},
                 "any relation: head": f"{headline['any_relation_head']} ({headline['any_relation_direction']}) "
                 f"{headline['any_relation_acc']:.3f} vs fixed offset {headline['any_relation_baseline']:.3f}"
                 + ("" if self.selection is None else f"; oracle {headline['any_relation_oracle_head']} "
                    f"{headline['any_relation_oracle_acc']:.3f}"),
                 **{f"alignment: {kind}": count for kind, count in self.mismatches.items()},
                 "layers and heads": "0-indexed (layer-head)"}
        return write_summary(folder / "index.html", f"Dependency heads: {self.model} — {note}", facts,
                             ["best_heads.png", "any_relation_heads.png"], best, "Best head per relation")

    def _repr_html_(self) -> str:
        return str(self.best_heads().to_html(index=False, float_format=lambda v: f"{v:.3f}"))

    def headline(self) -> dict[str, Any]:
        """The JSON figures: ``best_head_acc`` {relation: {head, acc, baseline, ...}}, ``any_relation_acc``."""
        best = self.best_heads()
        per_relation = {row["relation"]: _figures(row) for row in best.to_dict("records")
                        if row["relation"] != ANY_RELATION}
        by_direction = {relation: {row["direction"]: _figures(row) for row in self.direction_rows(relation)}
                        for relation in self.relations() if relation != ANY_RELATION}
        overall = best[best.relation == ANY_RELATION].iloc[0]
        selection = {} if self.selection is None else {
            "selection_source": self.selection_source, "selection_sentences": self.selection.sentences,
            "selection_sentences_too_long": self.selection.too_long}
        return {"model": self.model, "annotation": self.annotation, "silver": self.silver,
                "heads_indexing": "layer-head, both 0-indexed", "sentences": self.counts.sentences,
                "sentences_too_long": self.counts.too_long, "causal": self.counts.causal,
                "selected_on": self.selected_on, "selection": self.selection_note(), **selection,
                "best_head_acc": per_relation, "by_direction": by_direction,
                "any_relation_acc": round(float(overall.accuracy), 4),
                "any_relation_head": overall.best_head, "any_relation_direction": overall.direction,
                "any_relation_oracle_head": overall.oracle_head,
                "any_relation_oracle_acc": round(float(overall.oracle_accuracy), 4),
                "any_relation_baseline": round(float(overall.baseline_accuracy), 4),
                "arcs": self.total_arcs(ANY_RELATION), "arcs_left_out": self.counts.dropped_arcs,
                "clark_mapping": CLARK_MAPPING, "mismatches": self.mismatches}


def _figures(row: dict[str, Any]) -> dict[str, Any]:
    """One chosen-head row as JSON figures: head, acc, ci, baseline (best fixed offset), direction, arcs, where the
    head was chosen (``selected_on``, its accuracy there: ``selection_acc``) and the oracle head here."""
    return {"head": row["best_head"], "acc": round(row["accuracy"], 4),
            "ci": [round(row["ci_low"], 4), round(row["ci_high"], 4)], "baseline": round(row["baseline_accuracy"], 4),
            "offset": int(row["baseline_offset"]), "direction": row["direction"], "arcs": int(row["arcs"]),
            "selected_on": row["selected_on"], "selection_acc": round(row["selection_accuracy"], 4),
            "oracle_head": row["oracle_head"], "oracle_direction": row["oracle_direction"],
            "oracle_head_acc": round(row["oracle_accuracy"], 4)}
