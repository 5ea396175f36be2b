"""The step view: a decoder's output one token at a time, for any decoder (schema ``steps.schema.json``).

One payload and one page (``static/steps.js``) for both kinds of decoding attnscope records:

* a causal LM generating (:class:`attnscope.GenerationRecord`): each step's query attends to the
  prompt and the text so far (self-attention, ``kind = "self"``);
* an encoder-decoder translating (the toy translator's :class:`~attnscope.records.decoding.DecodeTrace`):
  each step's query attends to the source (cross-attention, ``kind = "cross"``).

Each step ``s`` (0-indexed) chose ``text[first_step + s]`` and its query saw ``keys[s]`` keys:
``text[:keys[s]]`` (self) or the whole ``source`` (cross). The attention of every step is shipped
as rows placed back to back on one axis (step ``s`` at ``offsets(s) = keys[0] + ... + keys[s-1]``),
quantized per row: ``value = byte / levels * row_max``, with ``row_max`` (float16, per row) the
row's largest weight, so a row keeps its levels however long the text (at most ``row_max / (2 levels)``
plus float16 rounding of ``row_max`` off). Three sets of rows:

* ``heads`` ``[layer, head, key]`` every head's row, 16 levels (``HEAD_LEVELS``);
* ``layers`` ``[layer, key]`` the mean over the layer's heads, 16 levels;
* ``all`` ``[1, key]`` the mean over all layers and heads, 256 levels (``MEAN_LEVELS``).

A model with learned attention sinks (gpt-oss) adds ``sink_mass`` float16 ``[layer, head, step]``: the
share of each step's softmax given to the learned sink logit, so that the row over the tokens sums to 1
minus it; the page shows it beside the tokens as a bar of its own ("learned sink"). A generation under a KV
budget adds ``streamed_heads`` ``[[layer, query head], ...]``, the heads whose KV head kept only its sink and window;
the page names them in the chosen layer's head menu.

When the record has value norms, ``weighted`` holds the norm-weighted means ``alpha * ||v W_O||``
(Kobayashi et al. 2020) over heads and over everything, and per key the norms ``||v_k W_O^h||``
``[layer, head, position]`` (float16): the page multiplies the ONE head row it shows by them,
rather than shipping a second copy of every head's rows. 500 generated tokens of SmolLM2 (30
layers x 9 heads) are ~43 M weights per copy: one byte each, deflated (rows are mostly near zero,
and 16 levels leave deflate little to keep), not 43 M JSON floats.

A generation made with its steps' attribution (``--attribute``) also ships ``attribution``: per step, the heads with the
largest direct-logit-attribution terms of the chosen token (signed), their terms split over the source tokens and the
logit lens (each layer's top tokens); the page draws them as ranked signed bars, the text shaded by the clicked head's
shares, and a layers x tokens strip. Without it ``attribution`` is null and nothing more is computed or shipped.

A generation made with its steps' routes (``--routes``) also ships ``routes``: the kept edges of every step's route (of
the position that chose the token) as the record keeps them, one row per edge (``static/routes.js`` draws a step's
edges under the view when its step is shown). Without it ``routes`` is null.

A generation also ships ``sentences``: the sentence panel (``present/sentence_panel.py``, ``static/sentences.js``):
the prompt and the generated text split into sentences, the attention averaged to sentence x sentence from the kept
rows (per head, per layer and overall), each sentence's attention from later sentences and the receiver heads
(Bogdan et al. 2025); clicking a sentence marks its tokens in the text. Null for a decoding (cross-attention) and for a
text of fewer than two sentences or more than the panel draws.

Attribution and routes are packed arrays like the rows (float16 numbers, uint16 codes and indices, deflated), never
JSON numbers: 1,024 steps of SmolLM2 with both are a few MB, not ten times that. Strings (the lens's tokens) are
shipped once each in a ``vocabulary`` and indexed by uint16. Their per-step arrays that grow with the text (each
head's terms over the source tokens, the routes' edges) come in blocks of ``STEP_BLOCK`` steps packed one by one
(:class:`StepBlocks`): the page inflates a block when it first draws one of its steps, so opening a page of 1,024 steps
decodes the first step's block, not every step's. A source term under ``SOURCE_FLOOR`` (1/2048) of its head's largest
at that step is shipped as 0: the page shades each token by its share of that largest to 3 decimals, so such a token
is drawn unshaded either way (real heads put most of their term on a few tokens: in a 96-token SmolLM2 generation
64-81% of the terms per step are under it, and the attribution's bytes fall from 0.71 to 0.31 MB).

>>> steps_view(gen).save("steps.html")         # a GenerationRecord   # doctest: +SKIP
>>> steps_view(trace).save("steps.html")       # a DecodeTrace        # doctest: +SKIP
"""

from __future__ import annotations

import html
import json
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from string import Template
from typing import TYPE_CHECKING, Any, Literal, NotRequired, TypedDict, cast

import numpy as np

from ..errors import AttnscopeError
from ..records.attribution import (
    ATTRIBUTION_HEADS,
    ATTRIBUTION_LOGITS,
    ATTRIBUTION_SOURCES,
    ATTRIBUTION_TOP,
    LENS_PROBS,
    ROUTE_EDGES,
    ROUTE_HEADS,
    ROUTE_IMPORTANCE,
    ROUTE_NODE_KINDS,
    ROUTE_VIAS,
)
from ..records.decoding import DecodeTrace, Step
from ..records.generation import Candidate, GenerationRecord
from .html import CONTENT_POLICY, DOCUMENT, static_text, write_page
from .payload import PackedArray, pack_float16, pack_uint16, to_json, unpack
from .rows import RowPacker, Rows, row_values

if TYPE_CHECKING:
    from .sentence_panel import SentencePanel

STEPS_FORMAT = "attnscope.steps"
STEPS_VERSION = 3  # 3: sources and routes in blocks of steps, tiny source terms 0; 2: attribution and routes packed
UINT16_MAX = 65535
# Shades per row: every head's and layer's row gets 16 (0..15; finer steps cannot be seen and cost
# bytes: every head of 500 steps is ~43 M weights); the one mean of all gets 256.
HEAD_LEVELS = 15
MEAN_LEVELS = 255
# Steps per packed block of the arrays that grow with the text (sources, routes): the page decodes the block of the
# step it draws (16 steps of a 1,000-token text: a few hundred kB inflated, a few ms) instead of all 1,024 at open.
STEP_BLOCK = 16
# A source term under this share of its (step, rank)'s largest |term| is shipped as 0: the page shades a token by
# |term| / largest to 3 decimals, and under 1/2048 (< 0.0005) that is 0.000 whatever the term.
SOURCE_FLOOR = 2.0**-11
# decode.js: unpacking of packed arrays (AttnscopeViews.unpack); routes.js: the drawing of one route (AttnscopeRoutes)
# sentences.js: the sentence panel (AttnscopeSentences)
STEPS_SCRIPTS = ("decode.js", "routes.js", "sentences.js", "steps.js")
STEPS_STYLES = ("steps.css", "sentences.css")


class StepCandidate(TypedDict):
    token: str
    probability: float
    logit: NotRequired[float]


class StepInfo(TypedDict):
    """One step: the token chosen, the probability the model gave it (None if not known), the top
    next tokens best first, and for beam search the live hypotheses (text, log-probability)."""

    chosen: str
    probability: float | None
    candidates: list[StepCandidate]
    beams: NotRequired[list[tuple[str, float]]]


class AttentionRows(TypedDict):
    heads: Rows  # [layer, head, ...]
    layers: Rows  # [layer, ...]: mean over the layer's heads
    all: Rows  # [1, ...]: mean over all layers and heads


class WeightedRows(TypedDict):
    """Norm-weighted: the means as rows; a head's row is its attention row times ``value_norms[layer, head, key]``."""

    value_norms: PackedArray  # float16 [layer, head, key position]
    layers: Rows
    all: Rows


class LensStrip(TypedDict):
    """The logit lens of every step: ``tokens`` uint16 ``[step, layer, k]`` indices into ``vocabulary`` (each
    distinct token once) and their probabilities ``probs`` float16 ``[step, layer, k]``, best first (the last
    layer's are the model's own)."""

    vocabulary: list[str]
    tokens: PackedArray
    probs: PackedArray


class StepBlocks(TypedDict):
    """A per-step array in blocks of ``block`` consecutive steps, each packed on its own: ``blocks[b]`` holds the rows
    of steps ``b * block`` to ``b * block + block - 1`` (the page inflates a block when it first draws one of its
    steps)."""

    block: int
    blocks: list[PackedArray]


class StepAttribution(TypedDict):
    """Direct logit attribution of each step's chosen token (a generation made with ``--attribute``).

    ``logits`` float16 ``[step]``: the chosen token's logit (the sum of every term); ``heads`` uint16
    ``[step, rank, 2]``: (layer, head) of the heads with the largest ``|term|``, largest first; ``terms`` float16
    ``[step, rank]``: their signed terms; ``sources`` float16 ``[step, rank, source_pos]`` in blocks of steps (each
    block ``[block steps, rank, keys of its last step]``): those terms split over the tokens each head read (0 past the
    step's last key, and 0 under ``SOURCE_FLOOR`` of the step and rank's largest); ``lens``: the logit lens of a
    generation made with ``--lens`` (None without)."""

    logits: PackedArray
    heads: PackedArray
    terms: PackedArray
    sources: StepBlocks
    lens: LensStrip | None


class RouteSteps(TypedDict):
    """Every step's route (a generation made with ``--routes``), one row per kept edge, grouped by step in step
    order and in blocks of steps (block ``b`` holds the edges of its steps): ``edges`` uint16 ``[edge, 8]`` (step,
    source layer, position and kind, target layer, position and kind, via; kinds index ``node_kinds``, vias
    ``vias``), ``importance`` float16 ``[edge]`` and ``heads`` float16 ``[edge, head]`` (an attention edge's per-head
    split; 0 on the other edges)."""

    node_kinds: list[str]
    vias: list[str]
    edges: StepBlocks
    importance: StepBlocks
    heads: StepBlocks


class StepsPayload(TypedDict):  # sink_mass: float16 [layer, head, step], models with learned sinks only
    format: str
    version: int
    title: str
    model: str
    method: str
    changes: str
    kind: Literal["self", "cross"]
    text: list[str]
    first_step: int
    source: list[str]
    keys: list[int]
    n_layers: int
    n_heads: int
    steps: list[StepInfo]
    attention: AttentionRows
    weighted: WeightedRows | None
    attribution: StepAttribution | None
    routes: RouteSteps | None
    sentences: SentencePanel | None
    notes: list[str]
    sink_mass: NotRequired[PackedArray]
    streamed_heads: NotRequired[list[list[int]]]  # [[layer, query head], ...]: a KV budget's streamed heads


RowsOf = Callable[[int], np.ndarray]
"""Step -> that step's attention ``[layer, head, keys_s]`` (computed when packed: rows of a long
generation, norm-weighted, need not all be in memory at once)."""


def build_steps_payload(*, title: str, model: str, method: str, kind: Literal["self", "cross"],
                        text: Sequence[str], first_step: int, steps: list[StepInfo], rows: RowsOf,
                        value_norms: np.ndarray | None = None, source: Sequence[str] = (), changes: str = "",
                        notes: Sequence[str] = (), attribution: StepAttribution | None = None,
                        compress: bool = True, sink_mass: np.ndarray | None = None,
                        routes: RouteSteps | None = None, sentences: SentencePanel | None = None,
                        streamed_heads: Sequence[tuple[int, int]] | None = None) -> StepsPayload:
    """The step view's payload (see the module docstring).

    ``rows(s)``: step ``s``'s attention ``[layer, head, keys_s]``; ``value_norms`` ``[layer, head, key]``
    ``||v_k W_O^h||`` of every key position (or None: no norm-weighted view). ``text``: the decoder's
    tokens; step ``s`` chose ``text[first_step + s]``. ``attribution``: the chosen tokens' direct logit
    attribution and logit lens (:func:`generation_attribution`), or None. ``sink_mass``: ``[layer, head, step]``
    for a model with learned sinks (each step's row sums to 1 minus it), else None. ``routes``: each step's route
    (:func:`generation_routes`), or None. ``sentences``: the sentence panel of the text
    (:func:`~attnscope.present.sentence_panel.generation_sentences`), or None. ``streamed_heads``: ``(layer, query
    head)`` pairs a KV budget streamed (:func:`streamed_query_heads`), or None without a budget.
    """
    if not steps:
        raise AttnscopeError("nothing was decoded: the step view needs at least one step")
    first = rows(0)
    keys = [int(first.shape[-1])] + [int(rows(step).shape[-1]) for step in range(1, len(steps))]
    heads, layers, overall = pack_attention_rows(rows, keys)
    weighted = None
    if value_norms is not None:
        _, weighted_layers, weighted_all = pack_attention_rows(
            lambda step: rows(step) * value_norms[..., : keys[step]], keys, heads=False)
        weighted = WeightedRows(value_norms=pack_float16(value_norms, compress),
                                layers=weighted_layers.packed(compress), all=weighted_all.packed(compress))
    payload = StepsPayload(
        format=STEPS_FORMAT, version=STEPS_VERSION, title=title, model=model, method=method, changes=changes,
        kind=kind, text=list(text), first_step=first_step, source=list(source), keys=keys,
        n_layers=int(first.shape[0]), n_heads=int(first.shape[1]), steps=steps,
        attention=AttentionRows(heads=heads.packed(compress), layers=layers.packed(compress),
                                all=overall.packed(compress)),
        weighted=weighted, attribution=attribution, routes=routes, sentences=sentences, notes=list(notes))
    if sink_mass is not None:
        payload["sink_mass"] = pack_float16(sink_mass, compress)
    if streamed_heads is not None:
        payload["streamed_heads"] = [[int(layer), int(head)] for layer, head in streamed_heads]
    return payload


def pack_attention_rows(rows: RowsOf, keys: Sequence[int], *, heads: bool = True) -> tuple[RowPacker, ...]:
    """Every step's ``[layer, head, keys_s]`` -> (every head's rows, each layer's mean, the mean of all),
    in one pass over the steps; ``heads=False`` leaves the first empty."""
    first = rows(0)
    n_layers, n_heads = first.shape[:2]
    packers = (RowPacker((n_layers, n_heads) if heads else (0, 0), keys, HEAD_LEVELS),
               RowPacker((n_layers,), keys, HEAD_LEVELS), RowPacker((1,), keys, MEAN_LEVELS))
    for step in range(len(keys)):
        block = first if step == 0 else rows(step)
        if heads:
            packers[0].put(step, block)
        packers[1].put(step, block.mean(axis=1))  # [layer, keys_s]
        packers[2].put(step, block.mean(axis=(0, 1))[None])  # [1, keys_s]
    return packers


def decoded_rows(payload: StepsPayload, *, weighted: bool = False) -> Callable[[int], tuple[np.ndarray, ...]]:
    """What the page draws, decoded (for tests and tools): a function of the step giving every head's
    row ``[layer, head, keys]``, each layer's mean over heads ``[layer, keys]`` and the mean of all
    ``[keys]``, float32, raw or (``weighted``) norm-weighted."""
    if weighted and payload["weighted"] is None:
        raise AttnscopeError("the payload has no norm-weighted rows (the record has no value norms)")
    starts = np.concatenate([[0], np.cumsum(payload["keys"])]).astype(int)
    attention = payload["attention"]
    means = payload["weighted"] if weighted and payload["weighted"] is not None else attention
    sets = [row_values(rows) for rows in (attention["heads"], means["layers"], means["all"])]
    norms = unpack(payload["weighted"]["value_norms"]) if weighted and payload["weighted"] is not None else None

    def rows_of(step: int) -> tuple[np.ndarray, ...]:
        heads, layers, overall = (values[..., starts[step] : starts[step + 1]] / np.float32(levels) * row_max[..., step, None]
                                  for values, row_max, levels in sets)
        if norms is not None:
            heads = heads * norms[..., : payload["keys"][step]]
        return heads, layers, overall[0]

    return rows_of


def joined_blocks(blocks: StepBlocks) -> np.ndarray:
    """A per-step array from its blocks (for tests and tools): each block unpacked, float32, joined on the first axis,
    the other axes padded with zeros to the largest block's."""
    parts = [unpack(packed) for packed in blocks["blocks"]]
    widest = np.max([part.shape for part in parts], axis=0)
    return np.concatenate([np.pad(part, [(0, 0), *((0, int(w) - n) for w, n in zip(widest[1:], part.shape[1:]))])
                           for part in parts])


def step_blocks(n_steps: int, block_of: Callable[[int, int], np.ndarray],
                pack: Callable[[np.ndarray], PackedArray]) -> StepBlocks:
    """Steps ``0..n_steps-1`` in blocks of ``STEP_BLOCK``: ``block_of(start, end)`` gives the rows of steps
    ``start..end-1``, ``pack`` packs them."""
    return StepBlocks(block=STEP_BLOCK, blocks=[pack(block_of(start, min(start + STEP_BLOCK, n_steps)))
                                                for start in range(0, n_steps, STEP_BLOCK)])


@cache
def steps_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the step view's payload (``present/steps.schema.json``)."""
    text = resources.files("attnscope.present").joinpath("steps.schema.json").read_text(encoding="utf-8")
    return dict(json.loads(text))


# ---- the page --------------------------------------------------------------------------------
FRAGMENT = Template("""<div class="attnscope-steps" id="$uid" tabindex="0"></div>
<style>$css</style>
<script type="application/json" id="$uid-payload">$payload</script>
<script>$js
AttnscopeSteps.render(document.getElementById("$uid"),
  JSON.parse(document.getElementById("$uid-payload").textContent), $options);
</script>""")


@dataclass(frozen=True, eq=False)
class StepsView:
    """The step view of one decoding: ``_repr_html_`` for notebooks, :meth:`save` / :meth:`to_html` for files."""

    payload: StepsPayload

    def fragment(self, element_id: str | None = None, *, focus: bool = False) -> str:
        """The view as an HTML fragment; ``focus``: a page of its own (takes the keyboard on load and
        starts where its address says)."""
        uid = element_id or f"attnscope-steps-{uuid.uuid4().hex[:12]}"
        return FRAGMENT.substitute(uid=uid, css=static_text(STEPS_STYLES), js=static_text(STEPS_SCRIPTS),
                                   payload=to_json(self.payload), options=json.dumps({"focus": focus, "hash": focus}))

    def to_html(self) -> str:
        """A complete offline HTML document (scripts, styles and data inline; no network). Its address
        can choose where it starts: ``steps.html#step=5&layer=2&head=3&norms=1`` (0-indexed)."""
        return DOCUMENT.substitute(policy=CONTENT_POLICY, title=html.escape(self.payload["title"]),
                                   fragment=self.fragment("attnscope-steps", focus=True))

    def _repr_html_(self) -> str:
        return self.fragment()

    def save(self, path: str | Path) -> Path:
        """Write the self-contained HTML file and return its path."""
        return write_page(path, self.to_html())

    def __repr__(self) -> str:
        return f"StepsView(steps={len(self.payload['steps'])}, title={self.payload['title']!r})"


def generation_payload(gen: GenerationRecord, *, compress: bool = True, title: str | None = None) -> StepsPayload:
    """The step view's payload of a generation: every step's candidates and its query's attention over
    the prompt and the text so far, per head, per layer and overall, raw and (with value norms)
    norm-weighted, and the sentence panel of the prompt and the generated text."""
    from .sentence_panel import generation_sentences

    return build_steps_payload(
        title=title or f"{gen.model.name}: {gen.prompt[:120]}", model=gen.model.name, method=gen.method,
        kind="self", text=gen.tokens, first_step=gen.prompt_length,
        steps=[_generation_step(gen, step) for step in range(gen.n_steps)],
        rows=gen.step_attention, value_norms=gen.arrays.get("value_norms"), changes=gen.changes,
        attribution=generation_attribution(gen, compress), compress=compress, sink_mass=_step_sink_mass(gen),
        routes=generation_routes(gen, compress), sentences=generation_sentences(gen, compress),
        streamed_heads=streamed_query_heads(gen))


def streamed_query_heads(gen: GenerationRecord) -> list[tuple[int, int]] | None:
    """``(layer, query head)`` of every query head whose KV head a KV budget streamed (``settings["kv_budget"]``:
    ``(layer, kv head)``; query head h reads KV head ``h // group``), or None for a generation without a budget."""
    budget = gen.settings.get("kv_budget")
    if not budget:
        return None
    group = gen.model.n_heads // gen.model.n_kv_heads
    return [(layer, head) for layer, kv_head in budget["streamed"] for head in range(kv_head * group, (kv_head + 1) * group)]


def _step_sink_mass(gen: GenerationRecord) -> np.ndarray | None:
    """``[layer, head, step]``: the learned sink mass of each step's row, or None for a model without learned sinks."""
    if "sink_mass" not in gen.arrays:
        return None
    # each step's is an array: the record holds sink_mass
    return np.stack([cast(np.ndarray, gen.step_sink_mass(step)) for step in range(gen.n_steps)], axis=-1)


def generation_attribution(gen: GenerationRecord, compress: bool = True) -> StepAttribution | None:
    """The step view's attribution of a generation made with ``--attribute`` (None without: records
    of the first version, which kept no per-source terms, too)."""
    arrays = gen.arrays
    if ATTRIBUTION_SOURCES not in arrays:
        return None
    top = arrays[ATTRIBUTION_TOP]  # [step, rank, 2]: (layer, head)
    steps = np.arange(gen.n_steps)[:, None]
    terms = arrays[ATTRIBUTION_HEADS][steps, top[..., 0], top[..., 1]]  # [step, rank]
    sources = shown_sources(arrays[ATTRIBUTION_SOURCES])  # [step, rank, source_pos]
    # a block's tokens: the keys of its last step (step s read the prompt and the s tokens before its own)
    return StepAttribution(logits=pack_float16(arrays[ATTRIBUTION_LOGITS], compress),
                           heads=pack_uint16(_checked_uint16(top, "attribution heads"), compress),
                           terms=pack_float16(terms, compress),
                           sources=step_blocks(gen.n_steps, lambda start, end: sources[start:end, :, : gen.prompt_length + end - 1],
                                               lambda block: pack_float16(block, compress)),
                           lens=_lens_strip(gen, compress) if LENS_PROBS in arrays else None)


def shown_sources(sources: np.ndarray) -> np.ndarray:
    """Source terms ``[step, rank, source_pos]`` as the page gets them: float16, a term under ``SOURCE_FLOOR`` of its
    (step, rank)'s largest ``|term|`` set to 0 (the page draws it unshaded either way)."""
    half = sources.astype(np.float16)
    magnitude = np.abs(half.astype(np.float32))  # as the page reads them: the floor holds for the float16 values
    largest = magnitude.max(axis=-1, keepdims=True)
    return np.where(magnitude >= largest * SOURCE_FLOOR, half, np.float16(0))


def _lens_strip(gen: GenerationRecord, compress: bool) -> LensStrip:
    """The lens's tokens ``[step][layer][k]`` as uint16 indices into a vocabulary of each distinct one."""
    index: dict[str, int] = {}
    codes = [[[index.setdefault(token, len(index)) for token in layer] for layer in step] for step in gen.lens_tokens]
    shape = gen.arrays[LENS_PROBS].shape  # [step, layer, k]
    tokens = np.array(codes, dtype=np.int64).reshape(shape)
    return LensStrip(vocabulary=list(index), tokens=pack_uint16(_checked_uint16(tokens, "distinct lens tokens"), compress),
                     probs=pack_float16(gen.arrays[LENS_PROBS], compress))


def generation_routes(gen: GenerationRecord, compress: bool = True) -> RouteSteps | None:
    """The step view's routes of a generation made with ``--routes`` (None without): the record's edges, in step
    order."""
    if ROUTE_EDGES not in gen.arrays:
        return None
    codes = gen.arrays[ROUTE_EDGES]  # [edge, 8]
    order = np.argsort(codes[:, 0], kind="stable")  # the page finds a step's edges as one run of rows
    codes = _checked_uint16(codes[order], "route steps and positions")
    # edges [start[s], start[s + 1]) are step s's
    start = np.searchsorted(codes[:, 0], np.arange(gen.n_steps + 1), side="left")

    def blocks(values: np.ndarray, pack: Callable[[np.ndarray, bool], PackedArray]) -> StepBlocks:
        return step_blocks(gen.n_steps, lambda first, end: values[start[first] : start[end]],
                           lambda block: pack(block, compress))

    return RouteSteps(node_kinds=list(ROUTE_NODE_KINDS), vias=list(ROUTE_VIAS), edges=blocks(codes, pack_uint16),
                      importance=blocks(gen.arrays[ROUTE_IMPORTANCE][order], pack_float16),
                      heads=blocks(gen.arrays[ROUTE_HEADS][order], pack_float16))


def _checked_uint16(values: np.ndarray, what: str) -> np.ndarray:
    """``values`` if they fit the page's uint16 codes, else one line saying they do not."""
    if values.size and (values.min() < 0 or values.max() > UINT16_MAX):
        raise AttnscopeError(f"the step view ships {what} as uint16; {int(values.max())} is past {UINT16_MAX}")
    return values


def _generation_step(gen: GenerationRecord, step: int) -> StepInfo:
    chosen = gen.chosen(step)
    return {"chosen": chosen.token, "probability": chosen.probability,
            "candidates": [_candidate(c) for c in gen.candidates(step)]}


def _candidate(candidate: Candidate) -> StepCandidate:
    shown: StepCandidate = {"token": candidate.token, "probability": candidate.probability}
    if candidate.logit is not None:
        shown["logit"] = candidate.logit
    return shown


def steps_view(decoding: GenerationRecord | DecodeTrace, *, title: str | None = None) -> StepsView:
    """The step view of a generation or of an encoder-decoder's decoding: step through the tokens
    (arrow keys or click); ``steps_view(gen).save("steps.html")`` writes it as one self-contained
    page (no network)."""
    if isinstance(decoding, DecodeTrace):
        return StepsView(decoding_payload(decoding))
    return StepsView(generation_payload(decoding, title=title))


def decoding_payload(trace: DecodeTrace) -> StepsPayload:
    """The step view's payload (``present/steps.schema.json``): every step's candidates and the
    cross-attention of the newest decoder position over the source."""
    last = trace.steps[-1] if trace.steps else None
    text = [*last.prefix, last.chosen] if last else []
    return build_steps_payload(title=f"{trace.method} decoding of: {trace.source}", model=trace.model,
                               method=trace.method, kind="cross", text=text,
                               first_step=len(trace.steps[0].prefix) if trace.steps else 0,
                               steps=[_decoding_step(step) for step in trace.steps],
                               rows=lambda index: trace.steps[index].cross_attention, source=trace.source_tokens)


def _decoding_step(step: Step) -> StepInfo:
    chosen = [c.probability for c in step.candidates if c.token == step.chosen]
    info: StepInfo = {"chosen": step.chosen, "probability": chosen[0] if chosen else None,
                      "candidates": [_candidate(c) for c in step.candidates]}
    if step.beams:
        info["beams"] = list(step.beams)
    return info


def print_decoding(trace: DecodeTrace, console: Any = None) -> None:
    """The steps as a terminal table: prefix, top candidates, and the source shaded by attention."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    # colour alone marks the strongest source token; a file or a pipe gets it as text too
    as_text = not console.is_terminal
    table = Table(title=f"{trace.method} decoding of: {trace.source}", show_lines=False)
    for column in ("step", "prefix", "next (top-k, probability)", "cross-attention (mean of layers and heads)",
                   *(["strongest source token (weight)"] if as_text else [])):
        table.add_column(column)
    for step in trace.steps:
        weights = step.cross_attention.mean(axis=(0, 1))  # [source_pos]
        source = Text()
        for token, weight in zip(trace.source_tokens, weights):
            level = int(40 + 215 * float(weight) / max(float(weights.max()), 1e-9))
            source.append(f"{token} ", style=f"bold rgb({255 - level // 2},{255 - level},{255 - level})"
                          if weight == weights.max() else f"rgb({level},{level},{level})")
        candidates = ", ".join(f"{c.token} {c.probability:.2f}" for c in step.candidates)
        top = int(weights.argmax())
        strongest = [f"{trace.source_tokens[top]} {float(weights[top]):.2f}"] if as_text else []
        table.add_row(str(step.index), " ".join(step.prefix), candidates, source, *strongest)
    console.print(table)
    console.print(f"output: {trace.output}")

