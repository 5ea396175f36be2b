"""Coreference on gold documents: Entity= brackets on hand-made lines, windows, baselines, and a planted
coreference head found at 100% on synthetic documents (the whole path from CoNLL-U to the result)."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import numpy as np
import pytest

from attnscope.errors import AttnscopeError
from attnscope.probing.alignment import AlignedSentence, align_words, word_attention
from attnscope.probing.chains import OUTSIDE, Window, WindowText, plan_documents, plan_windows, score_chains
from attnscope.probing.documents import documents_of, mentions_from, parse_entity_field
from attnscope.probing.treebank import parse_conllu

N_LAYERS, N_HEADS = 2, 3
PLANTED = (1, 0)
NOUNS = ["dog", "farmer", "teacher", "house", "river"]


def test_entity_brackets_open_close_single_and_several_on_one_word():
    brackets = parse_entity_field("(7-abstract-new-nnnss-cf6-2-coref(3-abstract-giv:act-sssss-cf1-1-coref)17)")
    assert [(b.kind, b.eid) for b in brackets] == [("open", "7"), ("single", "3"), ("close", "17")]
    assert brackets[0].attributes == "abstract-new-nnnss-cf6-2-coref"
    disc = parse_entity_field("(e5[1/2]-person-new")[0]
    assert (disc.kind, disc.eid, disc.part) == ("open", "e5", (1, 2))
    with pytest.raises(AttnscopeError):
        parse_entity_field("(2-x)junk")


def test_mentions_nested_discontinuous_and_their_head_words():
    # 0 The 1 old 2 man 3 's 4 dog 5 , 6 he 7 said 8 , 9 barked
    entities = ["(1-person(2-animal", "", "(3-person-a)", "", "2)1)", "", "(3-person-b)", "", "", ""]
    heads = [2, 2, 4, 2, 9, 9, 7, 9, 9, -1]
    mentions, problems = mentions_from(entities, heads)
    spans = {(m.entity, m.words): m.head for m in mentions}
    assert spans == {("2", (0, 1, 2, 3, 4)): 4, ("1", (0, 1, 2, 3, 4)): 4, ("3", (2,)): 2, ("3", (6,)): 6}
    assert not problems
    # a discontinuous mention: words 0-1 and 4, one mention of entity e9 headed by word 4
    split = ["(e9[1/2]-thing", "e9[1/2])", "", "", "(e9[2/2]-thing)"]
    [mention], _ = mentions_from(split, [4, 4, 4, 4, -1])
    assert mention.words == (0, 1, 4) and mention.head == 4
    _, problems = mentions_from(["(4-x", "5)"], [-1, 0])
    assert problems == Counter({"opening bracket never closed": 1, "closing bracket without an opening": 1})


def test_windows_cover_every_word_once_within_the_budget_and_overlap_by_half():
    rng = np.random.default_rng(0)
    counts = list(rng.integers(1, 4, size=300))
    windows = plan_windows(counts, 40)
    owned = [w for window in windows for w in range(window.own, window.end)]
    assert owned == list(range(300))  # each word scored in exactly one window
    for previous, window in pairwise(windows):
        assert sum(counts[window.start:window.end]) <= 40
        context = sum(counts[window.start:window.own])
        assert 20 - 3 < context <= 20 and window.own == previous.end  # about half the window before the new part


def synthetic_document_conllu(n_sentences: int, seed: int = 0, doc: str = "d1") -> str:
    """Sentences "The NOUN saw the NOUN ." or "It saw the NOUN .": each noun phrase is a mention of
    the entity its noun names ("it" continues the subject of the sentence before)."""
    rng = np.random.default_rng(seed)
    lines, previous = [f"# newdoc id = {doc}"], "1"
    for number in range(n_sentences):
        subject, obj = rng.choice(len(NOUNS), size=2, replace=False)
        rows = []
        if number and rng.random() < 0.3:
            rows.append(("It", "it", 2, "nsubj", "PRON", "Number=Sing|Person=3", f"({previous}-thing)"))
        else:
            rows += [("The", "the", 2, "det", "DET", "_", f"({subject + 1}-thing"),
                     (NOUNS[subject], NOUNS[subject], 3, "nsubj", "NOUN", "Number=Sing", f"{subject + 1})")]
            previous = str(subject + 1)
        verb = len(rows) + 1
        rows = [(f, lemma, verb if rel == "nsubj" else h, rel, u, feats, e) for f, lemma, h, rel, u, feats, e in rows]
        rows += [("saw", "see", 0, "root", "VERB", "_", ""),
                 ("the", "the", verb + 2, "det", "DET", "_", f"({obj + 1}-thing"),
                 (NOUNS[obj], NOUNS[obj], verb, "obj", "NOUN", "Number=Sing", f"{obj + 1})"),
                 (".", ".", verb, "punct", "PUNCT", "_", "")]
        lines.append(f"# sent_id = {doc}-{number}")
        for index, (form, lemma, head, rel, upos, feats, entity) in enumerate(rows, 1):
            misc = "|".join(filter(None, [f"Entity={entity}" if entity else "",
                                          "SpaceAfter=No" if index == len(rows) - 1 else ""])) or "_"
            lines.append("\t".join([str(index), form, lemma, upos, "_", feats, str(head), rel, "_", misc]))
        lines.append("")
    return "\n".join(lines) + "\n"


def planted_window(item: WindowText, rng, planted: tuple[int, int] = PLANTED) -> AlignedSentence:
    """Piece-level attention of one window ([CLS] pieces [SEP], long words in two pieces), random but
    for ``planted`` (layer, head), where each scored mention's head word gives 0.7 to its nearest antecedent."""
    offsets = [(0, 0)]
    for start, end in dict.fromkeys(item.spans):
        offsets += [(start, start + 3), (start + 3, end)] if end - start > 4 else [(start, end)]
    offsets.append((0, 0))
    special = [True] + [False] * (len(offsets) - 2) + [True]
    alignment = align_words(item.spans, offsets, special)
    n = len(offsets)
    attention = rng.dirichlet(np.ones(n), size=(N_LAYERS, N_HEADS, n)).astype(np.float32)
    for task in item.tasks:
        target = alignment.groups[max(task.antecedents) - item.window.start]
        for q in alignment.groups[task.mention.head - item.window.start]:
            row = attention[planted][q]
            row *= 0.3 / row.sum()
            row[list(target)] += 0.7 / len(target)
    return AlignedSentence(item, word_attention(attention, alignment, item.rows()), alignment.aligned)


def test_a_planted_coreference_head_is_found_at_100_percent_and_baselines_are_computed():
    treebank = parse_conllu(synthetic_document_conllu(60) + synthetic_document_conllu(40, 1, "d2"), "synthetic")
    documents = documents_of(treebank)
    assert [d.id for d in documents] == ["d1", "d2"]
    counts = [[1] * len(d.words) for d in documents]
    windows, left_out = plan_documents(documents, counts, budget=60)
    assert len(windows) > 10 and left_out[OUTSIDE] > 0  # some chains' earlier mentions fell out of the window
    rng = np.random.default_rng(3)
    result = score_chains([planted_window(w, rng) for w in windows], left_out, "planted", "synthetic", 2, {})
    h = result.headline()
    assert h["best_head"] == "1-0" and h["best_head_acc"] == 1.0 and h["mentions"] > 80
    others = np.sort(result.accuracy.ravel())[-2]
    assert others < 0.7  # random heads do not come near
    assert h["ci"][0] > 0.95 and h["ci"][1] == 1.0
    # every noun names its entity, so the same head word finds the chain whenever the mention is a noun;
    # an "It" right after a noun subject has no earlier "It" to match, so that baseline misses some
    frame = result.mentions_frame()
    nouns = frame[frame.head_word != "It"]
    assert nouns.headword_right.all() and not frame[frame.head_word == "It"].headword_right.all()
    assert h["rule_acc"] >= h["headword_acc"] and 0 < h["nearest_acc"] < 1


def test_a_window_that_starts_after_a_chains_mentions_counts_them_as_outside():
    [document] = documents_of(parse_conllu(synthetic_document_conllu(8), "synthetic"))
    counts = Counter[str]()
    from attnscope.probing.chains import window_tasks

    late = Window(start=len(document.words) - 6, end=len(document.words), own=len(document.words) - 6)
    tasks = window_tasks(document, late, False, counts)
    assert all(min(t.candidates) >= late.start for t in tasks)
    assert sum(counts.values()) + len(tasks) >= 1


def planted_result(seed: int, planted: tuple[int, int], n_sentences: int = 40):
    treebank = parse_conllu(synthetic_document_conllu(n_sentences, seed, f"d{seed}"), f"synthetic-{seed}")
    documents = documents_of(treebank)
    windows, left_out = plan_documents(documents, [[1] * len(d.words) for d in documents], budget=60)
    rng = np.random.default_rng(seed)
    return score_chains([planted_window(w, rng, planted) for w in windows], left_out, "planted", treebank.source,
                        1, {})


def test_a_coreference_head_chosen_on_dev_is_scored_on_test_beside_the_oracle():
    dev, test = planted_result(1, (0, 2)), planted_result(2, PLANTED)
    assert dev.headline()["best_head"] == "0-2" and dev.headline()["selected_on"] == "scored data"
    h = test.with_selection(dev).headline()
    correct = np.stack([s.correct for s in test.scored])  # [mention, layer, head], as scored
    assert h["best_head"] == "0-2" and h["selected_on"] == "dev" and h["selection_source"] == "synthetic-1"
    assert h["best_head_acc"] == round(correct[:, 0, 2].mean(), 4) < 0.7
    assert h["oracle_head"] == "1-0" and h["oracle_head_acc"] == 1.0 and h["selection_acc"] == 1.0
    assert h["ci"][0] < h["best_head_acc"] < h["ci"][1] and "chosen on synthetic-1" in h["selection"]
