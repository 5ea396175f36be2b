"""The explorer end to end: `attnscope serve` started as a user starts it, driven in Debian's
Chromium through Playwright (never a downloaded browser). A person types a sentence, sees the
head view, clicks the pattern map, ablates a head and sees the figures change; the page must
make no console errors and no request outside the server.

The flow test writes tests/artifacts/explorer.png; with ATTNSCOPE_SCREENSHOTS=1 it also writes
docs/img/explorer.png, the picture of docs/explorer.md.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pytest

from attnscope import extract

from .test_views_browser import ARTIFACTS

PAIR = ("I went to the store.", "At the store, I bought fresh strawberries.")
APP = 'AttnscopeViews.instances["views"]'


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def running_server(*models: str) -> Iterator[str]:
    """`attnscope serve --model ...` started as a user starts it; yields its address, stops it after."""
    port = free_port()
    arguments = [part for model in models for part in ("--model", model)]
    process = subprocess.Popen([sys.executable, "-m", "attnscope", "serve", *arguments, "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    address = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                urllib.request.urlopen(f"{address}/api/models", timeout=5).read()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"attnscope serve did not start:\n{process.stdout.read()}") from None
                time.sleep(0.5)
        yield address
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def server():
    """The address of a running `attnscope serve` with the default model and the toy translator."""
    with running_server("minilm", "toy-translator") as address:
        yield address


class Explorer:
    """One explorer tab, with its console errors and every URL it requested."""

    def __init__(self, browser, server: str, fragment: str = "") -> None:
        self.server = server
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.on("request", lambda request: self.requests.append(request.url))
        self.page.goto(f"{server}/{fragment}")
        self.page.wait_for_selector("#model option", state="attached")

    def js(self, expression: str):
        return self.page.evaluate(expression)

    def analyze(self, text: str, pair: str = "") -> None:
        self.page.fill("#text", text)
        self.page.fill("#pair", pair)
        self.page.click("#analyze")
        self.page.wait_for_selector("#views[data-drawn]")

    def canvas_pixels(self) -> np.ndarray:
        data = self.js(f"(() => {{ const c = {APP}.views[{APP}.state.view].canvas;"
                       "return Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data); })()")
        return np.array(data, dtype=np.uint8)

    def check_clean(self) -> None:
        assert self.errors == []
        assert all(url.startswith((self.server, "data:", "blob:")) for url in self.requests)
        self.page.close()


def test_type_see_click_ablate_and_see_the_figures_change(browser, server, minilm):
    tab = Explorer(browser, server)
    tab.analyze(*PAIR)
    record = extract(minilm, *PAIR)
    assert tab.js(f"{APP}.payload.sides.input.tokens") == list(record.tokens)
    assert tab.js(f"{APP}.state.view") == "head"
    n_cells = tab.js("document.querySelectorAll('#pattern-map .ex-cell').length")
    assert n_cells == record.n_layers * record.n_heads

    tab.page.click("#pattern-map .ex-cell[data-layer='2'][data-head='3']")
    tab.page.wait_for_selector("#pattern-map .ex-cell.ex-open[data-layer='2'][data-head='3']")
    assert tab.js(f"[{APP}.state.layer, [...{APP}.state.heads]]") == [2, [3]]
    assert "layer=2" in tab.page.url and "head=3" in tab.page.url

    tab.js(f"{APP}.setLayer(3)")
    tab.page.wait_for_selector("#pattern-map .ex-cell.ex-open[data-layer='3'][data-head='3']")
    intact_pixels = tab.canvas_pixels()
    tab.page.fill("#change-heads", "2.3")
    tab.page.select_option("#mode", "zero")
    tab.page.click("#run-change")
    tab.page.wait_for_selector("#effects[data-state=done]")
    cosine = float(tab.page.inner_text("[data-role=cosine]").split()[1])
    assert 0.9 < cosine < 0.99999
    change_cells = tab.js("Array.from(document.querySelectorAll('[data-role=change-grid] .ex-cell'))"
                          ".map(c => c.textContent !== '')")
    per_layer = np.array(change_cells).reshape(record.n_layers, record.n_heads)
    assert not per_layer[:3].any() and per_layer[3:].any(), "ablating 2.3 changes only later layers' attention"
    assert tab.js("document.querySelector('#pattern-map .ex-cell[data-layer=\"2\"][data-head=\"3\"]')"
                  ".classList.contains('ex-marked')")

    tab.page.check("input[name=showing][value=changed]")
    tab.page.wait_for_selector("#views[data-drawn]")
    assert tab.js(f"{APP}.state.layer") == 3
    assert not np.array_equal(tab.canvas_pixels(), intact_pixels), "layer 3's head view must change"
    assert "show=changed" in tab.page.url and "heads=2.3" in tab.page.url
    ARTIFACTS.mkdir(exist_ok=True)
    tab.page.check("input[name=showing][value=intact]")
    tab.page.wait_for_selector("#views[data-drawn]")
    tab.page.screenshot(path=str(ARTIFACTS / "explorer.png"), full_page=False)
    if os.environ.get("ATTNSCOPE_SCREENSHOTS"):
        shutil.copy(ARTIFACTS / "explorer.png", Path(__file__).parents[1] / "docs" / "img" / "explorer.png")
    tab.check_clean()


def test_the_attention_downloads_as_json_through_a_post(browser, server, minilm):
    tab = Explorer(browser, server)
    tab.analyze("The cat sat on the mat.")
    with tab.page.expect_download() as download:
        tab.page.click("#json-link")
    data = json.loads(Path(download.value.path()).read_text())
    record = extract(minilm, "The cat sat on the mat.")
    assert data["tokens"] == list(record.tokens)
    np.testing.assert_allclose(np.array(data["attention"]["self"]), record.attention, atol=1e-5)
    assert download.value.suggested_filename == "attention-minilm.json"
    tab.check_clean()


def test_the_api_page_works_offline(browser, server):
    """/docs draws the schema with Swagger UI served by attnscope itself (FastAPI's default takes it from a CDN)."""
    page = browser.new_page()
    requests: list[str] = []
    errors: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{server}/docs")
    page.wait_for_selector(".opblock-summary-path[data-path=\"/api/mixing\"]", timeout=30_000)
    assert page.locator(".opblock").count() >= 5  # one block per endpoint
    assert errors == []
    assert requests and all(url.startswith((server, "data:", "blob:")) for url in requests)
    page.close()


def test_the_address_restores_input_view_and_intervention(browser, server):
    fragment = (f"#model=minilm&text={quote(PAIR[0])}&pair={quote(PAIR[1])}&view=model&norms=1"
                "&do=uniform&heads=1.4,4.0&show=changed")
    tab = Explorer(browser, server, fragment)
    tab.page.wait_for_selector("#effects[data-state=done]")
    tab.page.wait_for_selector("#views[data-drawn]")
    assert tab.page.input_value("#text") == PAIR[0] and tab.page.input_value("#pair") == PAIR[1]
    assert tab.js(f"{APP}.state.view") == "model"
    assert tab.js(f"{APP}.state.measure") == "norms" and tab.page.is_checked("#norms")
    assert tab.page.input_value("#mode") == "uniform" and tab.page.input_value("#change-heads") == "1.4, 4.0"
    assert tab.page.is_checked("input[name=showing][value=changed]")
    headers = tab.js("Array.from(document.querySelectorAll('#stats th')).map(th => th.dataset.column)")
    assert "norm_cls" in headers and "cls" not in headers, "the norm toggle also switches the table"
    tab.check_clean()


def test_bad_input_shows_one_line_and_keeps_what_was_there(browser, server):
    tab = Explorer(browser, server)
    tab.analyze(*PAIR)
    tab.page.fill("#text", "   ")
    tab.page.click("#analyze")
    tab.page.wait_for_selector("#status.ex-error")
    assert tab.page.inner_text("#status").startswith("nothing to analyse"), "said in the page, no request sent"
    assert tab.js(f"{APP}.payload.sides.input.tokens[1]") == "i", "the earlier analysis is still shown"
    tab.page.fill("#change-heads", "2.x")
    tab.page.click("#run-change")
    tab.page.wait_for_selector("#status.ex-error")
    assert "cannot read head" in tab.page.inner_text("#status")
    tab.page.fill("#change-heads", "9.0")
    tab.page.click("#run-change")
    tab.page.wait_for_selector("#status:has-text('there is no head 9.0')")
    assert len(tab.errors) == 1 and all("status of 422" in error for error in tab.errors), tab.errors
    tab.errors.clear()  # the browser logs the 422 answer; the page itself raised nothing


def test_the_text_is_a_text_area_and_analyze_with_nothing_says_so(browser, server):
    tab = Explorer(browser, server)
    tab.page.click("#analyze")
    tab.page.wait_for_selector("#status.ex-error")
    assert tab.page.inner_text("#status") == "nothing to analyse: type a text first (a second sentence is optional)"
    assert tab.page.is_hidden("#results") and not any("/api/analyze" in url for url in tab.requests)
    assert tab.js("document.getElementById('text').tagName") == "TEXTAREA"
    tab.page.fill("#text", "I went to the store.\nThen I went home.")
    tab.page.press("#text", "Control+Enter")
    tab.page.wait_for_selector("#views[data-drawn]")
    assert "home" in tab.js(f"{APP}.payload.sides.input.tokens")
    tab.check_clean()
    tab.check_clean()


def test_translator_intervention_shows_translation_and_step_view(browser, server):
    tab = Explorer(browser, server)
    tab.page.select_option("#model", "toy-translator")
    tab.analyze("i can eat apples")
    assert tab.js(f"{APP}.payload.kinds.map(k => k.kind)") == ["encoder", "decoder", "cross"]
    assert tab.page.is_visible("#kind-field")
    tab.page.select_option("#kind", "cross")
    tab.page.select_option("#mode", "skip")
    tab.page.fill("#change-layers", "0, 1")
    tab.page.click("#run-change")
    tab.page.wait_for_selector("#effects[data-state=done]")
    lines = tab.page.inner_text("[data-role=translation]").splitlines()
    assert lines[0] == "intact: ich kann Äpfel essen" and lines[1].startswith("changed:") and lines[1] != "changed: ich kann Äpfel essen"
    tab.page.wait_for_selector("#effects .attnscope-steps[data-drawn]", state="attached")
    assert tab.js("document.querySelectorAll('#effects .attnscope-steps [data-role=strip] .st-step').length") >= 2
    tab.check_clean()
