"""The dependency measurement is trustworthy: on a synthetic UD treebank (multiword tokens, relation
subtypes, prepositions, words split into several pieces) a head planted to follow every ``det`` arc
is found at 100%, the random heads are not, and a decoder's planted backward head is found too.

The attention is built at the level of word pieces, so the whole path is exercised: CoNLL-U
reading, piece-to-word alignment, Clark et al.'s word-level aggregation, counting, best-head choice.
"""

from __future__ import annotations

import numpy as np

from attnscope.probing.alignment import AlignedSentence, align_words, word_attention
from attnscope.probing.dependencies import DependencyResult, count_dependency_heads
from attnscope.probing.relations import labelled_arcs
from attnscope.probing.treebank import parse_conllu

N_LAYERS, N_HEADS = 3, 4
PLANTED = (1, 2)  # layer 1, head 2 (0-indexed)
NOUNS = ["dog", "telescope", "garden", "neighbour", "cat", "house"]
VERBS = ["saw", "watched", "found"]
ADJECTIVES = ["old", "enormous", "quiet"]


def synthetic_conllu(n: int, seed: int = 0) -> str:
    """``n`` UD sentences "Det (Adj) Noun (do n't) Verb Det Noun (in Det Noun) ." with gold heads."""
    rng = np.random.default_rng(seed)
    blocks = []
    for number in range(n):
        lines, words = [], []  # words: (form, head 1-indexed, relation, upos)
        adjective = rng.random() < 0.5
        subject = len(words) + 1
        words.append(("The", 0, "det", "DET"))
        if adjective:
            words.append((str(rng.choice(ADJECTIVES)), 0, "amod", "ADJ"))
        noun = len(words) + 1
        words.append((str(rng.choice(NOUNS)), 0, "nsubj", "NOUN"))
        negated = rng.random() < 0.4
        if negated:
            words += [("do", 0, "aux", "AUX"), ("n't", 0, "advmod", "PART")]
        verb = len(words) + 1
        words.append((str(rng.choice(VERBS)), 0, "root", "VERB"))
        words += [("a", 0, "det", "DET"), (str(rng.choice(NOUNS)), 0, "obj", "NOUN")]
        if rng.random() < 0.5:
            words += [("in", 0, "case", "ADP"), ("the", 0, "det", "DET"), (str(rng.choice(NOUNS)), 0, "obl:in", "NOUN")]
        words.append((".", 0, "punct", "PUNCT"))
        heads = []
        for index, (_, _, relation, _) in enumerate(words, 1):
            heads.append({"det": index + 1 if words[index - 1][0] != "The" else noun, "amod": noun, "nsubj": verb,
                          "aux": verb, "advmod": verb, "root": 0, "obj": verb, "case": index + 2, "obl:in": verb,
                          "punct": verb}[relation])
        heads[subject - 1] = noun
        lines += [f"# sent_id = s{number}", "# newdoc id = synthetic" if number == 0 else "# synthetic"]
        for index, ((form, _, relation, upos), head) in enumerate(zip(words, heads), 1):
            if form == "do":
                lines.append(f"{index}-{index + 1}\tdon't\t_\t_\t_\t_\t_\t_\t_\t_")
            space = "SpaceAfter=No" if index < len(words) and words[index][0] in (".", "n't") else "_"
            lines.append("\t".join([str(index), form, form.lower(), upos, "_", "_", str(head), relation, "_", space]))
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks) + "\n"


def pieces(spans: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """Word pieces of the distinct surface spans: words longer than 4 characters split in two."""
    out: list[tuple[int, int]] = []
    for start, end in dict.fromkeys(spans):
        out += [(start, start + 3), (start + 3, end)] if end - start > 4 else [(start, end)]
    return out


def planted_attention(sentence, rng, causal: bool, source_target) -> tuple[np.ndarray, list, list]:
    """Piece-level attention ``[layer, head, q_tok, k_tok]`` over [CLS] pieces [SEP]: random rows
    (lower-triangular for a decoder), and at ``PLANTED`` every piece of a word ``w`` with a target
    ``source_target[w]`` gives 0.7 to that word's pieces."""
    offsets = [(0, 0), *pieces(sentence.spans), (0, 0)]
    special = [True] + [False] * (len(offsets) - 2) + [True]
    n = len(offsets)
    attention = rng.dirichlet(np.ones(n), size=(N_LAYERS, N_HEADS, n)).astype(np.float32)
    if causal:
        attention = np.tril(attention)
        attention /= attention.sum(-1, keepdims=True)
    alignment = align_words(sentence.spans, offsets, special)
    for source, target in source_target.items():
        for q in alignment.groups[source]:
            row = attention[PLANTED][q]
            row *= 0.3 / row.sum()
            keys = alignment.groups[target]
            row[list(keys)] += 0.7 / len(keys)
    return attention, offsets, special


def result_of(causal: bool, direction: str, n: int = 120) -> DependencyResult:
    """Every sentence's attention with a head planted on the det arcs in ``direction``."""
    rng = np.random.default_rng(1)
    treebank = parse_conllu(synthetic_conllu(n), source="synthetic.conllu")
    aligned = []
    for sentence in treebank.sentences:
        arcs = [(dep, head) for dep, head, rel in sentence.arcs() if rel == "det"]
        planted = dict(arcs) if direction == "dependent->head" else {head: dep for dep, head in arcs}
        attention, offsets, special = planted_attention(sentence, rng, causal, planted)
        alignment = align_words(sentence.spans, offsets, special)
        aligned.append(AlignedSentence(sentence, word_attention(attention, alignment), alignment.aligned))
    return DependencyResult(count_dependency_heads(aligned, causal=causal), "planted", treebank.annotation, False,
                            {}, min_arcs=20)


def test_the_synthetic_treebank_is_read_as_ud_with_multiword_tokens_and_subtypes():
    treebank = parse_conllu(synthetic_conllu(40), source="synthetic.conllu")
    negated = next(s for s in treebank.sentences if "n't" in s.words)
    assert "don't" in negated.text and negated.spans[negated.words.index("do")] == negated.spans[
        negated.words.index("n't")]
    labels = {label for s in treebank.sentences for _, _, label in labelled_arcs(s)}
    assert {"obl:in", "obl:*", "dobj", "pobj", "obj", "det"} <= labels


def test_a_head_planted_on_every_det_arc_is_found_at_100_percent():
    result = result_of(causal=False, direction="dependent->head")
    best = result.best_heads().set_index("relation")
    assert best.loc["det", "best_head"] == "1-2" and best.loc["det", "accuracy"] == 1.0
    assert best.loc["det", "direction"] == "dependent->head" and best.loc["det", "arcs"] > 200
    assert best.loc["det", "ci_low"] > 0.98 and best.loc["det", "ci_high"] == 1.0
    accuracy = result.accuracy("det")[0]  # [layer, head], dependent->head
    assert np.sort(accuracy.ravel())[-2] < 0.8  # no random head comes near
    assert best.loc["nsubj", "accuracy"] < 0.8  # the planted head knows det only
    # the fixed-offset baseline on det: +1 ("The dog") or +2 ("The old dog"), never 100%
    assert best.loc["det", "baseline_offset"] in (1, 2) and best.loc["det", "baseline_accuracy"] < 1.0


def test_a_decoders_planted_backward_head_is_found_and_forward_arcs_are_not_scored():
    result = result_of(causal=True, direction="head->dependent")
    assert result.counts.arcs["det"].tolist()[0] == 0  # determiners precede their noun: never backwards
    best = result.best_heads().set_index("relation")
    assert best.loc["det", "best_head"] == "1-2" and best.loc["det", "accuracy"] == 1.0
    assert best.loc["det", "direction"] == "head->dependent"
    # pobj (nominal -> preposition, the preposition first) is backward dependent->head only
    assert result.counts.arcs["pobj"][1] == 0 and result.counts.arcs["pobj"][0] > 0
    assert result.headline()["causal"] is True
