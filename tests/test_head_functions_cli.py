"""The interfaces of head-function scores (issue 48, item 4): ``attnscope head-functions`` run in-process (its
--json equal to ``head_scores``' table on SmolLM2, --save Parquet and --store DuckDB read back equal to it, --png
drawn), its help listing the registry, its bad input one line with nothing left behind; ``head_trial``'s row equal
to transformers' eager ``output_attentions=True`` row with the keys each score reads marked; ``plot_head_scores``'
grids with windowed layers marked. Layers and heads are 0-indexed."""

from __future__ import annotations

import json
import warnings

import duckdb
import numpy as np
import pandas as pd
import pytest

from attnscope import HeadScores, HeadScoreSettings, head_scores, load_model
from attnscope.analysis.head_functions import (
    HeadFunction,
    head_functions,
    register_head_function,
    unregister_head_function,
)
from attnscope.analysis.store import HeadStore
from attnscope.capture.extract import extract
from attnscope.capture.plan import CapturePlan
from attnscope.errors import AttnscopeError
from attnscope.experiments.head_trials import head_trial
from attnscope.experiments.random_tokens import repeated_random_tokens
from attnscope.present.figures import WINDOWED_COLOR, plot_head_scores

from .test_cli_errors import assert_one_error_line, exit_code
from .tiny_architectures import SLIDING_WINDOW, TEXT, build_folder, eager_attentions

LONG_TEXT = " ".join([TEXT] * 3)
SMALL = ["--period", "8", "--sequences", "1", "--max-tokens", "64", "--windows", "4,16", "--sinks", "0,2",
         "--chunk", "16"]
SMALL_SETTINGS = HeadScoreSettings(period=8, sequences=1, max_tokens=64, windows=(4, 16), sinks=(0, 2), chunk=16)
SCORES = ["induction", "previous_token", "locality"]


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


def run_json(args: list[str], capsys) -> dict:
    assert exit_code(["head-functions", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def rows(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with plain dtypes (JSON and DuckDB give back numbers, Parquet the same dtypes)."""
    return frame.astype({name: float for name in frame.columns if name not in ("layer", "head", "kv_head", "note",
                                                                                "model")})


def test_json_save_and_store_equal_the_python_apis_table(tiny_llama, tmp_path, capsys):
    """On a tiny Llama (grouped heads: 4 query heads, 2 KV heads), every output of one run against the API's table
    (itself checked against eager rows in test_head_functions.py)."""
    save, store, png = tmp_path / "t.parquet", tmp_path / "heads.duckdb", tmp_path / "g.png"
    args = ["-m", tiny_llama, *[a for name in SCORES for a in ("-s", name)], *SMALL, "--save", str(save),
            "--store", str(store), "--png", str(png)]
    found = run_json(args, capsys)
    expected = head_scores(load_model(tiny_llama), SCORES, SMALL_SETTINGS)
    table, groups = expected.to_frame("head"), expected.to_frame("kv_head")
    pd.testing.assert_frame_equal(rows(pd.DataFrame(found["heads"])), rows(table), check_dtype=False)
    pd.testing.assert_frame_equal(rows(pd.DataFrame(found["kv_heads"])), rows(groups), check_dtype=False)
    assert found["columns"] == list(expected.scores) and found["settings"]["windows"] == [4, 16]
    pd.testing.assert_frame_equal(pd.read_parquet(save), table)
    with duckdb.connect(str(store), read_only=True) as connection:
        stored = connection.execute("SELECT * FROM head_functions ORDER BY layer, head").df()
        stored_groups = connection.execute("SELECT * FROM head_function_groups ORDER BY layer, kv_head").df()
        meta = dict(connection.execute("SELECT key, value FROM meta").fetchall())
    assert (stored.pop("model") == expected.model).all() and (stored_groups.pop("model") == expected.model).all()
    pd.testing.assert_frame_equal(rows(stored), rows(table), check_dtype=False)
    pd.testing.assert_frame_equal(rows(stored_groups), rows(groups), check_dtype=False)
    assert meta["head_functions_model"] == expected.model
    assert json.loads(meta["head_functions_settings"])["period"] == 8
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_store_rows_sit_beside_the_head_labels_and_a_store_of_another_model_is_refused(tiny_llama, tmp_path,
                                                                                      capsys):
    loaded = load_model(tiny_llama)
    labels = pd.DataFrame({"layer": [0, 0, 1], "head": [0, 1, 3], "label": ["sink", "previous", "block"]})
    store = tmp_path / "heads.duckdb"
    HeadStore.create(store, None, None, {"model": loaded.name}, head_labels=labels).close()
    args = ["-m", tiny_llama, "-s", "previous_token", "--period", "4", "--sequences", "1", "--store", str(store)]
    run_json(args, capsys)
    expected = head_scores(loaded, ["previous_token"], HeadScoreSettings(period=4, sequences=1)).scores["previous_token"]
    with HeadStore(store) as opened:
        joined = opened.query("SELECT l.layer, l.head, l.label, f.previous_token FROM head_labels l "
                              "JOIN head_functions f USING (layer, head) ORDER BY layer, head")
    assert joined["label"].tolist() == ["sink", "previous", "block"]
    np.testing.assert_allclose(joined["previous_token"], [expected[0, 0], expected[0, 1], expected[1, 3]])

    other = tmp_path / "minilm.duckdb"
    HeadStore.create(other, None, None, {"model": "minilm"}, head_labels=labels).close()
    before = other.read_bytes()
    code = exit_code(["head-functions", *args[:-1], str(other)])
    assert_one_error_line(code, capsys.readouterr().err, "holds head labels of minilm")
    assert other.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["heads.duckdb",
                                                                                           "minilm.duckdb"]


def test_every_setting_is_an_option():
    from dataclasses import fields

    from attnscope.cli.head_functions import SETTINGS

    assert {*SETTINGS, "documents"} == {field.name for field in fields(HeadScoreSettings)}


def test_help_lists_every_registered_score_even_one_registered_later(capsys):
    extra = register_head_function(HeadFunction("planted_later", "Planted later", "repeated_tokens",
                                                "a score registered after the command was made", "nobody", dict))
    try:
        assert exit_code(["head-functions", "--help"]) == 0
        shown = capsys.readouterr().out
    finally:
        unregister_head_function(extra.name)
    for function in [*head_functions(), extra]:
        assert f"  {function.name} ({function.task}): {function.reference[:40]}" in " ".join(shown.split("\n      "))
        assert function.name in shown.split("--score NAME, -s NAME")[1].split("--model MODEL")[0]  # a choice


# ---- bad input: one line, exit 2, nothing written -----------------------------------------------------------
MISSING_MODEL = "/nonexistent/model-folder"  # refused only once loading starts: a refusal naming anything else
# shows the check came before the model loads


@pytest.mark.parametrize(("args", "expected"), [
    (["-s", "nope"], "invalid choice: 'nope'"),
    (["--period", "1"], "repeated random tokens need a period >= 2, repeats >= 2 and sequences >= 1; got 1, 2"),
    (["--period", "0"], "expected a positive integer, got 0"),
    (["--share", "1.5"], "the share a window must keep is in (0, 1], got 1.5"),
    (["--share", "nan"], "expected a finite number, got nan"),
    (["--windows", "0,4"], "expected a positive integer, got 0"),
    (["--sinks", "-1"], "expected 0 or a positive integer, got -1"),
    (["-s", "locality", "--document", "no-such-document"], "no such file: no-such-document"),
    (["--save", "{tmp}/new/t.csv"], "give a .parquet file name"),
    (["--png", "{tmp}/new/g.gif"], "use a .png, .svg or .pdf file name"),
    (["--png", "{tmp}/new/g.png", "--save", "{tmp}/folder.parquet"], "folder.parquet is a folder"),
    (["--store", "{tmp}/not-a-database"], "cannot open"),
    (["--save", "{tmp}/new/a.parquet", "--store", "{tmp}/new/a.parquet"], "is named for two outputs"),
])
def test_bad_input_is_one_line_before_the_model_loads(args, expected, tmp_path, capsys):
    (tmp_path / "folder.parquet").mkdir()
    (tmp_path / "not-a-database").write_text("plain text\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    code = exit_code(["head-functions", "-m", MISSING_MODEL, *[a.format(tmp=tmp_path) for a in args]])
    assert_one_error_line(code, capsys.readouterr().err, expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not any((tmp_path / "folder.parquet").iterdir())


@pytest.mark.parametrize(("model", "args", "expected"), [
    ("bert", ["-s", "induction"], "need a decoder (causal self-attention)"),
    ("llama", ["-s", "induction", "--period", "300"], "limit of 512"),
    ("llama", ["-s", "locality", "--max-tokens", "100000"], "above"),
])
def test_what_the_model_decides_is_refused_after_it_loads_and_leaves_nothing(model, args, expected, tiny_model_dir,
                                                                             tmp_path, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        folder = str(tiny_model_dir(model))
    out = tmp_path / "new"
    code = exit_code(["head-functions", "-m", folder, *args, "--save", str(out / "t.parquet"), "--store",
                      str(out / "s.duckdb"), "--png", str(out / "g.png")])
    assert_one_error_line(code, capsys.readouterr().err, expected)
    assert not any(tmp_path.iterdir())


# ---- one head on one trial -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    folder = build_folder("gemma3_text", tmp_path_factory.mktemp("gemma3"))
    return folder, load_model(str(folder))


@pytest.mark.parametrize(("score", "offsets"), [("induction", [3]), ("duplicate_token", [4]),
                                                ("echo", [4, 8]), ("previous_token", [1])])
def test_a_trial_row_is_the_eager_row_of_the_last_query_with_the_keys_the_score_reads(tiny_gemma, score, offsets):
    folder, loaded = tiny_gemma
    settings = HeadScoreSettings(period=4, repeats=3, seed=5)
    ids = repeated_random_tokens(loaded, 4, repeats=3, sequences=1, seed=5)[0]
    eager = eager_attentions(folder, ids, None)["self"]  # [layer] -> [head, q, k]
    query = len(ids) - 1
    for layer, head in ((0, 1), (1, 3)):
        trial = head_trial(loaded, score, layer, head, settings)
        assert trial.query == query and len(trial.tokens) == len(ids)
        np.testing.assert_allclose(trial.row, eager[layer][head, query], atol=1e-5)
        assert trial.marked == tuple(query - offset for offset in offsets)
        assert trial.marked_share == pytest.approx(float(eager[layer][head, query, list(trial.marked)].sum()),
                                                   abs=1e-5)


def kept(row: np.ndarray, sink: int, window: int) -> float:
    """The share of ``row`` ``[k_pos]`` (its query the last key) on its first ``sink`` and ``window`` most recent keys."""
    keys = np.zeros(len(row), dtype=bool)
    keys[:sink] = keys[max(0, len(row) - window):] = True
    return float(row[keys].sum())


def test_a_document_trial_marks_the_sink_and_the_smallest_window_keeping_the_share(tiny_gemma):
    """The marked keys are the first k and the recent w of the smallest window of the grid whose cache keeps the
    share of the eager row; on the sliding-window layer (4 keys) the window of 4 keeps all of it."""
    folder, loaded = tiny_gemma
    windows = (2, SLIDING_WINDOW, 20)
    settings = HeadScoreSettings(documents=(LONG_TEXT,), max_tokens=40, sinks=(2,), windows=windows, share=0.99)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cut at 40 tokens, as the trial cuts it
        ids = extract(loaded, LONG_TEXT, plan=CapturePlan(attention=False, statistics=True), max_length=40).token_ids
    query = len(ids) - 1
    sliding = {site.layer: site.window for site in loaded.sites.values()}
    assert sorted(sliding.values()) == [0, SLIDING_WINDOW]
    for layer in (0, 1):
        trial = head_trial(loaded, "locality", layer, 2, settings)
        eager = eager_attentions(folder, ids.tolist(), None)["self"][layer][2, query]
        np.testing.assert_allclose(trial.row, eager, atol=1e-5)

        window = next((w for w in windows if kept(eager, 2, w) >= 0.99), windows[-1])
        assert trial.marked == (0, 1, *range(query - window + 1, query + 1))
        if sliding[layer]:
            assert window <= SLIDING_WINDOW


def test_a_trial_refuses_a_head_the_model_lacks_and_an_encoder(tiny_gemma, tiny_model_dir):
    _, loaded = tiny_gemma
    with pytest.raises(AttnscopeError, match="head 4 does not exist"):
        head_trial(loaded, "induction", 0, 4, HeadScoreSettings(period=4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        encoder = load_model(str(tiny_model_dir("bert")))
    with pytest.raises(AttnscopeError, match="need a decoder"):
        head_trial(encoder, "induction", 0, 0, HeadScoreSettings(period=4))


# ---- the figure -------------------------------------------------------------------------------------------------
def test_the_grid_marks_windowed_layers_and_draws_each_column():
    values = np.arange(8, dtype=float).reshape(2, 4) / 10
    scores = HeadScores("m", {"induction": values, "streaming_window_k4": np.array([[16, np.nan, 4, 4], [8] * 4])},
                        n_kv_heads=2, windows=(512, 0))
    figure = plot_head_scores(scores)
    grids = [ax for ax in figure.axes if ax.get_title()]
    assert [ax.get_title() for ax in grids] == ["induction", "streaming_window_k4"]
    first = grids[0]
    assert [t.get_text() for t in first.get_yticklabels()] == ["0 w512", "1"]
    assert first.get_yticklabels()[0].get_color() == WINDOWED_COLOR and first.get_yticklabels()[1].get_color() != WINDOWED_COLOR
    assert [t.get_text() for t in first.get_xticklabels()] == ["0", "1", "2", "3"]
    assert "0-indexed" in first.get_xlabel() and "0-indexed" in first.get_ylabel()
    np.testing.assert_array_equal(first.images[0].get_array(), values)
    assert first.images[0].get_clim() == (0.0, 1.0) and grids[1].images[0].get_clim() == (4.0, 16.0)
    assert len(plot_head_scores(scores, "induction").axes) == 2  # one grid and its colour bar
    with pytest.raises(AttnscopeError, match="no score 'nope'"):
        plot_head_scores(scores, "nope")
