"""Synthetic generation records of any length and shape, for the step page's tests and benchmark.

Generating 1,024 real tokens takes many minutes on a CPU, so these records are built directly, with the arrays a real
generation keeps (``GenerationRecord``'s docstring) and decoder-like values:

* rows: every row a softmax over its keys of random logits (standard normal x 1.5) plus a sink on the first token
  (+4) and a bump on the last three keys (+2); value norms log-normal;
* attribution (``attribution=True``): random signed head terms, the ``ranks`` largest by ``|term|`` split over the
  step's source tokens, a logit lens of ``lens_k`` tokens per layer drawn from a small vocabulary;
* routes (``routes=True``): ``edges_per_step`` edges per step, the first from the last layer's residual stream at
  the step's position, attention edges with per-head shares that sum to their importance.

Steps, layers, heads and positions are 0-indexed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from attnscope.records.attention import ModelInfo
from attnscope.records.attribution import (
    ATTRIBUTION_HEADS,
    ATTRIBUTION_LOGITS,
    ATTRIBUTION_SOURCES,
    ATTRIBUTION_TOP,
    LENS_IDS,
    LENS_PROBS,
    ROUTE_EDGES,
    ROUTE_HEADS,
    ROUTE_IMPORTANCE,
)
from attnscope.records.generation import GenerationRecord, packed_length, row_offset

CANDIDATES = 10
FLOAT16 = 2.0**-11  # relative rounding of a float16
LENS_VOCABULARY = 400  # distinct lens tokens: shipped once each, indexed per step


def synthetic_generation(new_tokens: int, *, layers: int = 30, heads: int = 9, prompt: int = 64, seed: int = 0,
                         attribution: bool = False, routes: bool = False, ranks: int = 10, lens_k: int = 3,
                         edges_per_step: int = 60) -> GenerationRecord:
    """A GenerationRecord of ``prompt + new_tokens`` tokens (SmolLM2's 30 x 9 heads by default; see the module
    docstring)."""
    rng = np.random.default_rng(seed)
    n = prompt + new_tokens
    arrays = {"rows": _rows(rng, layers, heads, n),
              "value_norms": rng.lognormal(0.0, 0.5, (layers, heads, n)).astype(np.float32),
              "token_ids": np.arange(n), "special_mask": np.zeros(n, bool), "word_ids": np.arange(n)}
    probs = np.sort(rng.dirichlet(np.ones(CANDIDATES), size=new_tokens).astype(np.float32), axis=1)[:, ::-1]
    arrays.update(candidate_ids=np.tile(np.arange(CANDIDATES), (new_tokens, 1)), candidate_probs=probs,
                  chosen_probs=probs[:, 0].copy())
    lens_tokens: tuple[tuple[tuple[str, ...], ...], ...] = ()
    if attribution:
        more, lens_tokens = _attribution(rng, layers, heads, prompt, new_tokens, ranks, lens_k)
        arrays.update(more)
    if routes:
        arrays.update(_routes(rng, layers, heads, prompt, new_tokens, edges_per_step))
    model = ModelInfo("synthetic", "llama", layers, heads, max(1, heads // 3), 64, True, False, 0.125)
    return GenerationRecord(model=model, tokens=tuple(f" w{i % 997}" for i in range(n)), prompt_length=prompt,
                            arrays=arrays, lens_tokens=lens_tokens, prompt="synthetic", settings={"do_sample": False},
                            candidate_tokens=tuple(tuple(f" c{k}" for k in range(CANDIDATES)) for _ in range(new_tokens)))


def _rows(rng: np.random.Generator, layers: int, heads: int, n: int) -> np.ndarray:
    """``[layer, head, packed]``: every position's row over the keys up to itself, back to back."""
    rows = np.zeros((layers, heads, packed_length(n)), dtype=np.float32)
    for position in range(n):
        logits = rng.standard_normal((layers, heads, position + 1), dtype=np.float32) * 1.5
        logits[..., 0] += 4.0  # the attention sink
        logits[..., -3:] += 2.0  # the last few tokens
        weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
        rows[..., row_offset(position) : row_offset(position + 1)] = weights / weights.sum(axis=-1, keepdims=True)
    return rows


def _attribution(rng: np.random.Generator, layers: int, heads: int, prompt: int, steps: int, ranks: int,
                 lens_k: int) -> tuple[dict[str, np.ndarray], tuple[tuple[tuple[str, ...], ...], ...]]:
    """The arrays ``StepAttribution`` keeps, and the lens's tokens ``[step][layer][k]``."""
    terms = rng.standard_normal((steps, layers, heads)).astype(np.float32)  # [step, layer, head]
    ranks = min(ranks, layers * heads)  # a small model has fewer heads than ranks kept
    order = np.argsort(-np.abs(terms).reshape(steps, -1), axis=1)[:, :ranks]
    top = np.stack(np.unravel_index(order, (layers, heads)), axis=-1)  # [step, rank, 2]
    sources = np.zeros((steps, ranks, prompt + steps - 1), dtype=np.float32)
    for step in range(steps):
        seen = prompt + step  # the step's query reads positions 0..seen-1
        split = rng.dirichlet(np.ones(seen), size=ranks).astype(np.float32)
        sources[step, :, :seen] = split * terms[step, top[step, :, 0], top[step, :, 1]][:, None]
    lens_ids = rng.integers(0, LENS_VOCABULARY, (steps, layers, lens_k))
    lens_probs = np.sort(rng.uniform(0, 1, (steps, layers, lens_k)).astype(np.float32), axis=-1)[..., ::-1] / lens_k
    arrays = {ATTRIBUTION_HEADS: terms, ATTRIBUTION_LOGITS: terms.sum(axis=(1, 2)) + 10.0, ATTRIBUTION_TOP: top,
              ATTRIBUTION_SOURCES: sources, LENS_IDS: lens_ids, LENS_PROBS: np.ascontiguousarray(lens_probs)}
    tokens = tuple(tuple(tuple(f" t{i}" for i in layer) for layer in step) for step in lens_ids.tolist())
    return arrays, tokens


def _routes(rng: np.random.Generator, layers: int, heads: int, prompt: int, steps: int,
            edges_per_step: int) -> dict[str, np.ndarray]:
    """``route_edges`` ``[edge, 8]`` (step, source layer/position/kind, target layer/position/kind, via), importance,
    per-head shares (attention edges only)."""
    edges, importance, shares = [], [], []
    for step in range(steps):
        position = prompt - 1 + step  # the position that chose the step's token
        for e in range(edges_per_step):
            via = 0 if e == 0 else int(rng.integers(0, 3))  # 0 attention, 1 residual, 2 ffn
            layer = layers - 1 if e == 0 else int(rng.integers(0, layers))
            target = (layers, position, 0) if e == 0 else (layer, int(rng.integers(0, position + 1)), 1)
            source = (layer, int(rng.integers(0, target[1] + 1)) if via == 0 else target[1], 0)
            weight = float(rng.uniform(0.04, 1.0))
            edges.append([step, *source, *target, via])
            importance.append(weight)
            shares.append(rng.dirichlet(np.ones(heads)) * weight if via == 0 else np.zeros(heads))
    return {ROUTE_EDGES: np.array(edges, dtype=np.int64).reshape(-1, 8),
            ROUTE_IMPORTANCE: np.array(importance, dtype=np.float32),
            ROUTE_HEADS: np.array(shares, dtype=np.float32).reshape(-1, heads)}


def shipped_sources(got: np.ndarray, want: np.ndarray) -> bool:
    """``got`` is the source terms ``want`` ``[..., source_pos]`` as a step page ships them: each to float16, except
    terms under 1/2048 of the largest |term| of their row, which may be 0 (the page draws them unshaded either way)."""
    floor = np.abs(want).max(axis=-1, keepdims=True) * 2.0**-11
    # float16 rounding may move a term past the floor (relatively, or by a step of 6e-8 under float16's normal range)
    dropped = (got == 0) & (np.abs(want) <= floor * (1 + 4 * FLOAT16) + 6e-8)
    return bool(np.all((np.abs(got - want) <= np.abs(want) * FLOAT16 + 1e-7) | dropped))


# ---- the page in Chromium (Playwright) ----------------------------------------------------------------------
PAGE_ID = "attnscope-steps"  # the element id of a saved step page (StepsView.to_html)


def opened_ms(page: Any, path: Path) -> float:
    """Open the saved step page ``path``: ms from navigation until its first step has drawn (the page's
    ``attnscope:<id>:drawn`` performance mark)."""
    page.goto(path.as_uri())
    # a function, not an expression string: the page's Content-Security-Policy forbids eval
    page.wait_for_function(f"() => document.getElementById('{PAGE_ID}').dataset.drawn", timeout=120_000)
    return float(page.evaluate(f"() => performance.getEntriesByName('attnscope:{PAGE_ID}:drawn')[0].startTime"))


def click_ms(page: Any, step: int) -> float:
    """Click the generated token of ``step`` in the strip: ms until the step has drawn (at once, or once the blocks it
    draws are decoded) and the browser has laid out and painted it (the next animation frame)."""
    return float(page.evaluate(f"""async () => {{
        const root = document.getElementById('{PAGE_ID}');
        const cell = root.querySelector("[data-role=strip] .st-step[data-step='{step}']");
        const drawn = () => root.dataset.step === '{step}';
        const start = performance.now();
        cell.click();
        if (!drawn()) await new Promise((done, fail) => {{
          const watch = new MutationObserver(() => {{ if (drawn()) {{ watch.disconnect(); done(); }} }});
          watch.observe(root, {{ attributes: true, attributeFilter: ['data-drawn'] }});
          setTimeout(() => fail(new Error('step {step} was not drawn')), 30000);
        }});
        await new Promise((done) => requestAnimationFrame(() => setTimeout(done)));
        return performance.now() - start;
    }}"""))
