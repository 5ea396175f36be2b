"""The HTML views in a real browser: Debian's Chromium driven by Playwright (never a downloaded browser).

Each test opens a generated file, acts as a person would (select a layer, click and double-click
head squares, hover a token, click a thumbnail, export) and checks what is drawn against the
record. Screenshots and exports are kept in tests/artifacts/.
"""

from __future__ import annotations

import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from attnscope import extract, load_model
from attnscope.present import view

ARTIFACTS = Path(__file__).parent / "artifacts"
APP = 'AttnscopeViews.instances["attnscope-view"]'
PAIR = ("I went to the store.", "At the store, I bought fresh strawberries.")
STEP = 1 / 255  # one quantization step of the shipped weights


@pytest.fixture(scope="module")
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="module")
def pair(minilm, artifacts):
    record = extract(minilm, *PAIR, qkv=True, norms=True)
    return record, view(record).save(artifacts / "views_pair.html")


@pytest.fixture(scope="module")
def llama(tiny_model_dir, artifacts):
    record = extract(load_model(str(tiny_model_dir("llama"))), *PAIR, qkv=True, norms=True)
    return record, view(record).save(artifacts / "views_llama.html")


@pytest.fixture(scope="module")
def bart(tiny_model_dir, artifacts):
    record = extract(load_model(str(tiny_model_dir("bart"))), "I went to the store.", "At the store, I bought.",
                     qkv=True, norms=True)
    return record, view(record).save(artifacts / "views_bart.html")


class Page:
    """A page of views with its console errors and every URL it requested."""

    def __init__(self, browser, path: Path, fragment: str = "") -> None:
        self.page = browser.new_page(viewport={"width": 1200, "height": 900}, accept_downloads=True)
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.on("request", lambda request: self.requests.append(request.url))
        self.page.goto(path.as_uri() + fragment)  # the fragment may choose the starting state (#view=model)
        self.wait("document.querySelector('.attnscope-root')?.dataset.drawn")

    def js(self, expression: str):
        return self.page.evaluate(expression)

    def wait(self, expression: str) -> None:
        """Wait until ``expression`` is true; passed as a function because the page's Content-Security-Policy
        forbids eval, which Playwright uses to poll a bare expression string."""
        self.page.wait_for_function(f"() => ({expression})")

    def lines(self) -> list[dict]:
        return self.js(f"{APP}.views.head.drawnLines()")

    def wait_view(self, name: str) -> None:
        self.wait(f"(document.querySelector('.attnscope-root').dataset.drawn || '').includes('{name}')")

    def hover_token(self, side: str, pos: int) -> None:
        point = self.js(f"{APP}.views.head.tokenPoint('{side}', {pos})")
        self.page.mouse.move(point["x"], point["y"])

    def close(self, screenshot: Path | None = None) -> None:
        if screenshot is not None:
            self.page.screenshot(path=str(screenshot), full_page=True)
        assert self.errors == [], self.errors
        offline = ("file:", "data:", "blob:")
        assert all(url.startswith(offline) for url in self.requests), self.requests
        self.page.close()


@pytest.fixture
def open_page(browser):
    opened: list[Page] = []

    def open_(path: Path, fragment: str = "") -> Page:
        opened.append(Page(browser, path, fragment))
        return opened[-1]

    yield open_
    for page in opened:
        if not page.page.is_closed():
            page.page.close()


def expected_lines(weights: np.ndarray) -> int:
    """Lines the head view draws for these weights: those that round to at least 1 of 255."""
    return int((np.rint(weights * 255) >= 1).sum())


def test_head_view_layer_heads_and_hover_match_the_record(pair, open_page, artifacts):
    record, path = pair
    page = open_page(path)
    assert len(page.lines()) == expected_lines(record.attention[0])  # layer 0, all heads
    page.page.select_option("[data-role=layer]", "3")
    page.page.dblclick("div[data-view=head] span[data-head='5']")
    lines = page.lines()
    assert page.js(f"[...{APP}.state.heads]") == [5] and page.js(f"{APP}.state.layer") == 3
    assert {line["head"] for line in lines} == {5}
    assert len(lines) == expected_lines(record.attention[3, 5])

    query = record.tokens.index("store")
    page.hover_token("query", query)
    lines = page.lines()
    row = record.attention[3, 5, query]  # [k_pos]
    assert {line["q_pos"] for line in lines} == {query}
    assert len(lines) == expected_lines(row)
    strongest = max(lines, key=lambda line: line["weight"])
    assert row[strongest["k_pos"]] >= row.max() - STEP  # the record's strongest key (up to quantization)
    for line in lines:
        assert abs(line["weight"] - row[line["k_pos"]]) <= STEP / 2 + 1e-6
    written = page.js(f"{APP}.views.head.scene.ofType('text').filter(t => t.meta && t.meta.role === 'weight')"
                      ".map(t => [t.meta.key, Number(t.text)])")
    assert len(written) == len(lines)
    assert all(abs(weight - row[key]) <= 0.001 + STEP / 2 for key, weight in written)
    page.page.screenshot(path=str(artifacts / "head_view_hover.png"))

    page.page.mouse.move(2, 2)  # leaving the canvas brings every line back
    assert len(page.lines()) == expected_lines(record.attention[3, 5])
    page.close(artifacts / "head_view.png")


def test_clicking_a_head_square_hides_and_shows_it(pair, open_page):
    record, path = pair
    page = open_page(path)
    square = "div[data-view=head] span[data-head='0']"
    page.page.click(square)
    assert 0 not in {line["head"] for line in page.lines()}
    assert len(page.lines()) == expected_lines(record.attention[0, 1:])
    assert "as-off" in page.page.get_attribute(square, "class")
    page.page.click(square)
    assert len(page.lines()) == expected_lines(record.attention[0])
    page.close()


def test_sentence_filters_and_special_toggle(pair, open_page):
    record, path = pair
    sentence, special = record.sentence_ids, record.special_mask
    page = open_page(path)
    page.page.select_option("[data-role=filter]", "AB")
    lines = page.lines()
    assert lines and all(sentence[line["q_pos"]] == 0 and sentence[line["k_pos"]] == 1 for line in lines)
    a, b = sentence == 0, sentence == 1
    assert len(lines) == expected_lines(record.attention[0][:, a][:, :, b])
    page.page.select_option("[data-role=filter]", "all")
    page.page.check("[data-role=hide-special]")
    lines = page.lines()
    assert not any(special[line["q_pos"]] or special[line["k_pos"]] for line in lines)
    keep = ~special
    assert len(lines) == expected_lines(record.attention[0][:, keep][:, :, keep])
    page.close()


def test_measure_control_draws_norms(pair, open_page):
    record, path = pair
    page = open_page(path)
    page.page.select_option("[data-role=measure]", "norms")
    # the flag flips at once, the norms decode asynchronously: wait until the view is drawn from them
    page.wait(f"{APP}.field() === 'norms' && {APP}.views.head.drawnWith.grid === {APP}.ready.get('0:norms')")
    lines = page.lines()
    norms = record.norms[0]  # [head, q_pos, k_pos]
    step = norms.max() / 255  # norms are scaled per layer for display
    assert len(lines) == int((np.rint(norms / norms.max() * 255) >= 1).sum())
    assert all(abs(line["weight"] - norms[line["head"], line["q_pos"], line["k_pos"]]) <= step / 2 * 1.001
               for line in lines[:500])
    assert "Kobayashi" in page.js(f"{APP}.weightName()")
    page.close()


def test_model_view_thumbnail_opens_the_head(pair, open_page, artifacts):
    record, path = pair
    page = open_page(path)
    page.page.click("button[data-view=model]")
    page.wait_view("model")
    images = page.js(f"{APP}.views.model.scene.ofType('image').length")
    assert images == record.n_layers * record.n_heads
    page.page.screenshot(path=str(artifacts / "model_view.png"), full_page=True)
    point = page.js(f"{APP}.views.model.thumbnailPoint(4, 7)")
    page.page.mouse.click(point["x"], point["y"])
    page.wait_view("head")
    assert page.js(f"{APP}.state.view") == "head"
    assert page.js(f"{APP}.state.layer") == 4 and page.js(f"[...{APP}.state.heads]") == [7]
    lines = page.lines()
    assert {line["head"] for line in lines} == {7} and len(lines) == expected_lines(record.attention[4, 7])
    page.close()


def test_neuron_view_matches_q_dot_k_and_the_recorded_attention(pair, open_page, artifacts):
    record, path = pair
    layer, head, query = 2, 3, record.tokens.index("store")
    page = open_page(path)
    page.page.click("button[data-view=neuron]")
    page.wait_view("neuron")
    page.page.select_option("[data-role=layer]", str(layer))
    page.page.select_option("[data-role=neuron-head]", str(head))
    page.page.select_option("[data-role=neuron-query]", str(query))
    rows = page.js(f"{APP}.views.neuron.displayed()")
    q = record.queries[layer, head, query].astype(np.float64)
    keys = record.keys[layer, head].astype(np.float64)  # [k_pos, d_head]
    dots = keys @ q  # direct computation from the record
    assert [row["k_pos"] for row in rows] == list(range(len(record.tokens)))
    assert [row["key"] for row in rows] == list(record.tokens)
    for row in rows:  # float16 vectors: a few thousandths relative
        assert abs(row["qk"] - dots[row["k_pos"]]) <= 0.02 + 0.004 * abs(dots[row["k_pos"]])
        assert abs(row["softmax"] - record.attention[layer, head, query, row["k_pos"]]) <= 0.005
        assert abs(row["recorded"] - record.attention[layer, head, query, row["k_pos"]]) <= 0.0015 + STEP / 2
    page.close(artifacts / "neuron_view.png")


def test_export_svg_and_png_downloads(pair, open_page, artifacts):
    pytest.importorskip("PIL")
    from PIL import Image

    record, path = pair
    page = open_page(path)
    with page.page.expect_download() as svg_download:
        page.page.click("[data-role=export-svg]")
    svg_path = artifacts / svg_download.value.suggested_filename
    svg_download.value.save_as(svg_path)
    assert svg_path.name == "attnscope-head-self-layer0.svg"
    root = ET.parse(svg_path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    paths = root.findall("{http://www.w3.org/2000/svg}path")
    assert sum(element.get("d").count("M") for element in paths) == expected_lines(record.attention[0])
    texts = [element.text for element in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "##berries" in texts and "[CLS]" in texts

    with page.page.expect_download() as png_download:
        page.page.click("[data-role=export-png]")
    png_path = artifacts / png_download.value.suggested_filename
    png_download.value.save_as(png_path)
    scene = page.js(f"[{APP}.views.head.scene.width, {APP}.views.head.scene.height]")
    with Image.open(png_path) as image:
        assert image.format == "PNG" and image.size == (round(scene[0] * 2), round(scene[1] * 2))
        assert len(set(image.convert("RGB").getdata())) > 20  # a drawing, not a blank canvas
    page.close()


def test_decoder_views_respect_causality_and_name_the_shared_key_head(llama, open_page, artifacts):
    record, path = llama
    page = open_page(path)
    lines = page.lines()
    assert lines and all(line["k_pos"] <= line["q_pos"] for line in lines)
    assert len(lines) == expected_lines(record.attention[0])
    page.page.click("button[data-view=neuron]")
    page.wait_view("neuron")
    page.page.select_option("[data-role=neuron-head]", "4")
    page.page.select_option("[data-role=neuron-query]", "6")
    rows = page.js(f"{APP}.views.neuron.displayed()")
    assert [row["k_pos"] for row in rows] == list(range(7))  # no future keys
    dots = record.keys[0, 4, :7].astype(np.float64) @ record.queries[0, 4, 6].astype(np.float64)
    assert np.allclose([row["qk"] for row in rows], dots, atol=0.01)
    assert np.allclose([row["softmax"] for row in rows], record.attention[0, 4, 6, :7], atol=0.005)
    captions = page.js(f"{APP}.views.neuron.scene.ofType('text').map(t => t.text)")
    assert any("key head 1 (shared by query heads 3\u20135)" in text for text in captions)
    page.page.click("button[data-view=model]")
    page.wait_view("model")
    page.close(artifacts / "decoder_model_view.png")


def test_encoder_decoder_kinds_have_their_own_views(bart, open_page, artifacts):
    record, path = bart
    page = open_page(path)
    options = page.page.eval_on_selector_all("[data-role=kind] option", "options => options.map(o => o.textContent)")
    assert options == ["encoder self-attention", "decoder self-attention", "cross-attention (decoder -> encoder)"]
    assert len(page.lines()) == expected_lines(record.attention[0])
    page.page.select_option("[data-role=kind]", "2")
    page.wait(f"{APP}.views.head.drawnWith.grid === {APP}.ready.get('2:attention')")  # drawn from the cross weights
    assert len(page.lines()) == expected_lines(record.cross_attention[0])
    for line in page.lines()[:200]:
        assert abs(line["weight"] - record.cross_attention[0, line["head"], line["q_pos"], line["k_pos"]]) <= STEP / 2 + 1e-6
    left = page.js(f"{APP}.views.head.scene.ofType('text').filter(t => t.meta && t.meta.side === 'query').map(t => t.text)")
    assert len(left) == len(record.target_tokens)
    page.page.screenshot(path=str(artifacts / "cross_head_view.png"), full_page=True)
    page.page.select_option("[data-role=kind]", "1")
    page.wait(f"{APP}.views.head.drawnWith.grid === {APP}.ready.get('1:attention')")
    assert len(page.lines()) == expected_lines(record.decoder_attention[0])
    assert all(line["k_pos"] <= line["q_pos"] for line in page.lines())
    page.close()


def test_two_notebook_outputs_on_one_page_work_side_by_side(pair, llama, open_page, artifacts, tmp_path):
    notebook = tmp_path / "notebook.html"
    fragments = [view(pair[0], "head")._repr_html_(), view(llama[0], "model")._repr_html_()]
    notebook.write_text("<!DOCTYPE html><html><body>" + "<hr>".join(fragments) + "</body></html>", encoding="utf-8")
    page = open_page(notebook)
    page.wait("document.querySelectorAll('.attnscope-root[data-drawn]').length === 2")
    drawn = page.js("[...document.querySelectorAll('.attnscope-root')].map(r => [r.id, r.dataset.drawn])")
    assert [state for _, state in drawn] == ["head", "model"] and drawn[0][0] != drawn[1][0]
    shutil.copy(notebook, artifacts / "notebook_two_outputs.html")
    page.close(artifacts / "notebook_two_outputs.png")


def test_page_address_chooses_the_starting_view(pair, browser):
    _, path = pair
    page = browser.new_page()
    page.goto(path.as_uri() + "#view=neuron&layer=2&head=3&query=5")
    page.wait_for_function("() => document.querySelector('.attnscope-root')?.dataset.drawn")
    state = page.evaluate(f"[{APP}.state.view, {APP}.state.layer, {APP}.state.neuronHead, {APP}.state.query]")
    assert state == ["neuron", 2, 3, 5]
    assert page.input_value("[data-role=neuron-query]") == "5" and page.input_value("[data-role=layer]") == "2"
    page.close()


def test_long_input_draws_the_strongest_lines_within_the_budget(minilm, open_page, tmp_path):
    from attnscope.data import brown_sentences

    record = extract(minilm, " ".join(brown_sentences(14)))
    assert len(record.tokens) > 250
    page = open_page(view(record, "head").save(tmp_path / "long.html"))
    budget, cutoff = page.js("[40000, AttnscopeViews.instances['attnscope-view'].views.head.minByte]")
    quantized = np.rint(record.attention[0] * 255)  # [head, q_pos, k_pos] as shipped
    assert (quantized >= 1).sum() > budget and cutoff > 1  # too many to draw them all
    lines = page.lines()
    assert len(lines) == (quantized >= cutoff).sum() <= budget < (quantized >= cutoff - 1).sum()
    caption = page.js(f"{APP}.views.head.scene.ofType('text').map(t => t.text).find(t => t.startsWith('showing'))")
    assert caption.startswith(f"showing the {len(lines)} strongest of {int((quantized >= 1).sum())} lines")
    query = 100
    page.hover_token("query", query)  # hovering still shows every line of that token
    assert len(page.lines()) == expected_lines(record.attention[0, :, query])
    page.close()


def test_view_opens_on_the_layer_and_heads_asked(pair, open_page, artifacts):
    record, _ = pair
    path = view(record, layer=4, heads=[1, 5], include_layers=[0, 2, 4]).save(artifacts / "views_start.html")
    page = open_page(path)
    assert page.js(f"{APP}.state.layer") == 2 and page.js(f"[...{APP}.state.heads]") == [1, 5]
    assert page.page.input_value("[data-role=layer]") == "2"
    assert page.js("[...document.querySelector('[data-role=layer]').options].map(o => o.text)") == ["0", "2", "4"]
    lines = page.lines()
    assert {line["head"] for line in lines} == {1, 5}
    assert len(lines) == expected_lines(record.attention[4, [1, 5]])
    caption = page.js(f"{APP}.views.head.scene.ofType('text').find(t => t.text.includes('self-attention')).text")
    assert "layer 4 " in caption and "heads 1, 5" in caption
    page.close()


def test_double_clicking_the_only_head_shown_brings_all_heads_back(pair, open_page):
    record, path = pair
    page = open_page(path)
    square = "div[data-view=head] span[data-head='5']"
    page.page.dblclick(square)
    assert {line["head"] for line in page.lines()} == {5}
    page.page.dblclick(square)
    assert page.js(f"[...{APP}.state.heads].length") == record.n_heads
    assert len(page.lines()) == expected_lines(record.attention[0])
    page.close()


def test_model_and_neuron_views_name_their_colour_scales(pair, open_page):
    _, path = pair
    page = open_page(path)
    page.page.click("button[data-view=model]")
    page.wait_view("model")
    scale = page.js(f"{APP}.views.model.scene.ofType('text').filter(t => t.meta && t.meta.role === 'scale').map(t => t.text)")
    assert scale[:2] == ["0", "1"] and scale[2].startswith("opacity = \u03b1, each head in its own colour")
    page.page.click("button[data-view=neuron]")
    page.wait_view("neuron")
    scale = page.js(f"{APP}.views.neuron.scene.ofType('text').filter(t => t.meta && t.meta.role === 'scale').map(t => t.text)")
    assert scale[:2] == ["negative (orange)", "positive (blue)"]
    # the scale's ends are the colours the strips use: the largest positive and negative q component
    fills = page.js(f"{APP}.views.neuron.scene.ofType('rect').filter(r => r.style.fill && r.style.alpha === 1)"
                    ".map(r => r.style.fill)")
    assert {"rgb(31,119,180)", "rgb(255,127,14)"} <= set(fills)
    page.close()
