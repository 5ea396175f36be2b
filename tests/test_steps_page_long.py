"""A step page of 1,024 generated tokens with attribution and routes: its payload packs them (no JSON numbers), holds
exactly what the record keeps (codes exact, numbers to float16), follows the schema, and in Debian's Chromium the page
opens and draws each clicked step: its tokens, its ranked heads, its lens and its route, as the record has them.

The record is synthetic (``tests/long_steps.py``: a real generation of 1,024 tokens takes many minutes on a CPU) in a
small model's shape, through the same payload function as ``generate --html``. The page's timings are
``benchmarks/steps_page.py``'s (``page_1024_open_ms``, ``page_step_click_ms``), not asserted here. Steps, layers and
heads are 0-indexed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from attnscope.present.payload import unpack
from attnscope.present.steps import StepsView, generation_payload, generation_routes, joined_blocks, steps_schema
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
