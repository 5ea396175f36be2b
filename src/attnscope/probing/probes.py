"""Attention-only probes: logistic regressions on the attention between two words.

The feature vector of an ordered word pair ``(i, j)`` is every head's attention from ``i`` to
``j`` followed by every head's attention from ``j`` to ``i``: ``2 * layers * heads`` numbers,
word-level (Clark et al. 2019's aggregation). Three probes (Coenen et al. 2019; Clark et al. 2019):

* **edge** (binary): is there a dependency arc between two words? Each sentence gives its arcs
  and as many word pairs without an arc (seeded sample), so chance is 50%.
* **relation** (multiclass): which relation labels an arc (features ordered dependent, head)?
* **parser** (Clark's attention-only probe): score every candidate head of each word, pick the
  best; reported as UAS over words that have a head, punctuation excluded.

Sentences are split into train and test (seeded, by sentence, so no sentence is in both). One
split is one draw: with several seeds, each gives its own split and pair sample, and every figure
is reported as its mean and range over them (the model runs once; only the regressions repeat).
Baselines: the same probes on word distance alone (one-hot offsets), on the attention of the same
architecture with re-initialised weights (see :func:`reinitialised_model`), the majority class
(relation) and right-branching (parser: every word's head is the next word).
"""

from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..analysis.evaluate import mean_and_range
from ..errors import AttnscopeError
from .alignment import AlignedSentence

MAX_OFFSET = 10  # distance features: one-hot offsets, clipped at +-10 words
PARSER_NEGATIVES = 6  # wrong candidate heads kept per training word (all are scored at test time)
MIN_CLASS_ARCS = 10  # relations with fewer training arcs are left out of the relation probe (counted)
PUNCTUATION = {"punct", "PUNCT"}


def pair_features(attention: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """``[pair, 2 * layer * head]``: attention ``i -> j`` of every head, then ``j -> i``.

    ``attention`` is ``[layer, head, word, word]``; ``i`` and ``j`` are word positions ``[pair]``.
    """
    forward = attention[:, :, i, j]  # [layer, head, pair]
    backward = attention[:, :, j, i]
    n_layers, n_heads = attention.shape[:2]
    return np.concatenate([forward.reshape(n_layers * n_heads, -1), backward.reshape(n_layers * n_heads, -1)]).T


def offset_features(offsets: np.ndarray) -> np.ndarray:
    """``[pair, 2 * MAX_OFFSET + 1]`` one-hot of the signed offset, clipped to +-``MAX_OFFSET``."""
    clipped = np.clip(offsets, -MAX_OFFSET, MAX_OFFSET) + MAX_OFFSET
    return np.eye(2 * MAX_OFFSET + 1, dtype=np.float32)[clipped]


@dataclass
class ProbeSet:
    """Rows of one probe: attention features, the word offset of each pair, label, sentence, test flag."""

    features: list[np.ndarray] = field(default_factory=list)
    offsets: list[np.ndarray] = field(default_factory=list)
    labels: list[np.ndarray] = field(default_factory=list)
    sentence: list[np.ndarray] = field(default_factory=list)
    test: list[np.ndarray] = field(default_factory=list)
    words: list[np.ndarray] = field(default_factory=list)  # parser: the dependent each row scores a head for

    def add(self, attention: np.ndarray, i: np.ndarray, j: np.ndarray, labels: np.ndarray, sentence: int,
            test: bool, words: np.ndarray | None = None) -> None:
        if not len(i):
            return
        self.features.append(pair_features(attention, i, j))
        self.offsets.append(j - i)
        self.labels.append(labels)
        self.sentence.append(np.full(len(i), sentence))
        self.test.append(np.full(len(i), test))
        self.words.append(words if words is not None else i)

    def arrays(self) -> dict[str, np.ndarray]:
        if not self.features:
            raise AttnscopeError("no word pairs to probe (are the sentences aligned and parsed?)")
        return {"features": np.concatenate(self.features).astype(np.float32), "offsets": np.concatenate(self.offsets),
                "labels": np.concatenate(self.labels), "sentence": np.concatenate(self.sentence),
                "test": np.concatenate(self.test).astype(bool), "words": np.concatenate(self.words)}


def held_out_sentences(n_sentences: int, test_share: float = 0.2, seed: int = 0) -> np.ndarray:
    """``[sentence]`` bool: a seeded random ``test_share`` of sentences is held out for testing."""
    if not 0 < test_share < 1:
        raise AttnscopeError("the test share must be between 0 and 1")
    order = np.random.default_rng(seed).permutation(n_sentences)
    test = np.zeros(n_sentences, dtype=bool)
    test[order[: max(1, round(test_share * n_sentences))]] = True
    return test


@dataclass
class ProbeData:
    """The three probes' rows, collected in one pass over the sentences."""

    edge: ProbeSet = field(default_factory=ProbeSet)
    relation: ProbeSet = field(default_factory=ProbeSet)
    parser: ProbeSet = field(default_factory=ProbeSet)
    right_branching: list[bool] = field(default_factory=list)  # per test word of the parser


def collect(sentences: Iterable[AlignedSentence], is_test: np.ndarray, seed: int = 0) -> ProbeData:
    """Rows for the three probes. The sampling of pairs depends only on the trees and ``seed``, so
    two models' attention over the same sentences gives the same pairs."""
    data = ProbeData()
    for index, sentence in enumerate(sentences):
        rng = np.random.default_rng([seed, index])
        test = bool(is_test[index])
        arcs = [(d, h, r) for d, h, r in sentence.words.arcs() if sentence.aligned[d] and sentence.aligned[h]]
        _edge_rows(data.edge, sentence, arcs, rng, index, test)
        if arcs:
            dep, head = np.array([a[0] for a in arcs]), np.array([a[1] for a in arcs])
            data.relation.add(sentence.attention, dep, head, np.array([a[2] for a in arcs]), index, test)
        _parser_rows(data, sentence, arcs, rng, index, test)
    return data


def _edge_rows(edge: ProbeSet, sentence: AlignedSentence, arcs: list[tuple[int, int, str]],
               rng: np.random.Generator, index: int, test: bool) -> None:
    """Arcs (as left, right word pairs) and as many seeded pairs without an arc."""
    positive = {(min(d, h), max(d, h)) for d, h, _ in arcs}
    aligned = np.flatnonzero(sentence.aligned)
    others = [(a, b) for n, a in enumerate(aligned) for b in aligned[n + 1:] if (a, b) not in positive]
    chosen = [others[k] for k in rng.permutation(len(others))[: len(positive)]]
    pairs = sorted(positive) + chosen
    if pairs:
        left, right = np.array(pairs).T
        edge.add(sentence.attention, left, right, np.array([1] * len(positive) + [0] * len(chosen)), index, test)


def _parser_rows(data: ProbeData, sentence: AlignedSentence, arcs: list[tuple[int, int, str]],
                 rng: np.random.Generator, index: int, test: bool) -> None:
    """Each non-punctuation word with a head: its head and its other candidate heads (a sample when training)."""
    aligned = np.flatnonzero(sentence.aligned)
    n_words = len(sentence.aligned)
    upos = sentence.words.upos or ("_",) * n_words
    for dep, head, relation in arcs:
        if relation in PUNCTUATION or upos[dep] in PUNCTUATION:
            continue
        wrong = aligned[(aligned != dep) & (aligned != head)]
        if not test:
            wrong = rng.permutation(wrong)[:PARSER_NEGATIVES]
        candidates = np.concatenate([[head], wrong]).astype(int)
        data.parser.add(sentence.attention, np.full(len(candidates), dep), candidates,
                        (candidates == head).astype(int), index, test, words=np.full(len(candidates), dep))
        if test:
            guess = dep + 1 if dep + 1 < n_words else dep - 1
            data.right_branching.append(guess == head)


# ---- training and scoring ------------------------------------------------------------------------
def _classifier(seed: int) -> Any:
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, random_state=seed))


def _inputs(rows: dict[str, np.ndarray], features: str) -> np.ndarray:
    return offset_features(rows["offsets"]) if features == "distance" else rows["features"]


def classification_accuracy(rows: dict[str, np.ndarray], features: str = "attention", seed: int = 0) -> float:
    """Test accuracy of a logistic regression trained on the training sentences' rows."""
    inputs, labels, test = _inputs(rows, features), _trainable(rows), rows["test"]
    model = _classifier(seed).fit(inputs[~test], labels[~test])
    return float(model.score(inputs[test], labels[test]))  # scikit-learn's accuracy


def _trainable(rows: dict[str, np.ndarray]) -> np.ndarray:
    """The labels, once sure there are two classes to train on and rows to test on."""
    labels, test = rows["labels"], rows["test"]
    if len(set(labels[~test])) < 2 or not test.any():
        raise AttnscopeError("too few sentences to train and test a probe; use more sentences")
    return labels


def majority_accuracy(rows: dict[str, np.ndarray]) -> float:
    """Test accuracy of always predicting the most frequent training label."""
    labels, test = _trainable(rows), rows["test"]
    majority = Counter(labels[~test]).most_common(1)[0][0]
    return float((labels[test] == majority).mean())


def relation_rows(rows: dict[str, np.ndarray], min_arcs: int = MIN_CLASS_ARCS) -> tuple[dict[str, np.ndarray], int]:
    """Rows whose relation has at least ``min_arcs`` training arcs, and how many were left out."""
    counts = Counter(rows["labels"][~rows["test"]])
    keep = np.array([counts[label] >= min_arcs for label in rows["labels"]], dtype=bool)
    return {key: value[keep] for key, value in rows.items()}, int((~keep).sum())


def parser_uas(rows: dict[str, np.ndarray], features: str = "attention", seed: int = 0) -> float:
    """UAS on test words: a binary head-or-not regression scores every candidate; the best one wins."""
    inputs, labels, test = _inputs(rows, features), _trainable(rows), rows["test"]
    model = _classifier(seed).fit(inputs[~test], labels[~test])
    scores = model.decision_function(inputs[test])
    # one group per (sentence, dependent): the candidate with the highest score is the predicted head
    keys = rows["sentence"][test] * 100_000 + rows["words"][test]
    order = np.lexsort((-scores, keys))
    first = np.ones(len(order), dtype=bool)
    first[1:] = keys[order][1:] != keys[order][:-1]
    return float(labels[test][order][first].mean())


@dataclass(frozen=True)
class ProbeResult:
    """Test accuracies of the probes and their baselines, with the sizes they were measured on.

    ``per_seed``: each seed's figures (one split and pair sample each); ``figures`` are their means.
    ``sizes`` are those of the first seed's split."""

    figures: dict[str, float]
    sizes: dict[str, int]
    model: str
    annotation: str
    silver: bool
    per_seed: tuple[dict[str, float], ...] = ()
    seeds: tuple[int, ...] = (0,)

    @classmethod
    def over_seeds(cls, per_seed: Sequence[dict[str, float]], sizes: dict[str, int], model: str, annotation: str,
                   silver: bool, seeds: Sequence[int]) -> ProbeResult:
        """A result whose figures are the means of ``per_seed`` (one dict of figures per seed of ``seeds``)."""
        figures = {key: float(np.mean([run[key] for run in per_seed])) for key in per_seed[0]}
        return cls(figures, sizes, model, annotation, silver, tuple(per_seed), tuple(seeds))

    def ranges(self) -> dict[str, dict[str, float]]:
        """``{figure: {mean, min, max}}`` over the seeds (a single seed: all three equal)."""
        runs = self.per_seed or (self.figures,)
        return {key: mean_and_range([run[key] for run in runs]) for key in self.figures}

    def to_frame(self) -> Any:
        """One row per probe and features: the test accuracy (the mean over seeds) and, over several seeds, its
        range."""
        import pandas as pd

        ranges = self.ranges() if len(self.seeds) > 1 else {}
        rows = []
        for probe, names in PROBE_ROWS.items():
            for key, label in names:
                if key in self.figures:
                    spread = {"min": ranges[key]["min"], "max": ranges[key]["max"]} if ranges else {}
                    rows.append({"probe": probe, "features": label, "test_accuracy": self.figures[key], **spread})
        return pd.DataFrame(rows)

    def save(self, folder: str | Path) -> Path:
        """Tables (CSV + DuckDB), the chart and ``index.html`` in ``folder``; returns the page."""
        import pandas as pd

        from ..experiments.report import write_summary
        from .report import plot_probes, write_tables

        folder = Path(folder)
        frame = self.to_frame()
        note = f"heads: {self.annotation}"
        write_tables({"probes": frame, "sizes": pd.DataFrame({"size": list(self.sizes),
                                                              "value": list(self.sizes.values())})},
                     folder, "probe_edges")
        plot_probes(frame, f"{self.model}: attention-only probes (logistic regression, test sentences)\n{note}",
                    folder / "probes.png")
        facts = {"annotation": note, "model": self.model, **self.sizes,
                 "seeds": f"{', '.join(map(str, self.seeds))}: each its own split and pair sample; figures are the "
                 "mean over seeds with their range; sizes are the first seed's" if len(self.seeds) > 1 else
                 str(self.seeds[0]),
                 "features": "every head's attention between the two words, both directions (word level)"}
        return write_summary(folder / "index.html", f"Attention-only probes: {self.model} — {note}", facts,
                             ["probes.png"], frame, "Probes and baselines")

    def _repr_html_(self) -> str:
        return str(self.to_frame().to_html(index=False, float_format=lambda v: f"{v:.3f}"))

    def headline(self) -> dict[str, Any]:
        """Each figure (the mean over seeds), the sizes, and over several seeds ``over_seeds`` {figure: {mean, min,
        max}} and ``seeds``."""
        spread = {"seeds": list(self.seeds), "over_seeds": self.ranges()} if len(self.seeds) > 1 else {}
        return {"model": self.model, "annotation": self.annotation, "silver": self.silver,
                **{key: round(value, 4) for key, value in self.figures.items()}, "sizes": self.sizes, **spread}


PROBE_ROWS = {
    "edge (binary)": [("edge_probe_acc", "attention"), ("edge_distance_acc", "distance only"),
                      ("edge_reinit_acc", "re-initialised attention")],
    "relation (multiclass)": [("relation_probe_acc", "attention"), ("relation_distance_acc", "distance only"),
                              ("relation_reinit_acc", "re-initialised attention"),
                              ("relation_majority_acc", "majority class")],
    "parser (UAS)": [("uas", "attention"), ("uas_distance", "distance only"), ("uas_reinit", "re-initialised attention"),
                     ("uas_right_branching", "right-branching")],
}


def evaluate_over_seeds(sentences: Sequence[AlignedSentence], reinit: Sequence[AlignedSentence] | None,
                        seeds: Sequence[int], test_share: float = 0.2) -> tuple[list[dict[str, float]], dict[str, int]]:
    """:func:`evaluate_probes` once per seed, each with its own split (:func:`held_out_sentences`) and pair sample;
    ``reinit``: the same sentences' attention from a re-initialised model. Each seed's figures, the first's sizes."""
    per_seed, sizes = [], None
    for seed in seeds:
        is_test = held_out_sentences(len(sentences), test_share, seed)
        figures, seed_sizes = evaluate_probes(collect(sentences, is_test, seed),
                                              None if reinit is None else collect(reinit, is_test, seed), seed)
        per_seed.append(figures)
        sizes = sizes or seed_sizes
    assert sizes is not None, "no seeds"
    return per_seed, sizes


def evaluate_probes(data: ProbeData, reinit: ProbeData | None = None, seed: int = 0) -> tuple[dict[str, float],
                                                                                          dict[str, int]]:
    """Every probe and baseline on collected rows (``reinit``: the same rows from a re-initialised model)."""
    edge = data.edge.arrays()
    relation, rare = relation_rows(data.relation.arrays())
    parser = data.parser.arrays()
    figures = {
        "edge_probe_acc": classification_accuracy(edge, seed=seed),
        "edge_distance_acc": classification_accuracy(edge, "distance", seed),
        "relation_probe_acc": classification_accuracy(relation, seed=seed),
        "relation_distance_acc": classification_accuracy(relation, "distance", seed),
        "relation_majority_acc": majority_accuracy(relation),
        "uas": parser_uas(parser, seed=seed),
        "uas_distance": parser_uas(parser, "distance", seed),
        "uas_right_branching": float(np.mean(data.right_branching)),
    }
    if reinit is not None:
        figures["edge_reinit_acc"] = classification_accuracy(reinit.edge.arrays(), seed=seed)
        figures["relation_reinit_acc"] = classification_accuracy(relation_rows(reinit.relation.arrays())[0], seed=seed)
        figures["uas_reinit"] = parser_uas(reinit.parser.arrays(), seed=seed)
    sizes = {"edge_train_pairs": int((~edge["test"]).sum()), "edge_test_pairs": int(edge["test"].sum()),
             "relation_classes": len(set(relation["labels"])), "relation_test_arcs": int(relation["test"].sum()),
             "relation_arcs_left_out_rare": rare, "parser_test_words": len(data.right_branching),
             "test_sentences": len(set(edge["sentence"][edge["test"]])),
             "train_sentences": len(set(edge["sentence"][~edge["test"]]))}
    return figures, sizes


# ---- the re-initialised baseline model -----------------------------------------------------------
def reinitialised_model(loaded: Any, seed: int = 0) -> Any:
    """The same architecture and tokenizer with freshly initialised (seeded) weights, loaded through attnscope.

    The model is saved to a temporary folder and loaded with :func:`attnscope.load_model`, so its
    attention goes through attnscope's capture like the trained model's; the folder is removed
    once the weights are in memory.
    """
    import torch

    from ..capture.loading import load_model

    torch.manual_seed(seed)
    model = type(loaded.model)(loaded.model.config)
    with tempfile.TemporaryDirectory(prefix="attnscope-reinit-") as folder:
        model.save_pretrained(folder)
        loaded.tokenizer.save_pretrained(folder)
        return load_model(folder, dtype=loaded.dtype, device=loaded.device)
