"""A step page of 1,024 generated tokens with attribution and routes: its payload packs them (no JSON numbers), holds
exactly what the record keeps (codes exact, numbers to float16), follows the schema, and in Debian's Chromium the page
opens and draws each clicked step: its tokens, its ranked heads, its lens and its route, as the record has them.

The record is synthetic (``tests/long_steps.py``: a real generation of 1,024 tokens takes many minutes on a CPU) in a
small model's shape, through the same payload function as ``generate --html``. The page's timings are
``benchmarks/steps_page.py``'s (``page_1024_open_ms``, ``page_step_click_ms``), not asserted here. Steps, layers and
heads are 0-indexed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from attnscope.present.payload import unpack
from attnscope.present.steps import (
    StepsView,
    decoded_rows,
    generation_payload,
    generation_routes,
    joined_blocks,
    steps_schema,
)
from attnscope.records.attribution import (
    ATTRIBUTION_HEADS,
    ATTRIBUTION_LOGITS,
    ATTRIBUTION_SOURCES,
    ATTRIBUTION_TOP,
    LENS_PROBS,
    ROUTE_EDGES,
    ROUTE_HEADS,
    ROUTE_IMPORTANCE,
)
from tests.long_steps import FLOAT16, click_ms, opened_ms, shipped_sources, synthetic_generation

jsonschema = pytest.importorskip("jsonschema")
ARTIFACTS = Path(__file__).parent / "artifacts"
STEPS = 1024
LAYERS, HEADS, PROMPT, RANKS, EDGES = 2, 2, 6, 3, 10
CLICKED = (1023, 0, 1, 511, 700, 1022, 37)


@pytest.fixture(scope="module")
def record():
    return synthetic_generation(STEPS, layers=LAYERS, heads=HEADS, prompt=PROMPT, attribution=True, routes=True,
                                ranks=RANKS, edges_per_step=EDGES)


@pytest.fixture(scope="module")
def payload(record):
    return generation_payload(record)


def close_to_float16(got: np.ndarray, want: np.ndarray) -> bool:
    return bool(np.all(np.abs(np.asarray(got) - want) <= np.abs(want) * FLOAT16 + 1e-7))


def loose_numbers(part, where: str = "") -> list[str]:
    """Where ``part`` holds a JSON number outside a packed array's ``shape`` (and a block's size of steps)."""
    if isinstance(part, dict):
        return [found for key, value in part.items() if key not in ("shape", "block")
                for found in loose_numbers(value, f"{where}.{key}")]
    if isinstance(part, list):
        return [found for index, value in enumerate(part) for found in loose_numbers(value, f"{where}[{index}]")]
    return [where] if isinstance(part, (int, float)) and not isinstance(part, bool) else []


def step_edges(record, step: int) -> np.ndarray:
    """The record's edge rows of ``step`` (indices into route_edges)."""
    return np.flatnonzero(record.arrays[ROUTE_EDGES][:, 0] == step)


def test_the_payload_packs_routes_and_attribution_and_follows_the_schema(record, payload):
    jsonschema.validate(payload, steps_schema())
    attribution, routes = payload["attribution"], payload["routes"]
    assert loose_numbers(attribution) == [] and loose_numbers(routes) == [], "numbers only in packed arrays"
    arrays = record.arrays
    np.testing.assert_array_equal(unpack(attribution["heads"]), arrays[ATTRIBUTION_TOP])
    top = arrays[ATTRIBUTION_TOP]
    want_terms = arrays[ATTRIBUTION_HEADS][np.arange(STEPS)[:, None], top[..., 0], top[..., 1]]
    assert close_to_float16(unpack(attribution["terms"]), want_terms)
    assert close_to_float16(unpack(attribution["logits"]), arrays[ATTRIBUTION_LOGITS])
    assert shipped_sources(joined_blocks(attribution["sources"]), arrays[ATTRIBUTION_SOURCES])
    assert close_to_float16(unpack(attribution["lens"]["probs"]), arrays[LENS_PROBS])
    vocabulary = attribution["lens"]["vocabulary"]
    assert len(vocabulary) == len(set(vocabulary)), "each lens token once"
    indices = unpack(attribution["lens"]["tokens"]).astype(int)
    assert [[[vocabulary[i] for i in layer] for layer in step] for step in indices.tolist()] == \
        [[list(layer) for layer in step] for step in record.lens_tokens]
    np.testing.assert_array_equal(joined_blocks(routes["edges"]), arrays[ROUTE_EDGES])  # already in step order
    assert close_to_float16(joined_blocks(routes["importance"]), arrays[ROUTE_IMPORTANCE])
    assert close_to_float16(joined_blocks(routes["heads"]), arrays[ROUTE_HEADS])


def test_the_routes_are_put_in_step_order(record):
    """A record whose edges are not grouped by step still ships each step's edges as one run of rows."""
    arrays = dict(record.arrays)
    shuffled = np.random.default_rng(1).permutation(len(arrays[ROUTE_EDGES]))
    for name in (ROUTE_EDGES, ROUTE_IMPORTANCE, ROUTE_HEADS):
        arrays[name] = arrays[name][shuffled]
    routes = generation_routes(type(record)(**{**vars(record), "arrays": arrays}))
    codes = joined_blocks(routes["edges"]).astype(int)
    assert np.all(np.diff(codes[:, 0]) >= 0)
    for step in (0, 511, STEPS - 1):
        assert sorted(map(tuple, codes[codes[:, 0] == step])) == sorted(map(tuple, record.arrays[ROUTE_EDGES][
            step_edges(record, step)]))


def drawn_step(page) -> dict:
    """What the page shows of the current step: chosen token, text keys, head bars, lens top tokens of the last
    layer, route edges (via, importance, source, target)."""
    return page.evaluate("""() => {
        const all = (selector, read) => Array.from(document.querySelectorAll(selector), read);
        return {
          chosen: document.querySelector('[data-role=chosen]').textContent,
          keys: all('[data-role=attention] .st-key', (k) => k.textContent),
          heads: all('[data-role=head-bar]', (b) => [+b.dataset.layer, +b.dataset.head]),
          lens: all('[data-role=lens] tr', (r) => r.lastElementChild.textContent).slice(1),
          edges: all('[data-role=route] line[data-role=edge]', (l) => [l.dataset.via, Number(l.dataset.importance)]),
        };
    }""")


def test_a_page_of_1024_steps_opens_and_draws_each_clicked_step(browser, record, payload):
    ARTIFACTS.mkdir(exist_ok=True)
    path = StepsView(payload).save(ARTIFACTS / "steps_1024.html")
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    errors: list[str] = []
    page.on("console", lambda message: message.type == "error" and errors.append(message.text))
    page.on("pageerror", lambda error: errors.append(str(error)))
    opened_ms(page, path)
    vias = ("attention", "residual", "ffn")
    for step in CLICKED:
        click_ms(page, step)
        shown = drawn_step(page)
        assert shown["chosen"] == record.tokens[PROMPT + step]
        assert shown["keys"] == list(record.tokens[: PROMPT + step])
        assert shown["heads"] == record.arrays[ATTRIBUTION_TOP][step].tolist()
        assert shown["lens"] == [record.lens_tokens[step][-1][k] for k in range(len(shown["lens"]))]
        kept = step_edges(record, step)
        assert [via for via, _ in shown["edges"]] == [vias[v] for v in record.arrays[ROUTE_EDGES][kept, 7]]
        assert close_to_float16(np.array([w for _, w in shown["edges"]]), record.arrays[ROUTE_IMPORTANCE][kept])
    assert errors == []
    page.close()


# ---- what a click draws, number by number, against the payload -----------------------------------------------
CHECKED = (1023, 17, 700)  # steps in three blocks of 16, none of them decoded at open (block 0)
ROUTE_LABEL_ALL = 80  # routes.js LABEL_ALL: up to this many positions a route labels every token
COLOUR = re.compile(r"rgba?\((\d+), (\d+), (\d+)(?:, ([\d.e-]+))?\)")


def shade(css: str) -> tuple[tuple[int, int, int], float]:
    """A drawn background (rgb(...) at alpha 1, rgba(...) below) as its colour and alpha."""
    found = COLOUR.fullmatch(css)
    assert found, css
    return tuple(int(c) for c in found.groups()[:3]), float(found.group(4) or 1.0)  # type: ignore[return-value]


def signed(value: float, digits: int) -> str:
    """A term as the page writes it (steps.js ``signed``)."""
    return ("+" if value >= 0 else "\u2212") + f"{abs(value):.{digits}f}"


def drawn_numbers(page) -> dict:
    """Everything the page draws of the current step's attention, attribution and route, as text and styles."""
    return page.evaluate("""() => {
        const all = (selector, read) => Array.from(document.querySelectorAll(selector), read);
        return {
          keys: all('[data-role=attention] .st-key', (k) => k.style.background),
          title: document.querySelector('[data-role=attribution] .st-note').textContent,
          bars: all('[data-role=head-bar]', (b) => [+b.dataset.layer, +b.dataset.head, b.querySelector('.st-term').textContent,
            b.querySelector('.st-sbar').classList.contains('st-up')]),
          sources: all('[data-role=sources] .st-key', (k) => k.style.background),
          source_head: [+document.querySelector('[data-role=sources]').dataset.layer,
            +document.querySelector('[data-role=sources]').dataset.head],
          lens: all('[data-role=lens] tr', (r) => Array.from(r.querySelectorAll('td'),
            (c) => [c.textContent, c.style.background])).slice(1),
          edges: all('[data-role=route] line[data-role=edge]', (l) => [l.dataset.head === undefined ? -1 : +l.dataset.head,
            l.querySelector('title').textContent]),
          labels: all('[data-role=route] .rt-token', (t) => t.firstChild.textContent),
        };
    }""")


def hover_title(page, box: str, key: int) -> str:
    """The hover text of token ``key`` in the box ``box`` (written when the pointer reaches it)."""
    locator = page.locator(f"[data-role={box}] .st-key[data-key='{key}']")
    locator.dispatch_event("mouseover")
    return locator.get_attribute("title") or ""


def expected_edge_titles(payload: dict, step: int) -> list[tuple[int, str]]:
    """The payload's edges of ``step`` as routes.js titles them, with each attention edge's top head (-1 off them)."""
    codes, importance, heads = (joined_blocks(payload["routes"][name]) for name in ("edges", "importance", "heads"))
    kinds, vias, text = payload["routes"]["node_kinds"], payload["routes"]["vias"], payload["text"]
    where = lambda layer, position, kind: f"{kinds[kind]} L{layer} @{position} {json.dumps(text[position])}"
    titles = []
    for e in np.flatnonzero(codes[:, 0] == step):
        c = codes[e].astype(int)
        top = int(np.argmax(heads[e])) if vias[c[7]] == "attention" else -1
        head = f"; top head {top} ({heads[e, top]:.3f} of it)" if top >= 0 else ""
        title = f"{vias[c[7]]} edge {where(*c[1:4])} \u2192 {where(*c[4:7])}: importance {importance[e]:.3f}{head}"
        titles.append((top, title))
    return titles


def expected_labels(payload: dict, step: int) -> list[str]:
    """The tokens labelled under the route of ``step``: every one up to its position in a short text, else those its
    edges touch and its own, with their positions."""
    position, text = payload["first_step"] - 1 + step, payload["text"]
    if position < ROUTE_LABEL_ALL:
        return [json.dumps(token) for token in text[: position + 1]]
    codes = joined_blocks(payload["routes"]["edges"]).astype(int)
    touched = {position} | {int(p) for p in codes[codes[:, 0] == step][:, [2, 5]].ravel()}
    return [f"{p} {json.dumps(text[p])}" for p in sorted(touched)]


def test_clicked_steps_draw_their_route_and_attribution_as_the_payload_has_them(browser, payload):
    """Three steps of the 1,024-step page, each in a block the page decodes on the click: the attention shades, the
    ranked heads' terms, every token's share of the chosen head (and of another head clicked), the logit lens and each
    edge of the route, as the Python payload has them (decoded here by numpy, not by the page's JavaScript)."""
    path = StepsView(payload).save(ARTIFACTS / "steps_1024_numbers.html")
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    opened_ms(page, path)
    attribution = payload["attribution"]
    heads, terms, logits = (unpack(attribution[name]) for name in ("heads", "terms", "logits"))
    sources = joined_blocks(attribution["sources"])  # [step, rank, source_pos]
    lens_tokens, lens_probs = unpack(attribution["lens"]["tokens"]).astype(int), unpack(attribution["lens"]["probs"])
    rows = decoded_rows(payload)
    for step in CHECKED:
        click_ms(page, step)
        n = PROMPT + step
        drawn = drawn_numbers(page)
        mean = rows(step)[2]  # [keys]: the mean of all layers and heads, the row shown at first
        assert [alpha for _, alpha in map(shade, drawn["keys"])] == pytest.approx(mean / mean.max(), abs=0.005)
        assert f"({logits[step]:.2f}, the sum of every head" in drawn["title"]
        assert drawn["bars"] == [[int(layer), int(head), signed(float(term), 3), bool(term >= 0)]
                                 for (layer, head), term in zip(heads[step], terms[step])]
        for rank in (0, 2):
            if rank:
                page.click(f"[data-role=head-bar][data-rank='{rank}']")
                page.wait_for_function(f"() => document.querySelector('[data-role=head-bar][data-rank=\"{rank}\"]')"
                                       ".classList.contains('st-on')")
                drawn = drawn_numbers(page)
            assert drawn["source_head"] == heads[step, rank].astype(int).tolist()
            share = sources[step, rank, :n]
            top = np.abs(share).max()
            colours, alphas = zip(*map(shade, drawn["sources"]))
            assert list(alphas) == pytest.approx(np.minimum(1, np.abs(share) / top), abs=0.005)
            assert all(colour == ((30, 140, 70) if term >= 0 else (150, 40, 160))
                       for colour, alpha, term in zip(colours, alphas, share) if alpha > 0)
            strongest = int(np.argmax(np.abs(share)))
            assert hover_title(page, "sources", strongest) == \
                f"key {strongest} {json.dumps(payload['text'][strongest])}: {signed(float(share[strongest]), 4)}"
        vocabulary = attribution["lens"]["vocabulary"]
        assert [[token for token, _ in row] for row in drawn["lens"]] == \
            [[vocabulary[i] for i in lens_tokens[step, :, r]] for r in range(lens_tokens.shape[2])]
        assert [[shade(css)[1] for _, css in row] for row in drawn["lens"]] == \
            [pytest.approx(np.minimum(1, lens_probs[step, :, r]), abs=0.005) for r in range(lens_probs.shape[2])]
        assert [tuple(edge) for edge in drawn["edges"]] == expected_edge_titles(payload, step)
        assert drawn["labels"] == expected_labels(payload, step)
    assert errors == []
    page.close()
