"""The real gold files (UD English EWT and GUM test) read as they should, and the CLI's coreference
path end to end on a tiny model. Tests that need the gold folder skip with a message where it is
absent (``../shared/data/ud`` beside the checkout, or ``$ATTNSCOPE_UD_DIR``)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from attnscope.cli import main
from attnscope.probing.documents import documents_of
from attnscope.probing.gold import ENV, EWT_TEST, GUM_TEST, gold_file, missing_message, ud_dir
from attnscope.probing.relations import labelled_arcs
from attnscope.probing.treebank import ROOT, read_conllu

from .test_probing_chains import synthetic_document_conllu


def gold(name: str):  # type: ignore[no-untyped-def]
    path = gold_file(name)
    if path is None:
        pytest.skip(missing_message(name))
    return path


def test_the_gold_folder_is_configurable(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, str(tmp_path))
    assert ud_dir() == tmp_path and gold_file(EWT_TEST) is None
    monkeypatch.delenv(ENV)
    assert ud_dir().parts[-3:] == ("shared", "data", "ud")


def test_ewt_test_multiword_tokens_one_root_and_clark_relations():
    treebank = read_conllu(gold(EWT_TEST))
    assert len(treebank) == 2077 and not treebank.silver
    shared = [s for s in treebank.sentences if len(set(s.spans)) < len(s.spans)]
    assert shared  # multiword tokens: their words share the token's characters
    for sentence in treebank.sentences:
        assert sentence.heads.count(ROOT) == 1  # empty nodes (8.1) never become words
    labels = Counter(label for s in treebank.sentences[:400] for _, _, label in labelled_arcs(s))
    assert labels["dobj"] == labels["obj"] and labels["poss"] == labels["nmod:poss"] and labels["pobj"] > 100


def test_gum_test_documents_mentions_and_chains():
    documents = documents_of(read_conllu(gold(GUM_TEST)))
    assert len(documents) == 30
    for document in documents:
        assert not document.problems, document.id  # every bracket opens and closes
        assert all(m.head in m.words for m in document.mentions)
        assert sum(1 for n in document.chain_sizes().values() if n > 1) > 5


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_probe_coref_on_gold_documents_with_a_tiny_model(capsys, tmp_path, tiny_model_dir):
    conllu = tmp_path / "doc.conllu"
    conllu.write_text(synthetic_document_conllu(30) + synthetic_document_conllu(10, 1, "d2"))
    code, out, err = run_cli(capsys, "probe", "coref", "--conllu", str(conllu), "--model", str(tiny_model_dir("bert")),
                             "-o", str(tmp_path / "out"), "--json", "--window", "64")
    assert code == 0, err
    headline = json.loads(out.strip().splitlines()[-1])
    assert headline["documents"] == 2 and headline["mentions"] > 10 and headline["window_tokens"] == 64
    assert {"best_head_acc", "ci", "nearest_acc", "headword_acc", "rule_acc"} <= set(headline)
    assert {"index.html", "coref_heads.png", "mentions.csv", "probe_coref.duckdb"} <= {
        p.name for p in (tmp_path / "out").iterdir()}


def test_probe_coref_bad_files_are_one_clear_line(capsys, tmp_path):
    no_entities = tmp_path / "trees.conllu"
    no_entities.write_text("1\tDogs\tdog\tNOUN\t_\t_\t2\tnsubj\t_\t_\n2\tbark\tbark\tVERB\t_\t_\t0\troot\t_\t_\n\n")
    code, _, err = run_cli(capsys, "probe", "coref", "--conllu", str(no_entities), "-o", str(tmp_path / "a"))
    assert code != 0 and "no coreference annotation" in err and "Traceback" not in err
    not_conllu = tmp_path / "text.conllu"
    not_conllu.write_text("just some words\nand more\n")
    code, _, err = run_cli(capsys, "probe", "coref", "--conllu", str(not_conllu), "-o", str(tmp_path / "b"))
    assert code != 0 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    code, _, err = run_cli(capsys, "probe", "coref", "--conllu", str(tmp_path / "missing.conllu"), "-o",
                             str(tmp_path / "c"))
    assert code != 0 and "no such file" in err
