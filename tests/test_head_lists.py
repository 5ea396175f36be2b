"""The shipped head-function lists (``src/attnscope/data/head_lists``, made by ``scripts/head_lists.py``): each
model's files load with its (layers x heads) shape, the scores lie in their ranges, the pooled columns, the stability
figures and the retrieval share follow from the per-set columns, SmolLM2's set-A scores equal a fresh run, and the
docs page and the benchmark name every list."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy.stats import spearmanr

from attnscope import HeadScoreSettings, head_scores
from attnscope.data import head_list, head_list_summary, head_lists
from attnscope.errors import AttnscopeError

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("smollm2", "gemma3", "qwen0.5b", "qwen1.5b")
UNIT = ("induction", "previous_token", "duplicate_token", "echo", "retrieval")  # shares of a row or of a needle
CHEAP = ("induction", "previous_token", "duplicate_token", "echo")
SHIPPED = head_lists()
CSV_DIGITS = 1e-5  # the files keep 6 significant digits


def scores_of(alias: str) -> list[str]:
    """The score columns of ``alias``'s list (those with an ``_a`` twin)."""
    columns = head_list(alias).columns
    return [name for name in columns if f"{name}_a" in columns and f"{name}_b" in columns]


def test_lists_ship_for_the_four_models_of_issue_48():
    assert set(SHIPPED) <= set(MODELS) and {"smollm2", "gemma3", "qwen0.5b"} <= set(SHIPPED)


@pytest.mark.parametrize("alias", SHIPPED)
def test_a_list_has_one_row_per_head_and_per_kv_group(alias):
    summary, table, groups = head_list_summary(alias), head_list(alias), head_list(alias, per="kv_head")
    layers, heads, kv_heads = summary["layers"], summary["heads"], summary["kv_heads"]
    assert len(table) == layers * heads and len(groups) == layers * kv_heads
    assert list(zip(table["layer"], table["head"])) == [(layer, head) for layer in range(layers) for head in range(heads)]
    assert (table["kv_head"] == table["head"] // (heads // kv_heads)).all()
    windows = summary["windows"] or [0] * layers
    assert (table["window"] == np.repeat(windows, heads)).all()
    assert set(scores_of(alias)) >= {*UNIT, "receiver", "streaming_window_k4"}


@pytest.mark.parametrize("alias", SHIPPED)
def test_scores_lie_in_their_ranges(alias):
    table, settings = head_list(alias), head_list_summary(alias)["sets"]["a"]["settings"]
    for name in scores_of(alias):
        for column in (name, f"{name}_a", f"{name}_b"):
            values = table[column].to_numpy(dtype=float)
            finite = values[np.isfinite(values)]
            if name in UNIT or name.startswith("locality_"):
                assert ((finite >= 0) & (finite <= 1 + CSV_DIGITS)).all(), column
            elif name.startswith("streaming_window"):
                assert set(finite) <= set(settings["windows"]), column
    for name in CHEAP + tuple(n for n in scores_of(alias) if n.startswith("locality_")):
        assert table[name].notna().all(), name  # measured for every head; only retrieval, windows, kurtosis may be NaN


@pytest.mark.parametrize("alias", SHIPPED)
def test_pooled_columns_stability_and_share_follow_from_the_sets(alias):
    table, summary = head_list(alias), head_list_summary(alias)
    for name in scores_of(alias):
        a, b = table[f"{name}_a"].to_numpy(float), table[f"{name}_b"].to_numpy(float)
        both = np.isfinite(a) & np.isfinite(b)
        stored = summary["stability"][name]
        assert stored["heads"] == both.sum(), name
        if stored["rho"] is not None:
            assert spearmanr(a[both], b[both]).statistic == pytest.approx(stored["rho"], abs=1e-3), name
        if name in CHEAP or name.startswith("locality_") or name == "receiver":
            assert np.allclose(table[name], (a + b) / 2, rtol=CSV_DIGITS, atol=CSV_DIGITS, equal_nan=True), name
    retrieval = table["retrieval"].fillna(-1).to_numpy()
    assert summary["retrieval"]["share_above"] == pytest.approx(np.mean(retrieval > 0.1), abs=1e-4)
    rows = pd.DataFrame(summary["trials"]["rows"])
    assert summary["trials"]["counted"] == rows.counted.sum() and summary["trials"]["total"] == len(rows)
    assert set(rows.needle[rows.set == "a"]).isdisjoint(rows.needle[rows.set == "b"])
    assert set(rows.document[rows.set == "a"]).isdisjoint(rows.document[rows.set == "b"])


@pytest.mark.parametrize("alias", SHIPPED)
def test_pooled_retrieval_and_windows_are_those_of_the_union_of_the_sets(alias):
    """Retrieval pooled over every counted trial is the counts-weighted mean of the sets' means; the pooled smallest
    window is the smallest whose pooled locality keeps the share (up to the files' rounding at the share)."""
    table, summary = head_list(alias), head_list_summary(alias)
    counts = [summary["trials"][f"counted_{name}"] for name in "ab"]
    parts = [table[f"retrieval_{name}"].fillna(0).to_numpy() * n for name, n in zip("ab", counts)]
    expected = (parts[0] + parts[1]) / sum(counts) if sum(counts) else np.full(len(table), np.nan)
    assert np.allclose(table["retrieval"], expected, rtol=CSV_DIGITS, atol=CSV_DIGITS, equal_nan=True)
    settings = summary["sets"]["a"]["settings"]
    (sink,) = settings["sinks"]
    kept = np.stack([table[f"locality_k{sink}_w{w}"] for w in settings["windows"]], axis=1)  # [head, window]
    reaches = kept >= settings["share"]
    smallest = np.where(reaches.any(1), np.array(settings["windows"])[reaches.argmax(1)], np.nan)
    near_the_share = (np.abs(kept - settings["share"]) < CSV_DIGITS).any(1)
    stored = table[f"streaming_window_k{sink}"].to_numpy(float)
    assert np.array_equal(smallest[~near_the_share], stored[~near_the_share], equal_nan=True)


def test_smollm2_set_a_equals_a_fresh_run(smollm2):
    """The cheap scores of SmolLM2's set A and its receiver kurtosis (re-run with ``--scores receiver`` once the
    first token, the sink, left every sentence), recomputed now with the stored settings, equal the shipped
    columns."""
    stored = head_list_summary("smollm2")["sets"]["a"]["settings"]
    settings = HeadScoreSettings(period=stored["period"], repeats=stored["repeats"], sequences=stored["sequences"],
                                 seed=stored["seed"], documents=tuple(stored["documents"]),
                                 max_tokens=stored["max_tokens"], chunk=stored["chunk"])
    fresh = head_scores(smollm2, (*CHEAP, "receiver"), settings)
    table = head_list("smollm2")
    for name in CHEAP:
        assert np.allclose(table[f"{name}_a"].to_numpy().reshape(fresh.shape), fresh.scores[name], rtol=CSV_DIGITS,
                           atol=CSV_DIGITS), name
    kurtosis = table["receiver_a"].to_numpy().reshape(fresh.shape)  # tens: rounding's share of it
    assert np.allclose(kurtosis, fresh.scores["receiver"], rtol=1e-4, atol=1e-4, equal_nan=True)


def test_an_unknown_list_is_one_line():
    with pytest.raises(AttnscopeError, match="no head-function list ships for 'gpt2'"):
        head_list("gpt2")
    with pytest.raises(AttnscopeError, match="per must be"):
        head_list(SHIPPED[0], per="layer")


def test_the_page_shows_every_list():
    page = (ROOT / "docs" / "head-lists.md").read_text(encoding="utf-8")
    for alias in SHIPPED:
        assert f"img/head_lists_{alias}.png" in page and (ROOT / "docs" / "img" / f"head_lists_{alias}.png").is_file()


def test_a_partial_rerun_refuses_in_one_line_before_loading(tmp_path, capsys, monkeypatch):
    """``scripts/head_lists.py --scores``: a score that needs the whole run, a model without files to keep, and
    --quick are refused (exit 2) before any model loads, and nothing is written."""
    script = load_script("head_lists", monkeypatch)
    for argv, message in ((["--scores", "retrieval"], "re-runs only"),
                          (["--scores", "receiver", "--out", str(tmp_path)], "which does not exist"),
                          (["--scores", "receiver", "--quick"], "cannot be --quick")):
        assert script.main(["--models", "smollm2", "--img", str(tmp_path / "img"), *argv]) == 2
        assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


# ---- the masking checks of the lists (scripts/head_checks.py) ----------------------------------------------------
CHECKED = [(alias, name) for alias in SHIPPED for name in head_list_summary(alias).get("checks", {})]


def load_script(name: str, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"{name}_script", ROOT / "scripts" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, script)  # its dataclasses look their module up
    spec.loader.exec_module(script)
    return script


def test_checks_ship_for_the_three_scores_of_smollm2():
    assert {name for alias, name in CHECKED if alias == "smollm2"} == {"induction", "streaming", "retrieval"}


@pytest.mark.parametrize(("alias", "name"), CHECKED)
def test_a_recorded_check_masked_the_heads_the_shipped_list_ranks_first(alias, name):
    """The heads each recorded check masked are those the shipped list's column gives now: the top k, the bottom k
    and the seeded random draws, drawn again here from the list (a list re-run without checking again fails)."""
    from attnscope.experiments.head_masking import head_sets

    check = head_list_summary(alias)["checks"][name]
    summary = head_list_summary(alias)
    scores = head_list(alias)[check["column"]].to_numpy(float).reshape(summary["layers"], summary["heads"])
    least = any(row["heads"] == "bottom" for row in check["summary"])
    expected = head_sets(scores, check["ks"], check["random_draws"], np.random.default_rng(0), least)
    assert {key: [list(head) for head in heads] for key, heads in expected.items()} == check["sets"]


@pytest.mark.parametrize(("alias", "name"), CHECKED)
def test_a_recorded_checks_rows_agree_with_each_other(alias, name):
    """Every k has top and random rows (streaming: bottom too) and their difference; a masked value is the baseline
    plus its change; the random row is the mean of its draws; each interval is ordered; top - random is the
    difference of the rows."""
    check = head_list_summary(alias)["checks"][name]
    rows = {(row["k"], row["heads"]): row for row in check["summary"]}
    kinds = {"top", "random", "top - random"} | ({"bottom", "bottom - random"} if name == "streaming" else set())
    assert set(rows) == {(k, kind) for k in check["ks"] for kind in kinds}
    assert check["random_draws"] >= 5 and check["n_examples"] >= 2
    for (k, kind), row in rows.items():
        assert row["ci_low"] <= row["ci_high"], (k, kind)
        if " - " not in kind:
            assert row["value"] == pytest.approx(check["baseline"] + row["change"], abs=1e-9)
            assert row["change"] == pytest.approx(np.mean(row["set_changes"]), abs=1e-9)
            assert len(row["set_changes"]) == (check["random_draws"] if kind == "random" else 1)
    for k in check["ks"]:
        assert rows[k, "top - random"]["change"] == pytest.approx(rows[k, "top"]["change"] - rows[k, "random"]["change"],
                                                                 abs=1e-9)


def test_the_checks_picture_draws_every_recorded_check(tmp_path, monkeypatch):
    """``scripts/head_checks.py --redraw`` draws one panel per (model, check) from the recorded summaries, and the
    page shows the picture."""
    from attnscope.present.figures import plot_masking_checks

    script = load_script("head_checks", monkeypatch)
    recorded = script.recorded_checks(script.OUT, list(SHIPPED))
    figure = plot_masking_checks(recorded)
    drawn = [ax for ax in figure.axes if ax.axison]
    assert len(drawn) == sum(len(checks) for checks in recorded.values())
    assert all(ax.containers for ax in drawn)  # error bars in every panel
    assert script.main(["--redraw", "--img", str(tmp_path)]) == 0 and (tmp_path / "head_checks.png").is_file()
    assert "img/head_checks.png" in (ROOT / "docs" / "head-lists.md").read_text(encoding="utf-8")


def test_the_checks_command_refuses_bad_input_in_one_line_before_loading(tmp_path, capsys, monkeypatch):
    script = load_script("head_checks", monkeypatch)
    for argv, message in ((["--models", "nosuch"], "unknown model alias"),
                          (["--scores", "echo"], "unknown check"),
                          (["--models", "smollm2", "--out", str(tmp_path)], "which does not exist")):
        assert script.main([*argv, "--img", str(tmp_path / "img")]) == 2
        assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
