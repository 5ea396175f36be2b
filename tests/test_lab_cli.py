"""The lab's commands as a user runs them (the toy translator is trained once and cached)."""

from __future__ import annotations

import json

from .test_cli import assert_one_line_error, run


def test_toy_translate_shows_steps_and_writes_html(tmp_path):
    result = run("toy", "translate", "i can eat apples", "--html", str(tmp_path / "steps.html"))
    assert result.returncode == 0, result.stderr
    assert "output: ich kann Äpfel essen" in result.stdout
    html = (tmp_path / "steps.html").read_text()
    assert 'id="attnscope-steps"' in html and "Äpfel" in html and "cdn" not in html.lower()


def test_toy_corrupt_prints_a_table_and_rejects_unknown_modes():
    result = run("toy", "corrupt", "i can eat apples", "--mode", "no-cross-attention")
    assert result.returncode == 0, result.stderr
    assert "(intact)" in result.stdout and "no-cross-attention" in result.stdout
    assert_one_line_error(run("toy", "corrupt", "i can eat apples", "--mode", "sideways"), "unknown mode 'sideways'")


def test_primer_writes_its_figures(tmp_path):
    result = run("primer", "-o", str(tmp_path), "--format", "png", "--format", "svg")
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["attnscope-manifest.json", "position_encoding.png", "position_encoding.svg",
                     "query_walkthrough.png", "query_walkthrough.svg"]
    assert json.dumps(names)  # paths printed one per line
    assert all(str(tmp_path / name) in result.stdout for name in names if name != "attnscope-manifest.json")


def test_generate_refuses_an_html_path_it_cannot_write_before_loading_the_model(tmp_path):
    result = run("generate", "The sea is", "--model", "no-such-model", "--html", str(tmp_path))
    assert_one_line_error(result, f"output file {tmp_path} is a folder")  # not "unknown model": checked first
