"""``attnscope view --long`` / ``--file``: the long view captured with a plan, end to end on minilm."""

from __future__ import annotations

import json
import re

import numpy as np

from attnscope.capture.extract import extract
from attnscope.cli import main
from attnscope.present.longview import LONG_VIEWS
from attnscope.present.payload import unpack
from attnscope.records.attention import AttentionRecord


def _payload(html: str) -> dict:
    match = re.search(r'<script type="application/json" id="[^"]+-payload">(.*?)</script>', html, re.DOTALL)
    assert match, "no payload in the page"
    return json.loads(match.group(1))


def test_view_long_writes_the_long_page_from_a_plan(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("attnscope.capture.extract.PROGRESS_DELAY_S", 0.0)  # this short capture would show no bar
    text = tmp_path / "doc.txt"
    text.write_text("The cat sat on the mat. " * 40 + "Then it slept.", encoding="utf-8")
    out = tmp_path / "long.html"
    assert main(["view", "--file", str(text), "--long", "-o", str(out)]) == 0
    printed = capsys.readouterr()
    assert "long view" in printed.out
    # the long work is not silent: a bar per captured layer, then the page, on stderr
    assert "capturing" in printed.err and "/6 [" in printed.err and "building the long view" in printed.err
    payload = _payload(out.read_text(encoding="utf-8"))
    assert payload["format"] == "attnscope.longview" and payload["views"] == list(LONG_VIEWS)
    full = extract("minilm", text.read_text(encoding="utf-8"))
    assert payload["tokens"] == list(full.tokens)
    assert payload["layers"] == list(range(full.n_layers)) and payload["heads"] == list(range(full.n_heads))


def test_the_progress_bar_leaves_the_capture_unchanged():
    text = "The cat sat on the mat. Then it slept."
    quiet, shown = extract("minilm", text), extract("minilm", text, progress=True)
    np.testing.assert_array_equal(quiet.attention, shown.attention)


def test_view_of_a_partial_record_without_an_overview_says_what_it_needs(tmp_path, capsys):
    records = tmp_path / "recs"
    assert main(["extract", "The cat sat on the mat.", "--stats", "-o", str(records)]) == 0
    record = next(records.glob("*.safetensors"))
    assert main(["view", "--record", str(record), "-o", str(tmp_path / "v.html")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "needs an overview and top-k keys" in error[0]


def test_a_saved_long_record_opens_lazily_in_the_view(tmp_path):
    records = tmp_path / "recs"
    assert main(["extract", "The cat sat on the mat.", "--top-k", "4", "--overview", "2", "-o", str(records)]) == 0
    record = next(records.glob("*.safetensors"))
    assert main(["view", "--record", str(record), "-o", str(tmp_path / "v.html")]) == 0
    payload = _payload((tmp_path / "v.html").read_text(encoding="utf-8"))
    saved = AttentionRecord.open(record)
    assert payload["top_k"]["source_k"] == 4 and payload["overview"]["source_block"] == 2
    assert len(payload["top_k"]["weights"]) == saved.model.n_layers  # one list per layer, one entry per head
    first_head = unpack(payload["top_k"]["weights"][0][0])  # [k, q_pos], rank 0 strongest
    np.testing.assert_allclose(first_head.T[:, : first_head.shape[0]], saved.held("topk_weights")[0, 0][:, : first_head.shape[0]],
                               atol=1e-3)


def test_view_of_chosen_layers_and_heads_keeps_more_keys(tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text("The cat sat on the mat. " * 60, encoding="utf-8")
    out = tmp_path / "some.html"
    assert main(["view", "--file", str(text), "--layers", "1", "--heads", "0,2", "-o", str(out)]) == 0
    payload = _payload(out.read_text(encoding="utf-8"))
    assert payload["layers"] == [1] and payload["heads"] == [0, 2]
    assert payload["top_k"]["k"] == payload["top_k"]["source_k"] == 32  # two heads: every captured key fits


def test_a_truncated_input_is_said_on_the_page_and_in_the_terminal(tmp_path, capsys):
    out = tmp_path / "cut.html"
    assert main(["view", "The cat sat on the mat and looked at the dog.", "--max-tokens", "8", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "attnscope: warning: " in err and "truncated to 8" in err
    payload = _payload(out.read_text(encoding="utf-8"))
    assert len(payload["sides"]["input"]["tokens"]) == 8
    assert payload["notes"][0].startswith("the input was truncated: ") and "truncated to 8" in payload["notes"][0]
    assert main(["view", "The cat sat.", "-o", str(tmp_path / "whole.html")]) == 0
    whole = _payload((tmp_path / "whole.html").read_text(encoding="utf-8"))
    assert not any("truncated" in note for note in whole["notes"])


def test_a_truncated_long_input_is_said_on_the_long_page(tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text("The cat sat on the mat. " * 40, encoding="utf-8")
    out = tmp_path / "long.html"
    assert main(["view", "--file", str(text), "--long", "--max-tokens", "100", "-o", str(out)]) == 0
    payload = _payload(out.read_text(encoding="utf-8"))
    assert len(payload["tokens"]) == 100 and "truncated to 100" in payload["notes"][0]
