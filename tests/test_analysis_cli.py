"""``attnscope patterns`` and ``attnscope heads`` as a user runs them: arguments in, text and exit codes out.

Commands run in-process through ``attnscope.cli.main`` (a subprocess per case would re-import torch
each time); one case runs the real ``python -m attnscope`` process to check the exit path end to end.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attnscope.cli import main

SEED_TEXT, SEED_PAIR = "I went to the store.", "At the store, I bought fresh strawberries."


def run(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse's own errors
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_clear_error(result: tuple[int, str, str], fragment: str) -> None:
    code, _, err = result
    assert code == 2 and "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and fragment in errors[0], err


def test_patterns_prints_a_label_per_head(capsys):
    code, out, err = run(capsys, "patterns", SEED_TEXT, "--pair", SEED_PAIR)
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.startswith("layer ")]
    assert len(rows) == 6 and all(len(row.split()) == 2 + 2 * 12 for row in rows)
    assert "0-indexed" in out and "legend:" in out


def test_patterns_json_has_label_confidence_and_evidence(capsys):
    code, out, err = run(capsys, "patterns", "The cat sat on the mat.", "--json")
    assert code == 0, err
    rows = json.loads(out)
    assert len(rows) == 72 and {"layer", "head", "label", "kovaleva", "confidence", "previous_word"} <= set(rows[0])


def test_evaluate_json_reports_both_labelled_sets(capsys):
    code, out, err = run(capsys, "patterns", "--evaluate", "--json")
    assert code == 0, err
    summary = json.loads(out.splitlines()[-1])
    assert summary["synthetic_macro_f1"] >= 0.90
    assert summary["n_real"] >= 60
    # the target is 0.80; the honest figures are what this prints. The bounds guard against
    # regressions below what the rules reach today (labels/README.md: 0.699 on all 218 maps,
    # 0.610 on the 46 held-out maps of batch 4, 0.696 in 5-fold cross-validation)
    assert summary["real_macro_f1"] >= 0.68
    assert summary["n_real_heldout"] == 46 and summary["real_macro_f1_heldout"] >= 0.58
    assert summary["n_real_development"] + summary["n_real_heldout"] == summary["n_real"]
    assert 0.0 < summary["real_macro_f1_cv"] <= 1.0
    # issue 37.3: one synthetic set and one deal into folds are one draw each; over five of each, the bands
    # hold on any CPU (measured: synthetic 0.876-0.904, cross-validation 0.676-0.699 on 5 random deals)
    synthetic, cv = summary["synthetic_macro_f1_over_seeds"], summary["real_macro_f1_cv_over_splits"]
    assert synthetic["seeds"] == [0, 2, 3, 4, 5] and len(cv["seeds"]) == 5  # never the calibration seed 1
    assert synthetic["min"] >= 0.85 and synthetic["min"] <= synthetic["mean"] <= synthetic["max"]
    assert cv["min"] >= 0.62 and cv["min"] <= cv["mean"] <= cv["max"] < 0.8
    assert set(summary["real_per_class"]["delimiter"]) == {"precision", "recall", "f1", "support"}
    agreement = summary["real_labeller_agreement"]  # two labellers on the same maps
    assert agreement["n"] == summary["n_real"] and -1.0 <= agreement["kappa"] <= 1.0
    # issue 19.3: heads the corpus report calls stable (on 1,000 Brown sentences) keep their label on
    # held-out Brown sentences; target 0.85, measured 0.942 for 37 of 72 heads (all heads: 0.797)
    stability = summary["stability"]
    assert stability["n_stability_deciding"] == 1000 and stability["n_stability_heldout"] > 900
    assert 0 < stability["n_stable_heads"] < 72 and stability["stable_heldout_share"] >= 0.85
    assert stability["heldout_modal_share_all"] < stability["stable_heldout_share"]


def test_stability_counts_every_head_on_held_out_sentences(capsys):
    code, out, err = run(capsys, "patterns", "--stability", "--inputs", "20", "--json")
    assert code == 0, err
    summary = json.loads(out.splitlines()[-1])
    assert (summary["model"], summary["inputs"], summary["heads"]) == ("minilm", 20, 72)
    assert 0 <= summary["stable_share"] <= summary["stable_or_mixed_share"] <= 1
    assert summary["stable_or_mixed_share"] == pytest.approx(summary["stable_share"] + summary["mixed_share"], abs=2e-4)
    assert all(flip["heads"] >= 1 and set(flip["column_mass"]) == set(flip["pair"]) for flip in summary["flips"])
    code, out, _ = run(capsys, "patterns", "--stability", "--inputs", "20")
    assert code == 0 and "stable heads" in out and "<->" in out


def test_heads_writes_a_report_and_prints_top_heads(capsys, tmp_path):
    out_dir = tmp_path / "report"
    code, out, err = run(capsys, "heads", "brown", "--limit", "6", "-o", str(out_dir), "--top", "sep",
                         "--layers", "3-5", "-n", "4")
    assert code == 0, err
    assert (out_dir / "report.html").is_file() and (out_dir / "heads.duckdb").is_file()
    assert "clearest heads (layer-head)" in out and "stable heads (most common label on >= 85% of inputs): 0 of 72" in out
    table = [line for line in out.split("heads by highest mean sep in layers 3-5")[1].splitlines()[1:] if line.strip()]
    assert len(table) == 1 + 4 and table[0].split() == ["layer", "head", "mean", "inputs"]
    assert all(3 <= int(line.split()[0]) <= 5 for line in table[1:])
    code, out, _ = run(capsys, "heads", "--db", str(out_dir / "heads.duckdb"), "--sql", "SELECT count(*) AS n FROM inputs")
    assert code == 0 and out.split() == ["n", "6"]


@pytest.mark.parametrize(("args", "fragment"), [
    (("heads",), "give a CORPUS"),
    (("heads", "--top", "sep", "--db", "/nonexistent/heads.duckdb"), "no head database"),
    (("heads", "no-such-corpus.txt"), "neither"),
    (("heads", "--top", "no_such_metric"), "invalid choice"),
    (("heads", "--top", "sep", "--layers", "5-3"), "empty layer range"),
    (("heads", "brown", "--num-actors", "2"), "options of --engine ray"),
    (("patterns",), "give a TEXT"),
    (("patterns", "  "), "text is empty"),
    (("patterns", "--stability", "--inputs", "5"), "--inputs must be between 20 and"),
    (("patterns", "The cat sat.", "--inputs", "30"), "--inputs counts the sentences of --stability"),
    (("patterns", "--stability", "--inputs", "100000"), "--inputs must be between 20 and"),
])
def test_bad_input_gives_one_clear_line(capsys, args, fragment):
    assert_clear_error(run(capsys, *args), fragment)


def test_the_installed_command_exits_2_without_a_traceback():
    result = subprocess.run([sys.executable, "-m", "attnscope", "heads", "--top", "sep", "--db", "/nonexistent.duckdb"],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().startswith("attnscope: error: no head database")


def test_heads_names_a_malformed_line_and_skips_it_when_asked(capsys, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "The cat sat on the mat."}\n{"text": "cut short\n\n{"text": "It was warm."}\n')
    assert_clear_error(run(capsys, "heads", str(corpus), "-o", str(tmp_path / "failed")),
                       "corpus.jsonl line 2: not valid JSON")
    code, out, err = run(capsys, "heads", str(corpus), "--on-bad-line", "skip", "-o", str(tmp_path / "kept"),
                         "--sql", "SELECT input_id, line FROM inputs ORDER BY input_id")
    assert code == 0 and f"skipped {corpus} line 2: not valid JSON" in err
    assert "analysed 2 inputs" in out and "skipped 1 malformed line(s)" in out
    assert out.split("input_id  line")[1].split() == ["0", "1", "1", "4"]
