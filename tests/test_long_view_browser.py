"""The long-input view in a real browser (Debian's Chromium driven by Playwright), on an 8,192-token
synthetic attention whose every weight is known (tests/long_attention.py): the heatmap draws the
overview, zooming in draws top-k weights with token labels, a thumbnail opens its head, and the
window head view draws the top-k lines of its tokens."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from attnscope.present import long_view

from .long_attention import synthetic_long_attention
from .test_views_browser import APP, Page

ARTIFACTS = Path(__file__).parent / "artifacts"
TOKENS, K, BLOCK = 8192, 16, 32
LAYERS, HEADS = [3, 4], [0, 2, 5]  # the model's numbers of the layers and heads the arrays hold
HEATMAP = f"{APP}.views.heatmap"
F16 = 2e-3  # float16 is good to 1/2048 relative


@pytest.fixture(scope="module")
def long_page():
    attention = synthetic_long_attention(TOKENS, len(LAYERS), len(HEADS), k=K, block=BLOCK)
    special = np.zeros(TOKENS, dtype=bool)
    special[0] = True
    page = long_view(attention.tokens, attention.overview, BLOCK, attention.indices, attention.weights,
                     layers=LAYERS, heads=HEADS, causal=True, special_mask=special)
    ARTIFACTS.mkdir(exist_ok=True)
    return attention, page.save(ARTIFACTS / "long_view.html")


@pytest.fixture
def opened(browser, long_page):
    page = Page(browser, long_page[1])
    yield long_page[0], page
    if not page.page.is_closed():
        page.page.close()


def coloured_pixels(page: Page, canvas: str) -> int:
    """Pixels of a canvas in a colour of the weight ramp (not white, grey or black)."""
    return page.js(f"""(() => {{
        const c = {canvas}; const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < d.length; i += 4) if (d[i] !== d[i + 1] || d[i + 1] !== d[i + 2]) n++;
        return n; }})()""")


def hover_cell(page: Page, query: int, key: int) -> dict:
    point = page.js(f"{HEATMAP}.cellPoint({query}, {key})")
    assert point is not None, (query, key)
    page.page.mouse.move(point["x"], point["y"])
    return page.js(f"{HEATMAP}.hovered")


def test_heatmap_starts_with_the_whole_overview(opened):
    attention, page = opened
    assert page.js(f"{HEATMAP}.mode") == "overview" and page.js(f"{HEATMAP}.zoom.span") == TOKENS
    assert coloured_pixels(page, f"{HEATMAP}.canvas") > 100_000  # the lower triangle of a 640 px plot
    for query, key in [(5008, 16), (5008, 4976), (7024, 3024), (112, 4016)]:  # block centres
        shown = hover_cell(page, query, key)  # a pixel holds 12.8 tokens: the mouse lands within one pixel
        assert abs(shown["query"] - query) <= 13 and abs(shown["key"] - key) <= 13
        query, key = shown["query"], shown["key"]
        if key > query:
            assert "masked" in shown["text"]
        else:
            assert shown["block"] == pytest.approx(attention.overview[0, 0, query // BLOCK, key // BLOCK], rel=F16)
    assert "masked" in page.js("document.querySelector('[data-role=heatmap-readout]').textContent")
    assert page.js(f"{HEATMAP}.scene.ofType('text').filter(t => t.meta && t.meta.role === 'label').length") == 0
    page.close(ARTIFACTS / "long_view_heatmap.png")


def test_zooming_in_draws_top_k_weights_with_token_labels(opened):
    attention, page = opened
    point = page.js(f"{HEATMAP}.cellPoint(6000, 6000)")
    while page.js(f"{HEATMAP}.zoom.span") >= 80:
        page.page.mouse.move(point["x"], point["y"])
        page.page.mouse.wheel(0, -600)
        page.wait(f"{HEATMAP}.scene.ofType('text').length && {APP}.drawCount > 0")
    page.wait(f"{HEATMAP}.drawnWith.rows")
    zoom = page.js(f"{HEATMAP}.zoom")
    assert zoom["span"] < 80 and page.js(f"{HEATMAP}.mode") == "top-k"
    assert zoom["q0"] <= 6000 < zoom["q0"] + zoom["span"]  # zoomed about the mouse
    labels = page.js(f"{HEATMAP}.scene.ofType('text').filter(t => t.meta && t.meta.role === 'label')"
                     ".map(t => [t.meta.axis, t.meta.pos, t.text])")
    queries = [pos for axis, pos, _ in labels if axis == "query"]
    assert queries == list(range(math.ceil(zoom["q0"] - 0.5), math.ceil(zoom["q0"] + zoom["span"] - 0.5)))[:len(queries)]
    assert len(queries) >= int(zoom["span"]) - 1 and all(text == attention.tokens[pos] for _, pos, text in labels)
    assert {axis for axis, _, _ in labels} == {"query", "key"}
    assert coloured_pixels(page, f"{HEATMAP}.canvas") > 1000

    query = int(zoom["q0"] + zoom["span"] / 2)
    previous = hover_cell(page, query, query - 1)  # the diagonal: always among the top-k
    assert previous["weight"] == pytest.approx(attention.weight(0, 0, query, query - 1), rel=F16)
    listed = set(attention.indices[0, 0, query][attention.weights[0, 0, query] > 0])
    absent = next(key for key in range(int(zoom["k0"]) + 1, query) if key not in listed)
    shown = hover_cell(page, query, absent)
    assert shown["weight"] is None and "not among" in shown["text"]

    before = page.js(f"{HEATMAP}.zoom.k0")
    page.page.mouse.move(point["x"], point["y"])  # drag 40 px to the right: the view moves left
    page.page.mouse.down()
    page.page.mouse.move(point["x"] + 40, point["y"], steps=4)
    page.page.mouse.up()
    per_token = 640 / zoom["span"]
    assert page.js(f"{HEATMAP}.zoom.k0") == pytest.approx(before - 40 / per_token, abs=1e-6)
    page.page.click("[data-role=zoom-reset]")
    page.wait(f"{HEATMAP}.zoom.span === {TOKENS} && {HEATMAP}.drawnWith.cells")
    page.close(ARTIFACTS / "long_view_zoomed.png")


def test_a_thumbnail_click_opens_that_layer_and_head(opened):
    attention, page = opened
    page.page.click("button[data-view=model]")
    page.wait_view("model")
    assert page.js(f"{APP}.views.model.scene.ofType('image').length") == len(LAYERS) * len(HEADS)
    assert coloured_pixels(page, f"{APP}.views.model.canvas") > 1000
    page.page.screenshot(path=str(ARTIFACTS / "long_view_model.png"))
    point = page.js(f"{APP}.views.model.thumbnailPoint(1, 2)")
    page.page.mouse.click(point["x"], point["y"])
    page.wait(f"{APP}.state.view === 'heatmap' && {HEATMAP}.drawnWith.cells === {APP}.decoded.get('overview:1:2') "
              f"|| ({APP}.state.view === 'heatmap' && {APP}.state.head === 2)")
    assert page.js(f"[{APP}.state.layer, {APP}.state.head]") == [1, 2]
    assert page.page.input_value("[data-role=head]") == "2" and page.page.input_value("[data-role=layer]") == "1"
    page.wait(f"{HEATMAP}.scene.ofType('text')[0].text.includes('layer 4 \u00b7 head 5')")  # the model's numbers
    shown = hover_cell(page, 3024, 112)
    cell = attention.overview[1, 2, shown["query"] // BLOCK, shown["key"] // BLOCK]
    assert shown["block"] == pytest.approx(cell, rel=F16)
    page.close()


def expected_window_lines(attention, layer: int, heads: list[int], start: int, width: int) -> dict:
    """(head, q_pos, k_pos) -> weight of the top-k entries inside the window that round to >= 1/255."""
    out = {}
    for head in heads:
        for query in range(start, start + width):
            for key, weight in zip(attention.indices[layer, head, query], attention.weights[layer, head, query],
                                   strict=True):
                if start <= key < start + width and round(float(weight) * 255) >= 1:
                    out[(HEADS[head], query, int(key))] = float(weight)
    return out


def test_window_head_view_draws_the_top_k_lines_of_its_tokens(opened):
    attention, page = opened
    page.page.select_option("[data-role=layer]", "1")
    page.page.click("button[data-view=window]")
    page.wait_view("window")
    page.page.fill("[data-role=window-start]", "4000")
    page.page.press("[data-role=window-start]", "Enter")
    caption = f"{APP}.views.window.view.scene.ofType('text').find(t => t.text.startsWith('tokens ')).text"
    page.wait(f"{caption}.startsWith('tokens 4000')")
    assert page.js(f"{APP}.state.window") == {"start": 4000, "width": 64}
    lines = page.js(f"{APP}.views.window.lines()")
    drawn = {(line["head"], line["q_pos"], line["k_pos"]): line["weight"] for line in lines}
    expected = expected_window_lines(attention, 1, [0], 4000, 64)  # head index 0 is selected at the start
    assert drawn.keys() == expected.keys() and len(drawn) > 64  # a diagonal, a few others
    assert all(abs(drawn[key] - weight) <= 0.5 / 255 + 1e-3 * weight for key, weight in expected.items())
    assert "layer 4" in page.js(caption) and f"top {K} keys" in page.js(caption)
    assert "Lines come from the top" in page.page.inner_text("div[data-view=window]")
    page.page.screenshot(path=str(ARTIFACTS / "long_view_window.png"), full_page=True)

    page.page.select_option("[data-role=head]", "mean")  # all heads of the layer, one colour each
    page.wait(f"{APP}.views.window.heads.state.heads.size === 3 && {APP}.state.view === 'window'")
    page.wait(f"new Set({APP}.views.window.lines().map(l => l.head)).size === 3")
    lines = page.js(f"{APP}.views.window.lines()")
    assert {(line["head"], line["q_pos"], line["k_pos"]) for line in lines} == \
        expected_window_lines(attention, 1, [0, 1, 2], 4000, 64).keys()
    page.close()


def test_clicking_the_heatmap_picks_the_window(opened):
    _, page = opened
    point = page.js(f"{HEATMAP}.cellPoint(6000, 5900)")
    page.page.mouse.click(point["x"], point["y"])
    start = page.js(f"{APP}.state.window.start")
    clicked = page.js(f"{HEATMAP}.hovered")
    assert start == round((clicked["query"] + clicked["key"]) / 2 - 32)
    assert page.page.input_value("[data-role=window-start]") == str(start)
    page.close()


def test_a_real_512_token_record_reads_back_from_the_page(minilm, browser):
    """The default model's attention over 512 tokens of Brown-corpus text, drawn from its own overview
    and top-k rows: what the page says at a cell is the record's weight."""
    import warnings

    from attnscope import extract_corpus
    from attnscope.data import brown_sentences
    from attnscope.present import downsample_attention, top_k_rows

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cut to the model's 512 tokens is intended
        record = next(extract_corpus(minilm, [" ".join(brown_sentences(80))], max_length=512, progress=False))
    attention = record.attention  # [layer, head, q_pos, k_pos]
    indices, weights = top_k_rows(attention, K)
    path = long_view(record.tokens, downsample_attention(attention, 16), 16, indices, weights,
                     layers=range(record.n_layers), heads=range(record.n_heads), causal=False,
                     special_mask=record.special_mask).save(ARTIFACTS / "long_view_minilm.html")
    page = Page(browser, path)
    page.page.select_option("[data-role=layer]", "2")
    page.page.select_option("[data-role=head]", "7")
    page.wait(f"{HEATMAP}.scene.ofType('text')[0].text.includes('layer 2 \u00b7 head 7')")
    assert page.js(f"{HEATMAP}.mode") == "top-k"  # 512 tokens fit the 640 px plot: token resolution at once
    page.js(f"{HEATMAP}.setZoom(200, 190, 40)")
    page.wait(f"{HEATMAP}.zoom.span === 40 && {HEATMAP}.scene.ofType('text').some(t => t.meta && t.meta.role === 'label')")
    checked = 0
    for query in (205, 210, 221):
        in_sight = [int(key) for key in indices[2, 7, query] if 190 <= key < 230]  # strongest first
        for key in in_sight[:2]:
            shown = hover_cell(page, query, key)
            assert shown["weight"] == pytest.approx(attention[2, 7, query, key], rel=F16)
            assert record.tokens[key] in shown["text"]
            checked += 1
    assert checked >= 3
    page.close(ARTIFACTS / "long_view_minilm.png")


def test_a_five_token_page_draws_every_panel(browser, tmp_path):
    rng = np.random.default_rng(0)
    attention = rng.random((1, 2, 5, 5))
    attention /= attention.sum(axis=-1, keepdims=True)  # bidirectional rows summing to 1
    indices, weights = np.argsort(-attention, axis=-1), -np.sort(-attention, axis=-1)
    tokens = ["[CLS]", "a", "b", "c", "[SEP]"]
    path = long_view(tokens, attention, 1, indices, weights, layers=[0], heads=[0, 1], causal=False,
                     special_mask=[True, False, False, False, True]).save(tmp_path / "five.html")
    page = Page(browser, path)
    assert page.js(f"{HEATMAP}.mode") == "top-k"
    labels = page.js(f"{HEATMAP}.scene.ofType('text').filter(t => t.meta && t.meta.role === 'label').map(t => t.text)")
    assert labels == tokens + tokens  # queries, then keys
    assert hover_cell(page, 3, 1)["weight"] == pytest.approx(attention[0, 0, 3, 1], rel=F16)
    for view in ("model", "window"):
        page.page.click(f"button[data-view={view}]")
        page.wait_view(view)
    assert page.js(f"{APP}.state.window") == {"start": 0, "width": 5}
    drawn = len(page.js(f"{APP}.views.window.lines()"))
    assert drawn == int((np.rint(attention[0, 0] * 255) >= 1).sum()) > 20  # head 0: every pair is in its top 5
    page.close()


@pytest.mark.parametrize(("fragment", "expected"), [
    ("#layer=4&head=5", ["heatmap", 1, 2]),  # the model's numbers: the arrays' second layer and third head
    ("#view=model&layer=3&head=mean", ["model", 0, "mean"]),
    ("#layer=7&head=1&view=nothing", ["heatmap", 0, 0]),  # what the page does not hold is ignored
])
def test_the_address_chooses_the_starting_view_layer_and_head(browser, long_page, fragment, expected):
    page = Page(browser, long_page[1], fragment)
    assert page.js(f"[{APP}.state.view, {APP}.state.layer, {APP}.state.head]") == expected
    assert page.page.input_value("[data-role=layer]") == str(expected[1])
    assert page.page.input_value("[data-role=head]") == str(expected[2])
    if expected[0] == "heatmap":
        page.wait(f"{HEATMAP}.scene.ofType('text')[0].text.includes('layer {LAYERS[expected[1]]} \u00b7 ')")
    assert not page.errors, page.errors
    page.page.close()
