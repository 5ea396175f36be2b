"""The step view of a generation made with its steps' routes (``generate --routes``): the payload carries each step's
edges, packed, as ``step_routes`` reads them from the record (codes exact, numbers to float16) and follows the schema; a generation without routes ships none;
and in Debian's Chromium (Playwright) clicking a generated token of the saved page draws that step's route (as many
drawn edges as the record keeps for the step, each with its importance and, on hover, its top head). Tiny Llama
always; SmolLM2, Gemma 3 270M and Qwen2.5 0.5B where installed. Steps, layers and heads are 0-indexed."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnscope import generate, load_model
from attnscope.attribution import StepRoutes, step_routes
from attnscope.models.registry import ALIASES
from attnscope.present.steps import generation_payload, joined_blocks, steps_schema, steps_view

jsonschema = pytest.importorskip("jsonschema")
ARTIFACTS = Path(__file__).parent / "artifacts"
PROMPT = "The cat sat on the mat. The cat"
N_STEPS = 3
FLOAT16 = 2.0**-11  # relative rounding of a float16


@pytest.fixture(scope="module", params=["tiny-llama", "smollm2", "gemma3", "qwen0.5b"])
def routed(request, tiny_model_dir):
    """A generation of ``N_STEPS`` tokens with every step's route, and the model's name."""
    if request.param in ALIASES and not ALIASES[request.param].installed:
        pytest.skip(f"{request.param} not installed")
    loaded = load_model(str(tiny_model_dir("llama")) if request.param == "tiny-llama" else request.param)
    record = generate(loaded, PROMPT, max_new_tokens=N_STEPS, recorders=[StepRoutes()], progress=False)
    return request.param, record


def shipped_edges(routes: dict, step: int) -> list[dict]:
    """The packed routes' edges of ``step`` as ``Routes.to_dict`` writes them (numbers as float16 gave them)."""
    codes, importance, heads = (joined_blocks(routes[name]) for name in ("edges", "importance", "heads"))
    kinds, vias = routes["node_kinds"], routes["vias"]
    return [{"source": [int(c[1]), int(c[2]), kinds[int(c[3])]], "target": [int(c[4]), int(c[5]), kinds[int(c[6])]],
             "importance": float(importance[e]), "via": vias[int(c[7])],
             "heads": heads[e].tolist() if vias[int(c[7])] == "attention" else []}
            for e, c in enumerate(codes) if c[0] == step]


def close(shipped: float, exact: float) -> bool:
    return abs(shipped - exact) <= abs(exact) * FLOAT16 + 1e-7


def test_the_payload_carries_each_steps_route_and_follows_the_schema(routed):
    _, record = routed
    payload = generation_payload(record)
    jsonschema.validate(payload, steps_schema())
    for step in range(record.n_steps):
        graph = step_routes(record, step)
        edges, want = shipped_edges(payload["routes"], step), graph.to_dict()["edges"]
        assert len(edges) == len(want) > 0
        for got, exact in zip(edges, want):
            assert [got[key] for key in ("source", "target", "via")] == [exact[key] for key in ("source", "target", "via")]
            assert close(got["importance"], exact["importance"]) and len(got["heads"]) == len(exact["heads"])
            assert all(close(a, b) for a, b in zip(got["heads"], exact["heads"]))
        assert graph.position == payload["first_step"] - 1 + step  # the position whose prediction chose the token
        assert any(edge["target"] == [record.n_layers, graph.position, "residual"] for edge in edges)


def test_a_generation_without_routes_ships_none(tiny_model_dir):
    record = generate(load_model(str(tiny_model_dir("llama"))), PROMPT, max_new_tokens=2, progress=False)
    payload = generation_payload(record)
    assert payload["routes"] is None
    jsonschema.validate(payload, steps_schema())


def test_clicking_a_generated_token_draws_its_route_on_the_saved_page(browser, routed):
    name, record = routed
    ARTIFACTS.mkdir(exist_ok=True)
    path = steps_view(record).save(ARTIFACTS / f"steps_routes_{name}.html")
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    errors: list[str] = []
    page.on("console", lambda message: message.type == "error" and errors.append(message.text))
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(path.as_uri())
    page.wait_for_selector("[data-role=route][data-step='0']")
    for step in reversed(range(record.n_steps)):
        page.click(f"[data-role=strip] .st-step[data-step='{step}']")
        page.wait_for_selector(f"[data-role=route][data-step='{step}']")
        expected = step_routes(record, step).edges
        drawn = page.evaluate("Array.from(document.querySelectorAll('[data-role=route] line[data-role=edge]'), l => "
                              "[l.dataset.via, Number(l.dataset.importance), l.querySelector('title').textContent])")
        assert len(drawn) == len(expected) > 0
        assert [via for via, _, _ in drawn] == [e.via for e in expected]
        assert all(close(importance, e.importance) for (_, importance, _), e in zip(drawn, expected))
        for (_, _, title), edge in zip(drawn, expected):
            if edge.via == "attention":
                top = max(range(len(edge.heads)), key=edge.heads.__getitem__)
                assert f"top head {top} " in title
    page.locator("[data-role=route]").screenshot(path=str(ARTIFACTS / f"steps_routes_{name}.png"))
    assert errors == []
    page.close()
