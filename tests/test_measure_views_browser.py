"""Context-mixing measures in a real browser (Debian's Chromium through Playwright): the Measure
control of the head, model and neuron views of a file, and the explorer's, which fetches the measure
from the server. What is drawn is read back and compared with ``mixing_measures``."""

from __future__ import annotations

import numpy as np
import pytest

from attnscope import extract
from attnscope.experiments.mixing import mixing_measures
from attnscope.present import view

from . import test_views_browser
from .test_views_browser import APP, ARTIFACTS, Page

open_page = test_views_browser.open_page  # the same fixture: pages of views opened in Chromium, closed after

TEXT = "The cat sat on the mat."
METHODS = ("alti", "value_zeroing")


@pytest.fixture(scope="module")
def measured(minilm):
    """The record, its measures and the page carrying them."""
    ARTIFACTS.mkdir(exist_ok=True)
    record = extract(minilm, TEXT, qkv=True, norms=True)
    measures = mixing_measures(minilm, TEXT, METHODS)
    return record, measures, view(record, mixing=measures).save(ARTIFACTS / "views_mixing.html")


def quantized(values: np.ndarray) -> np.ndarray:
    """The bytes shipped for a layer-level map ``[q_pos, k_pos]``: scaled to the layer's largest value."""
    return np.rint(values / values.max() * 255)


def drawn_with(page: Page, field: str) -> None:
    """Wait until the head view is drawn from ``field``'s decoded grid (decoding is asynchronous)."""
    page.wait(f"{APP}.field() === '{field}' && {APP}.views.head.drawnWith.grid === {APP}.ready.get('0:{field}')")


def test_head_view_draws_alti_as_one_grey_line_set_and_its_rollout(measured, open_page):
    _, measures, path = measured
    page = open_page(path)
    options = page.js("[...document.querySelectorAll('[data-role=measure] option')].map(o => [o.value, o.title])")
    assert [value for value, _ in options] == ["attention", "norms", "alti", "value_zeroing"]
    assert "Ferrando et al. 2022" in dict(options)["alti"] and "Mohebbi et al. 2023" in dict(options)["value_zeroing"]
    page.page.select_option("[data-role=layer]", "2")
    page.page.select_option("[data-role=measure]", "alti")
    drawn_with(page, "mixing:alti:layers")
    alti = measures["alti"].layers[2]  # [q_pos, k_pos]
    lines = page.lines()
    assert {line["head"] for line in lines} == {None}  # no heads
    assert len(lines) == int((quantized(alti) >= 1).sum())
    step = alti.max() / 255
    assert all(abs(line["weight"] - alti[line["q_pos"], line["k_pos"]]) <= step / 2 * 1.001 for line in lines)
    colours = page.js(f"[...new Set({APP}.views.head.scene.ofType('lines').map(item => item.style.color))]")
    assert colours == ["#444"]
    assert page.page.is_hidden("div[data-view=head] .as-swatches")
    legend = page.page.text_content("[data-role=measure-legend]")
    assert "ALTI" in legend and "no heads" in legend
    assert "Ferrando et al. 2022, this layer's map" in page.js(f"{APP}.views.head.captionText()")

    page.page.select_option("[data-role=aggregate]", "rollout")
    drawn_with(page, "mixing:alti:rollout")
    rollout = measures["alti"].rollout[2]
    lines = page.lines()
    assert len(lines) == int((quantized(rollout) >= 1).sum())
    assert all(abs(line["weight"] - rollout[line["q_pos"], line["k_pos"]]) <= rollout.max() / 510 * 1.001 for line in lines)
    assert "rollout through this layer" in page.js(f"{APP}.views.head.captionText()")
    page.page.screenshot(path=str(ARTIFACTS / "head_view_alti.png"), full_page=True)
    page.close()


def test_model_view_draws_each_layers_map_and_rollout_and_a_click_opens_it(measured, open_page):
    record, measures, path = measured
    page = open_page(path)
    page.page.select_option("[data-role=measure]", "value_zeroing")
    page.page.click("button[data-view=model]")
    page.wait(f"{APP}.views.model.scene && {APP}.views.model.columns[0].id === 'layers' && "
              f"{APP}.views.model.scene.ofType('image').length === {2 * record.n_layers}")
    labels = page.js(f"{APP}.views.model.scene.ofType('text').filter(t => t.meta && t.meta.role === 'column').map(t => t.text)")
    assert labels == ["layer map", "rollout through it"]
    measure = measures["value_zeroing"]
    for layer in (0, 5):
        for column, expected in (("layers", measure.layers[layer]), ("rollout", measure.rollout[layer])):
            alpha = page.js(f"(() => {{ const image = {APP}.views.model.scene.ofType('image').find(i => i.meta.layer === {layer}"
                            f" && i.meta.column === '{column}'); return Array.from(image.pixels.data).filter((_, i) => i % 4 === 3); }})()")
            # short input: one pixel per (query, key); its opacity is the shipped byte
            assert np.array_equal(np.reshape(alpha, expected.shape), quantized(expected)), (layer, column)
    page.page.screenshot(path=str(ARTIFACTS / "model_view_value_zeroing.png"), full_page=True)
    point = page.js(f"{APP}.views.model.thumbnailPoint(4, 1)")  # layer 4, the rollout column
    page.page.mouse.click(point["x"], point["y"])
    drawn_with(page, "mixing:value_zeroing:rollout")
    assert page.js(f"{APP}.state.view") == "head" and page.js(f"{APP}.state.layer") == 4
    assert len(page.lines()) == int((quantized(measure.rollout[4]) >= 1).sum())
    page.close()


def test_neuron_view_says_it_cannot_show_a_layer_level_measure(measured, open_page):
    _, _, path = measured
    page = open_page(path)
    page.page.click("button[data-view=neuron]")
    page.wait_view("neuron")
    page.page.select_option("[data-role=measure]", "alti")
    page.wait(f"{APP}.views.neuron.scene.ofType('text').some(t => t.meta && t.meta.role === 'message')")
    message = page.js(f"{APP}.views.neuron.scene.ofType('text')[0].text")
    assert "ALTI" in message and "no heads" in message
    assert not page.js(f"{APP}.views.neuron.displayed().length")  # no numbers beside it
    page.close()


def test_the_address_chooses_the_measure_and_norms_1_still_works(measured, open_page):
    _, measures, path = measured
    page = open_page(path, "#view=head&layer=3&measure=alti&rollout=1")
    drawn_with(page, "mixing:alti:rollout")
    assert page.js(f"{APP}.state.layer") == 3 and page.page.input_value("[data-role=measure]") == "alti"
    assert len(page.lines()) == int((quantized(measures["alti"].rollout[3]) >= 1).sum())
    page.close()
    page = open_page(path, "#norms=1")
    drawn_with(page, "norms")
    assert page.page.input_value("[data-role=measure]") == "norms"
    page.close()
    page = open_page(path, "#measure=globenc")  # not shipped: falls back to attention
    assert page.js(f"{APP}.field()") == "attention" and page.page.input_value("[data-role=measure]") == "attention"
    page.close()


# ---- the explorer -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    from .test_serve_browser import running_server

    with running_server("minilm") as address:
        yield address


def test_explorer_measure_select_fetches_alti_for_the_text(browser, server, minilm):
    from .test_serve_browser import APP as EXPLORER_APP
    from .test_serve_browser import Explorer

    tab = Explorer(browser, server)
    tab.analyze(TEXT)
    options = tab.js("[...document.querySelectorAll('#views [data-role=measure] option')].map(o => o.value)")
    assert options == ["attention", "norms", "attention_mean", "norm", "norm_residual", "alti", "value_zeroing"]
    tab.page.select_option("#views [data-role=layer]", "1")
    tab.page.select_option("#views [data-role=measure]", "alti")
    tab.page.wait_for_function(f"() => {EXPLORER_APP}.field() === 'mixing:alti:layers' && "
                               f"{EXPLORER_APP}.views.head.drawnWith.grid === {EXPLORER_APP}.ready.get('0:mixing:alti:layers')")
    assert any(url.endswith("/api/mixing") for url in tab.requests)
    assert tab.js("[...document.querySelectorAll('#views [data-role=measure] option')].map(o => o.value)") == options
    alti = mixing_measures(minilm, TEXT, ["alti"])["alti"].layers[1]
    lines = tab.js(f"{EXPLORER_APP}.views.head.drawnLines()")
    assert {line["head"] for line in lines} == {None}
    assert len(lines) == int((quantized(alti) >= 1).sum())
    assert all(abs(line["weight"] - alti[line["q_pos"], line["k_pos"]]) <= alti.max() / 510 * 1.001 for line in lines)
    assert "measure=alti" in tab.page.url
    assert "ALTI" in tab.page.text_content("#views [data-role=measure-legend]")
    tab.page.screenshot(path=str(ARTIFACTS / "explorer_alti.png"), full_page=True)
    tab.check_clean()


def test_explorer_address_restores_the_measure_and_a_pair_offers_none(browser, server):
    from urllib.parse import quote

    from .test_serve_browser import APP as EXPLORER_APP
    from .test_serve_browser import Explorer

    tab = Explorer(browser, server, f"#model=minilm&text={quote(TEXT)}&view=model&measure=value_zeroing&rollout=1")
    # the analysis the address asks for is still running when the page is up: no views instance yet
    tab.page.wait_for_function(f"() => {EXPLORER_APP}?.views.model.scene && "
                               f"{EXPLORER_APP}.views.model.columns[0].id === 'layers'")
    assert tab.js(f"{EXPLORER_APP}.state.measure") == "value_zeroing" and tab.js(f"{EXPLORER_APP}.state.rollout") is True
    # with a second sentence an encoder's measures would be of another input: the control offers none
    tab.analyze(TEXT, "And a second sentence.")
    tab.page.wait_for_function(f"() => {EXPLORER_APP}.payload.sides.input.sentence.includes(1)")  # the new analysis
    options = tab.js("[...document.querySelectorAll('#views [data-role=measure] option')].map(o => o.value)")
    assert options == ["attention", "norms"] and tab.js(f"{EXPLORER_APP}.field()") == "attention"
    tab.check_clean()


def test_explorer_says_why_when_the_server_refuses_a_measure(browser, server):
    import json

    from .test_serve_browser import APP as EXPLORER_APP
    from .test_serve_browser import Explorer

    tab = Explorer(browser, server)
    tab.analyze(TEXT)
    refusal = {"status": 422, "content_type": "application/json", "body": json.dumps({"detail": "the model is busy"})}
    tab.page.route("**/api/mixing", lambda route: route.fulfill(**refusal))
    tab.page.select_option("#views [data-role=measure]", "norm_residual")
    tab.page.wait_for_function("() => document.querySelector('#views .as-status').textContent.includes('busy')")
    assert tab.js(f"{EXPLORER_APP}.field()") == "attention"
    assert tab.page.input_value("#views [data-role=measure]") == "attention"
    tab.errors = [e for e in tab.errors if "422" not in e]  # the browser logs the refused request itself
    tab.check_clean()


def test_encoder_decoder_offers_the_measures_on_its_encoder_only(tiny_model_dir, open_page):
    from attnscope import load_model, view_text

    bart = load_model(str(tiny_model_dir("bart")))
    path = view_text(bart, TEXT, "ein Ziel", measures=("alti",)).save(ARTIFACTS / "views_mixing_bart.html")
    page = open_page(path, "#measure=alti")
    options = "[...document.querySelectorAll('[data-role=measure] option')].map(o => o.value)"
    assert page.js(f"{APP}.kind().kind") == "encoder" and page.js(options) == ["attention", "norms", "alti"]
    drawn_with(page, "mixing:alti:layers")
    page.page.select_option("[data-role=kind]", "1")  # decoder self-attention: the measures are not defined there
    page.wait(f"{APP}.kind().kind === 'decoder' && {APP}.views.head.drawnWith.grid === {APP}.ready.get('1:attention')")
    assert page.js(options) == ["attention", "norms"] and page.js(f"{APP}.field()") == "attention"
    page.close()
