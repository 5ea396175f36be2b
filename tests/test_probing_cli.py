"""``attnscope probe deps|coref|edges`` end to end on a tiny random BERT: files written, JSON last, clear errors."""

from __future__ import annotations

import json

import duckdb
import pytest

from attnscope.cli import main
from attnscope.probing.treebank import Treebank, shipped_treebank, to_conllu

from .test_probing_chains import synthetic_document_conllu


@pytest.fixture(scope="module")
def small_conllu(tmp_path_factory):
    path = tmp_path_factory.mktemp("trees") / "small.conllu"
    path.write_text(to_conllu(shipped_treebank(40)))
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_probe_deps_writes_tables_charts_summary_and_json(capsys, tmp_path, small_conllu, tiny_model_dir):
    code, out, err = run_cli(capsys, "probe", "deps", "--conllu", str(small_conllu), "--model",
                             str(tiny_model_dir("bert")), "-o", str(tmp_path), "--min-arcs", "20", "--json")
    assert code == 0, err
    headline = last_json(out)
    assert headline["silver"] is True and "not gold" in headline["annotation"]  # the file's own marker is kept
    assert set(headline["best_head_acc"]["det"]) >= {"head", "acc", "baseline"}
    assert 0 <= headline["any_relation_acc"] <= 1 and headline["heads_indexing"].endswith("0-indexed")
    assert {"index.html", "best_heads.csv", "best_heads.png", "any_relation_heads.png", "probe_deps.duckdb",
            "mismatches.csv"} <= {p.name for p in tmp_path.iterdir()}
    with duckdb.connect(str(tmp_path / "probe_deps.duckdb"), read_only=True) as db:
        tables = {row[0] for row in db.execute("SHOW TABLES").fetchall()}
        assert tables == {"best_heads", "directions", "head_accuracy", "offsets", "mismatches"}
        assert db.execute("SELECT count(*) FROM head_accuracy WHERE relation = 'det'").fetchone()[0] == 2 * 2 * 4
    assert "not gold" in (tmp_path / "index.html").read_text()


def test_probe_coref_on_own_items(capsys, tmp_path, tiny_model_dir):
    items = tmp_path / "items.jsonl"
    items.write_text("\n".join(json.dumps(row) for row in [
        {"sentence": "The cat chased the dog because it was angry.", "pronoun": "it", "antecedent": "the cat",
         "wrong": "the dog"},
        {"sentence": "The cat chased the dog because it was slow.", "pronoun": "it", "antecedent": "the dog",
         "wrong": "the cat"},
        {"sentence": "Anna thanked Maria.", "pronoun": "she", "antecedent": "anna", "wrong": "maria"},
    ]))
    code, out, err = run_cli(capsys, "probe", "coref", "--items", str(items), "--model", str(tiny_model_dir("bert")),
                             "-o", str(tmp_path / "out"), "--json")
    assert code == 0, err
    headline = last_json(out)
    assert headline["items"] == 2 and headline["items_left_out"] == {"pronoun not found after both candidates": 1}
    assert headline["nearest_mention_acc"] == 0.5 and {"best_head", "best_head_acc"} <= set(headline)
    assert (tmp_path / "out" / "coref_heads.png").exists() and (tmp_path / "out" / "probe_coref.duckdb").exists()


def test_probe_edges_reports_every_probe_and_baseline(capsys, tmp_path, small_conllu, tiny_model_dir):
    code, out, err = run_cli(capsys, "probe", "edges", "--conllu", str(small_conllu), "--model",
                             str(tiny_model_dir("bert")), "-o", str(tmp_path), "--json")
    assert code == 0, err
    headline = last_json(out)
    for key in ("edge_probe_acc", "edge_distance_acc", "edge_reinit_acc", "relation_probe_acc",
                "relation_distance_acc", "relation_reinit_acc", "relation_majority_acc", "uas", "uas_distance",
                "uas_reinit", "uas_right_branching"):
        assert 0 <= headline[key] <= 1, key
    assert (tmp_path / "probes.png").exists() and (tmp_path / "probes.csv").exists()


def test_bad_input_is_one_clear_line(capsys, tmp_path):
    code, _, err = run_cli(capsys, "probe", "deps", "--conllu", str(tmp_path / "missing.conllu"))
    assert code == 2 and err.startswith("attnscope: error: no such file: ") and len(err.strip().splitlines()) == 1
    bad = tmp_path / "items.jsonl"
    bad.write_text('{"sentence": "x"}\n')
    code, _, err = run_cli(capsys, "probe", "coref", "--items", str(bad))
    assert code == 2 and "line 1" in err and "Traceback" not in err


@pytest.mark.parametrize("kind", ["llama", "bart"])
def test_probes_run_on_decoders_and_encoder_decoders(kind, tiny_model_dir):
    from attnscope import load_model
    from attnscope.probing import probe_dependencies

    loaded = load_model(str(tiny_model_dir(kind)))
    result = probe_dependencies(loaded, shipped_treebank(5), progress=False, min_arcs=1)
    layers, heads = {"llama": (3, 6), "bart": (2, 4)}[kind]  # bart: the encoder's self-attention
    assert result.accuracy("det").shape == (2, layers, heads)
    assert result.headline()["mismatches"]["sentences"] == 5


def test_probe_deps_select_on_chooses_on_dev_and_says_where(capsys, tmp_path, small_conllu, tiny_model_dir):
    dev = tmp_path / "dev.conllu"
    dev.write_text(to_conllu(Treebank(shipped_treebank(80).sentences[40:], "dev", True, "silver")))
    model = str(tiny_model_dir("bert"))
    code, out, err = run_cli(capsys, "probe", "deps", "--conllu", str(small_conllu), "--model", model, "-o",
                             str(tmp_path / "plain"), "--min-arcs", "20", "--json")
    assert code == 0, err
    plain = last_json(out)
    assert plain["selected_on"] == "scored data" and "chosen on the data they are scored on" in out
    assert plain["best_head_acc"]["det"]["acc"] == plain["best_head_acc"]["det"]["oracle_head_acc"]
    code, out, err = run_cli(capsys, "probe", "deps", "--conllu", str(small_conllu), "--select-on", str(dev),
                             "--model", model, "-o", str(tmp_path / "dev"), "--min-arcs", "20", "--json")
    assert code == 0, err
    chosen = last_json(out)
    assert chosen["selected_on"] == "dev" and "chosen on dev.conllu" in out and "oracle_head" in out
    det = chosen["best_head_acc"]["det"]
    assert det["selected_on"] == "dev" and det["acc"] <= det["oracle_head_acc"] == plain["best_head_acc"]["det"]["acc"]
    assert chosen["sentences"] == plain["sentences"]  # the scored data is the same; only the choice moved


@pytest.mark.parametrize("action", ["deps", "coref"])
def test_a_bad_select_on_file_is_one_line_before_the_model_loads(capsys, tmp_path, small_conllu, action):
    not_conllu, empty, scored = tmp_path / "notes.conllu", tmp_path / "empty.conllu", tmp_path / "scored.conllu"
    not_conllu.write_text("just some words\nand more\n")
    empty.write_text("")
    scored.write_text(synthetic_document_conllu(10))  # gold chains, as coref --conllu needs
    bad = [(tmp_path / "missing.conllu", "no such file"), (not_conllu, "not valid CoNLL-U"),
           (empty, "no dependency trees")]
    if action == "coref":
        bad.append((small_conllu, "no coreference annotation"))
    for path, expected in bad:
        # a model that does not exist: the --select-on error must come first
        code, _, err = run_cli(capsys, "probe", action, "--conllu", str(scored), "--select-on", str(path),
                               "--model", "no-such-model", "-o", str(tmp_path / "out"))
        assert code != 0 and "--select-on" in err and expected in err, err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_probe_coref_select_on_needs_gold_chains(capsys, tmp_path, small_conllu):
    code, _, err = run_cli(capsys, "probe", "coref", "--select-on", str(small_conllu), "-o", str(tmp_path / "w"))
    assert code != 0 and "--select-on needs --conllu" in err and len(err.strip().splitlines()) == 1


def test_probe_coref_select_on_chooses_on_dev_documents(capsys, tmp_path, tiny_model_dir):
    test, dev = tmp_path / "test.conllu", tmp_path / "dev.conllu"
    test.write_text(synthetic_document_conllu(20))
    dev.write_text(synthetic_document_conllu(20, 1, "dev-doc"))
    code, out, err = run_cli(capsys, "probe", "coref", "--conllu", str(test), "--select-on", str(dev), "--model",
                             str(tiny_model_dir("bert")), "-o", str(tmp_path / "out"), "--json", "--window", "64")
    assert code == 0, err
    h = last_json(out)
    assert h["selected_on"] == "dev" and h["selection_source"] == "dev.conllu" and h["selection_mentions"] > 5
    assert h["best_head_acc"] <= h["oracle_head_acc"] and "chosen on dev.conllu" in out and "oracle" in out


def test_probe_edges_over_seeds_reports_mean_and_range(capsys, tmp_path, small_conllu, tiny_model_dir):
    code, out, err = run_cli(capsys, "probe", "edges", "--conllu", str(small_conllu), "--model",
                             str(tiny_model_dir("bert")), "-o", str(tmp_path), "--seeds", "0-2", "--no-reinit", "--json")
    assert code == 0, err
    headline = last_json(out)
    assert headline["seeds"] == [0, 1, 2] and "seeds 0, 1, 2: one split each" in out
    for key, spread in headline["over_seeds"].items():
        assert spread["min"] <= spread["mean"] <= spread["max"] and spread["mean"] == pytest.approx(headline[key],
                                                                                                   abs=1e-4), key
    assert {"min", "max"} <= set((tmp_path / "probes.csv").read_text().splitlines()[0].split(","))
    with pytest.raises(SystemExit) as stopped:  # argparse: usage, then one error line
        main(["probe", "edges", "--seeds", "4-x", "-o", str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.strip().splitlines()[-1].endswith("got '4-x'") and "Traceback" not in err
