"""Dependency heads on hand-made attention: a head pointing exactly at syntactic heads scores 100%."""

from __future__ import annotations

from collections import Counter

import numpy as np

from attnscope.probing.alignment import AlignedSentence, align_words, word_attention
from attnscope.probing.dependencies import ANY_RELATION, DependencyResult, best_offset, count_dependency_heads
from attnscope.probing.treebank import ROOT, sentence_from_units

N_LAYERS, N_HEADS = 2, 2


def tree(words_heads_relations: list[tuple[str, int, str]]):
    return sentence_from_units([(word, True, [(word, head, rel, "_")]) for word, head, rel in words_heads_relations])


# "The cat chased a mouse": det, nsubj, root, det, dobj
CHASE = tree([("The", 1, "det"), ("cat", 2, "nsubj"), ("chased", ROOT, "root"), ("a", 4, "det"), ("mouse", 2, "dobj")])
# "dogs bark loudly": nsubj, root, advmod
BARK = tree([("dogs", 1, "nsubj"), ("bark", ROOT, "root"), ("loudly", 1, "advmod")])


def token_attention(sentence, targets: dict[tuple[int, int], list[int]]) -> np.ndarray:
    """Token-level attention over [CLS] words [SEP]: most mass on the specials, then on the word
    ``targets[(layer, head)][word]``; the other words share what is left."""
    n = len(sentence)
    attention = np.zeros((N_LAYERS, N_HEADS, n + 2, n + 2), dtype=np.float32)
    for layer in range(N_LAYERS):
        for head in range(N_HEADS):
            chosen = targets.get((layer, head), [(w - 1) % n for w in range(n)])  # default: previous word
            for word in range(n):
                row = attention[layer, head, word + 1]
                row[0], row[-1] = 0.4, 0.3  # [CLS] and [SEP] get more than any word
                row[1:-1] = 0.05 / max(1, n - 1)
                row[chosen[word] + 1] = 0.25
    return attention


def aligned(sentence, targets, unaligned: tuple[int, ...] = ()) -> AlignedSentence:
    offsets = [(0, 0), *[span for w, span in enumerate(sentence.spans) if w not in unaligned], (0, 0)]
    kept = [w for w in range(len(sentence)) if w not in unaligned]
    attention = token_attention(sentence, targets)[:, :, [0, *[w + 1 for w in kept], len(sentence) + 1]][
        :, :, :, [0, *[w + 1 for w in kept], len(sentence) + 1]]
    alignment = align_words(sentence.spans, offsets, [True] + [False] * len(kept) + [True])
    return AlignedSentence(sentence, word_attention(attention, alignment), alignment.aligned)


def syntactic_heads(sentence) -> list[int]:
    return [head if head != ROOT else word for word, head in enumerate(sentence.heads)]


def result_for(sentences) -> DependencyResult:
    return DependencyResult(count_dependency_heads(sentences), "hand-made", "gold: hand-made", False, {}, min_arcs=1)


def test_a_head_pointing_at_syntactic_heads_gets_every_relation_right_despite_specials():
    targets_chase = {(0, 0): syntactic_heads(CHASE), (1, 1): [0, 0, 1, 3, 3]}  # 1-1: heads -> a dependent
    targets_bark = {(0, 0): syntactic_heads(BARK), (1, 1): [0, 0, 2]}
    result = result_for([aligned(CHASE, targets_chase), aligned(BARK, targets_bark)])
    for relation in ("det", "nsubj", "dobj", "advmod", ANY_RELATION):
        assert result.accuracy(relation)[0, 0, 0] == 1.0  # dependent->head, layer 0 head 0
    # layer 1 head 1 points from head words to dependents: cat->The, mouse->a, chased->cat, bark->dogs
    head_to_dependent = {rel: result.accuracy(rel)[1, 1, 1] for rel in ("det", "nsubj", "dobj", "advmod")}
    assert head_to_dependent == {"det": 1.0, "nsubj": 1.0, "dobj": 0.0, "advmod": 0.0}
    best = result.best_heads().set_index("relation")
    assert best.loc["det", "best_head"] == "0-0" and best.loc["det", "accuracy"] == 1.0
    headline = result.headline()
    assert headline["best_head_acc"]["dobj"] == {"head": "0-0", "acc": 1.0, "baseline": 1.0, "offset": -2,
                                                 "ci": [0.2065, 1.0], "direction": "dependent->head", "arcs": 1,
                                                 "selected_on": "scored data", "selection_acc": 1.0,
                                                 "oracle_head": "0-0", "oracle_direction": "dependent->head",
                                                 "oracle_head_acc": 1.0}
    assert headline["selected_on"] == "scored data" and "scored on" in headline["selection"]
    assert headline["any_relation_acc"] == 1.0 and headline["arcs"] == 6


def test_fixed_offset_baselines_on_a_hand_made_tree():
    result = result_for([aligned(CHASE, {}), aligned(BARK, {})])
    rows = result.directions_frame().set_index(["relation", "direction"])
    # dependent->head, head position - dependent position: det +1 +1, nsubj +1 +1, dobj -2, advmod -1
    offsets = rows.xs("dependent->head", level="direction")
    assert offsets.loc["det", ["baseline_offset", "baseline_accuracy"]].tolist() == [1, 1.0]
    assert offsets.loc["dobj", ["baseline_offset", "baseline_accuracy"]].tolist() == [-2, 1.0]
    assert offsets.loc["advmod", ["baseline_offset", "baseline_accuracy"]].tolist() == [-1, 1.0]
    assert offsets.loc[ANY_RELATION, ["baseline_offset", "baseline_accuracy"]].tolist() == [1, 4 / 6]
    # head->dependent: the same offsets with the opposite sign
    assert rows.loc[("dobj", "head->dependent"), "baseline_offset"] == 2
    # the default "previous word" heads get exactly the arcs whose head is the previous word: advmod
    assert result.accuracy("advmod")[0, 0, 0] == 1.0 and result.accuracy("det")[0, 0, 0] == 0.0
    assert best_offset(Counter({2: 1, -2: 1, 1: 1})) == (1, 1 / 3)  # ties go to the shortest offset


def test_arcs_touching_a_word_without_pieces_are_left_out_and_counted():
    counts = count_dependency_heads([aligned(CHASE, {(0, 0): syntactic_heads(CHASE)}, unaligned=(3,))])
    assert counts.dropped_arcs == 1  # a -> mouse
    assert counts.arcs["det"].tolist() == [1, 1] and counts.arcs[ANY_RELATION].tolist() == [3, 3]
    result = DependencyResult(counts, "m", "gold: x", False, {}, min_arcs=1)
    frame = result.to_frame()
    assert set(frame.columns) >= {"relation", "direction", "layer", "head", "accuracy"}
    assert "det:*" not in result.relations(min_arcs=1)  # a base group without subtypes repeats its relation
    assert len(frame) == len(result.relations(min_arcs=1)) * 2 * N_LAYERS * N_HEADS


def wilson(hits: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval, written out from its formula (an independent reference)."""
    p = hits / n
    centre, half = p + z * z / (2 * n), z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def test_a_head_chosen_on_dev_is_scored_on_test_beside_the_best_head_on_test():
    # dev: head 1-1 points every word at its syntactic head, 0-0 at the previous word (no det right)
    dev = [aligned(CHASE, {(1, 1): syntactic_heads(CHASE)}), aligned(BARK, {(1, 1): syntactic_heads(BARK)})]
    # test: 0-0 gets every arc right; 1-1 misses "The -> cat" in one of two copies of the sentence
    missing_the = syntactic_heads(CHASE)
    missing_the[0] = 4
    test = [aligned(CHASE, {(0, 0): syntactic_heads(CHASE), (1, 1): missing_the}),
            aligned(CHASE, {(0, 0): syntactic_heads(CHASE), (1, 1): syntactic_heads(CHASE)})]
    result = DependencyResult(count_dependency_heads(test), "hand-made", "gold: hand-made", False, {}, min_arcs=1,
                              selection=count_dependency_heads(dev), selection_source="dev.conllu")
    # the direct computation on test: det arcs (dependent -> head) that head 1-1's most-attended word gets right
    det_arcs = [(s, dep, head) for s in test for dep, head, rel in s.words.arcs() if rel == "det"]
    hits = sum(int(s.most_attended()[1, 1, dep] == head) for s, dep, head in det_arcs)
    assert (hits, len(det_arcs)) == (3, 4)
    row = next(r for r in result.direction_rows("det") if r["direction"] == "dependent->head")
    assert row["best_head"] == "1-1" and row["selected_on"] == "dev" and row["selection_accuracy"] == 1.0
    assert row["accuracy"] == hits / len(det_arcs)
    assert np.allclose([row["ci_low"], row["ci_high"]], wilson(hits, len(det_arcs)))
    assert row["oracle_head"] == "0-0" and row["oracle_accuracy"] == 1.0
    headline = result.headline()
    assert headline["selected_on"] == "dev" and headline["selection_source"] == "dev.conllu"
    assert headline["selection_sentences"] == 2 and "chosen on dev.conllu" in headline["selection"]
    figures = headline["by_direction"]["det"]["dependent->head"]
    assert (figures["head"], figures["acc"], figures["oracle_head"], figures["oracle_head_acc"]) == ("1-1", 0.75, "0-0",
                                                                                                   1.0)


def test_a_relation_absent_from_dev_is_chosen_on_the_scored_data_and_says_so():
    dev = [aligned(BARK, {})]  # no det, no dobj
    test = [aligned(CHASE, {(0, 0): syntactic_heads(CHASE)})]
    result = DependencyResult(count_dependency_heads(test), "m", "gold: x", False, {}, min_arcs=1,
                              selection=count_dependency_heads(dev), selection_source="dev.conllu")
    rows = {r["direction"]: r for r in result.direction_rows("dobj")}
    assert rows["dependent->head"]["selected_on"] == "scored data (no dev arcs)"
    assert rows["dependent->head"]["best_head"] == rows["dependent->head"]["oracle_head"] == "0-0"
    assert result.direction_rows("nsubj")[0]["selected_on"] == "dev"
