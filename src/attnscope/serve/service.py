"""What the explorer computes, as plain functions of a loaded model (no web framework here).

* :func:`analyze`: the views' payload, each head's pattern and its statistics for one input;
* :func:`intervene`: the same input with some heads ablated or corrupted, or some attention
  sublayers skipped, and what changed (attention of every layer, and the model's output:
  sentence-embedding cosine for encoders, next-token distribution for decoders, translation and
  step view for encoder-decoders);
* :func:`record_json`: the record's attention as plain JSON, for scripts;
* :func:`qk` and :func:`describe_qk`: why a decoder's head scores a key for a query (QK attribution);
* :func:`routes_of`: the information-flow route of one prediction of a decoder;
* :func:`head_function_scores` and :func:`head_function_trial`: a decoder's head-function scores (every layer
  and head) and one head's row on one trial of the score's task, at the explorer's small settings
  (:func:`explorer_head_settings`);
* :func:`sentences_of` and :func:`describe_sentences`: sentence-level attention of a text (the sentence panel).

Layers and heads are 0-indexed everywhere. Every function raises :class:`InputError` (the web
layer answers 4xx) for input the user can fix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import AttnscopeError
from ..models.loading import LoadedModel
from ..records.attention import AttentionRecord
from ..records.generation import GenerationRecord

if TYPE_CHECKING:
    from ..analysis.head_functions import HeadScores
    from ..analysis.mixing import Mixing
    from ..attribution.qk import QKAttribution
    from ..attribution.routes import Routes
    from ..capture.kv_budget import KVBudget
    from ..experiments.head_functions import HeadScoreSettings
    from ..experiments.head_trials import HeadTrial
    from ..experiments.sentences import SentenceReport

# How an intervention changes the chosen heads (name -> what the page says about it). The
# attention patterns are the experiments' own (first = attnscope's "beginning", last = "end").
MODES = {
    "zero": "the head's output is set to 0 (ablation)",
    "uniform": "the head attends uniformly to every key it may see",
    "first": "the head attends only to the first token",
    "last": "the head attends only to the last token it may see",
    "previous": "the head attends only to the previous token",
    "skip": "the whole attention sublayer of the chosen layers is skipped (residual only)",
}
PATTERN_OF_MODE = {"zero": "zero", "uniform": "uniform", "first": "beginning", "last": "end", "previous": "previous"}

TOP_TOKENS = 10


class InputError(AttnscopeError):
    """Input the user can fix (answered with a 4xx status and this message)."""


@dataclass(frozen=True)
class Change:
    """An intervention: ``heads`` as (layer, head) pairs and/or whole ``layers``, of attention ``kind``.

    ``chosen`` is filled by :func:`check_change`: ``{layer: [head, ...], or None for every head}``.
    """

    mode: str
    heads: tuple[tuple[int, int], ...] = ()
    layers: tuple[int, ...] = ()
    kind: str | None = None
    chosen: dict[int, list[int] | None] = field(default_factory=dict, compare=False)

    def describe(self) -> str:
        parts = [f"{layer}.{head}" for layer, head in self.heads] + [f"layer {layer}" for layer in self.layers]
        return f"{self.mode}: {', '.join(parts)}"


# ---- inputs ----------------------------------------------------------------------------------
def check_input(loaded: LoadedModel, text: str, pair: str | None, max_tokens: int) -> None:
    """:class:`InputError` if the input is empty or longer than ``max_tokens`` tokens."""
    if not text.strip():
        raise InputError("text is empty")
    if pair is not None and not pair.strip():
        raise InputError("the second sentence is empty (leave it out instead)")
    tokenizer = loaded.tokenizer
    if loaded.is_encoder_decoder:
        lengths = [len(tokenizer(text)["input_ids"])]
        if pair is not None:
            lengths.append(len(tokenizer(text_target=pair)["input_ids"]))
    else:
        lengths = [len(tokenizer(text, pair)["input_ids"])]
    limit = min(max_tokens, loaded.max_length)
    if max(lengths) > limit:
        raise InputError(f"the input is {max(lengths)} tokens long; the explorer's limit is {limit} tokens "
                         "(start the server with a larger --max-tokens, or shorten the text)")


def head_shape(loaded: LoadedModel, kind: str | None) -> tuple[str, int, int]:
    """``(kind, n_layers, n_heads)`` of attention ``kind`` (None: the input side's)."""
    from ..experiments.interventions import attention_shape

    return attention_shape(loaded, kind)


def check_change(loaded: LoadedModel, change: Change) -> Change:
    """``change`` with its kind filled in and ``chosen`` = ``{layer: [head, ...] or None}``;
    :class:`InputError` for an unknown mode or a head or layer the model does not have."""
    if change.mode not in MODES:
        raise InputError(f"unknown mode {change.mode!r}; choose one of {', '.join(MODES)}")
    kind, n_layers, n_heads = head_shape(loaded, change.kind)
    if not change.heads and not change.layers:
        raise InputError("choose at least one head or layer to change")
    where = f"{loaded.name} has {n_layers} {kind} layers (0-{n_layers - 1}) x {n_heads} heads (0-{n_heads - 1})"
    for layer, head in change.heads:
        if not (0 <= layer < n_layers and 0 <= head < n_heads):
            raise InputError(f"there is no head {layer}.{head}: {where}")
    for layer in change.layers:
        if not 0 <= layer < n_layers:
            raise InputError(f"there is no layer {layer}: {where}")
    if change.mode == "skip" and change.heads:
        raise InputError("'skip' removes whole attention sublayers: choose layers, not heads")
    chosen: dict[int, list[int] | None] = {layer: None for layer in change.layers}
    for layer, head in change.heads:
        heads = chosen.setdefault(layer, [])
        if heads is not None and head not in heads:
            heads.append(head)
    return Change(change.mode, change.heads, change.layers, kind, chosen)


def change_context(loaded: LoadedModel, change: Change) -> AbstractContextManager[None]:
    """The intervention of a checked ``change`` (see :func:`check_change`), as a context manager."""
    from ..experiments.interventions import ablate_heads, skip_sublayers

    assert change.kind is not None
    if change.mode == "skip" and change.kind == "cross":
        return skip_sublayers(loaded, cross=list(change.chosen))
    if change.mode == "skip":
        return skip_sublayers(loaded, attention=list(change.chosen), kind=change.kind)
    return ablate_heads(change.chosen, PATTERN_OF_MODE[change.mode], kind=change.kind)


# ---- analysis --------------------------------------------------------------------------------
def model_summary(loaded: LoadedModel) -> dict[str, Any]:
    """What the page needs to know about a model to offer its choices."""
    from ..experiments.interventions import main_kind, n_heads_per_kind

    kind = "encoder-decoder" if loaded.is_encoder_decoder else "decoder" if loaded.causal else "encoder"
    shapes = n_heads_per_kind(loaded)
    return {"name": loaded.name, "type": kind, "model_type": loaded.config.model_type,
            "main_kind": main_kind(loaded), "kinds": {k: {"layers": n, "heads": h} for k, (n, h) in shapes.items()},
            "max_length": loaded.max_length}


def pattern_classes() -> list[dict[str, str]]:
    """Every pattern class with its short name, Kovaleva type, description and map colour."""
    from ..analysis.patterns import PATTERNS, pattern_colour

    return [{"name": p.name, "short": p.short, "kovaleva": p.kovaleva, "source": p.source,
             "description": p.description, "colour": pattern_colour(p.name)} for p in PATTERNS.values()]


def _finite(values: np.ndarray, digits: int = 4) -> list[Any]:
    """Nested lists with NaN as None (JSON has no NaN)."""
    return [_finite(row, digits) if np.ndim(row) else (None if math.isnan(row) else round(float(row), digits))
            for row in values]


def patterns_and_statistics(record: AttentionRecord) -> dict[str, Any]:
    """Each head's pattern (label, confidence) and statistics, all ``[layer][head]``."""
    from ..analysis.patterns import classify_heads
    from ..analysis.stats import describe_statistics, head_statistics

    patterns = classify_heads(record)
    statistics = head_statistics(record)
    descriptions = describe_statistics()
    return {
        "patterns": {"labels": patterns.labels.tolist(), "confidence": _finite(patterns.confidence, 3)},
        "statistics": {name: _finite(values) for name, values in statistics.values.items()},
        "statistic_descriptions": {name: descriptions.get(name.removeprefix("norm_"), "") for name in statistics.values},
    }


def extract_record(loaded: LoadedModel, text: str, pair: str | None, *, vectors: bool = False) -> AttentionRecord:
    from ..capture.extract import extract

    return extract(loaded, text, pair, qkv=vectors, norms=True)


def analyze(loaded: LoadedModel, text: str, pair: str | None, *, vectors: bool = True) -> dict[str, Any]:
    """The views' payload, patterns and statistics of one input (``vectors``: ship q/k for the neuron view)."""
    return describe(extract_record(loaded, text, pair, vectors=vectors), model_summary(loaded), text, pair)


def describe(record: AttentionRecord, model: dict[str, Any], text: str, pair: str | None) -> dict[str, Any]:
    """:func:`analyze`'s answer for an extracted ``record``; needs no model, so the web layer runs it
    after releasing the model for the next request."""
    from ..present.payload import build_payload

    return {"model": model, "text": text, "pair": pair, "tokens": list(record.tokens),
            "payload": build_payload(record, "all", norms=True), **patterns_and_statistics(record)}


def record_json(loaded: LoadedModel, text: str, pair: str | None) -> dict[str, Any]:
    """The record's tokens and attention of every kind ``[layer][head][query][key]`` as plain JSON."""

    record = extract_record(loaded, text, pair)
    attention = {kind: np.round(record.arrays[f"{kind}.attention"], 5).tolist() for kind in record.kinds}
    norms = {kind: np.round(record.arrays[f"{kind}.norms"], 5).tolist() for kind in record.kinds
             if f"{kind}.norms" in record.arrays}
    return {"model": record.model.to_json(), "text": list(record.text), "tokens": list(record.tokens),
            "target_tokens": list(record.target_tokens) if record.target_tokens is not None else None,
            "special_mask": record.special_mask.tolist(), "sentence_ids": record.sentence_ids.tolist(),
            "word_ids": record.word_ids.tolist(), "attention": attention, "norms": norms,
            "layout": "attention[kind][layer][head][query][key], 0-indexed"}


# ---- context mixing --------------------------------------------------------------------------
def mixing_methods() -> list[dict[str, str]]:
    """The context-mixing measures the page offers: method, short label and the paper."""
    from ..analysis.mixing import measures

    return [{"method": m.name, "label": m.label, "reference": m.reference} for m in measures()]


def mixing_of(loaded: LoadedModel, text: str, pair: str | None, method: str) -> Mixing:
    """The measure ``method`` of ``text`` on the input side (an encoder-decoder's ``pair`` is its
    target, which the encoder never sees; any other model's second sentence is refused)."""
    from ..analysis.mixing import method_name
    from ..experiments.mixing import check_one_text, mixing_measures

    check_one_text(loaded, pair)
    name = method_name(method)
    return mixing_measures(loaded, text, [name])[name]


def describe_mixing(measure: Mixing, text: str) -> dict[str, Any]:
    """``/api/mixing``'s answer: the measure packed as a views payload's ``kinds[i].mixing`` entry."""
    from ..present.payload import mixing_maps

    return {"model": measure.model, "text": text, "method": measure.method, "tokens": list(measure.tokens),
            "mixing": mixing_maps(measure, list(range(measure.n_layers)))}


# ---- interventions ---------------------------------------------------------------------------
def attention_change(intact: AttentionRecord, changed: AttentionRecord) -> dict[str, list[list[float]]]:
    """Per kind, ``[layer][head]``: the mean over queries of the total variation distance
    ``0.5 * sum_k |a - a'|`` between the intact and the changed attention rows (0 = same, 1 = disjoint)."""
    change = {}
    for kind in intact.kinds:
        before, after = intact.arrays[f"{kind}.attention"], changed.arrays[f"{kind}.attention"]
        distance = 0.5 * np.abs(before.astype(np.float64) - after).sum(axis=-1).mean(axis=-1)  # [layer, head]
        change[kind] = _finite(distance, 5)
    return change


def intervene(loaded: LoadedModel, text: str, pair: str | None, change: Change) -> dict[str, Any]:
    """The input intact and under ``change``: what changed in attention and in the output.

    Encoder-decoders without a target are decoded by the intact model first, and both records use
    that target, so their decoder and cross-attention stay comparable position by position.
    """
    change = check_change(loaded, change)
    from ..present.payload import build_payload

    if loaded.is_encoder_decoder and pair is None:
        pair = extract_record(loaded, text, None).text[1]
    intact = extract_record(loaded, text, pair)
    with change_context(loaded, change):
        changed = extract_record(loaded, text, pair)
    result = {"change": change.describe(), "kind": change.kind, "mode_description": MODES[change.mode],
              "attention_change": attention_change(intact, changed),
              "payload": build_payload(changed, ["head", "model"], norms=True,
                                       title=f"{loaded.name}, {change.describe()}"),
              **patterns_and_statistics(changed)}
    result["output"] = output_change(loaded, text, pair, change)
    return result


def output_change(loaded: LoadedModel, text: str, pair: str | None, change: Change) -> dict[str, Any]:
    """How the model's output moves under ``change`` (its kind says which of the three it is)."""
    if loaded.is_encoder_decoder:
        return translation_change(loaded, text, change)
    if loaded.causal:
        return next_token_change(loaded, text, pair, change)
    return embedding_change(loaded, text, pair, change)


def _final_outputs(loaded: LoadedModel, text: str, pair: str | None, change: Change) -> tuple[Any, Any, Any]:
    """The model's final output (logits, or last hidden states) intact and changed, and the inputs, on the CPU."""
    import torch

    from ..experiments.metrics import encode_batches, model_output

    inputs = encode_batches(loaded, [(text, pair)], batch_size=1)[0].inputs
    outputs = []
    for context in (nullcontext(), change_context(loaded, change)):
        with torch.inference_mode(), context:
            outputs.append(model_output(loaded, inputs).float().cpu())
    return outputs[0], outputs[1], {name: tensor.cpu() for name, tensor in inputs.items()}


def embedding_change(loaded: LoadedModel, text: str, pair: str | None, change: Change) -> dict[str, Any]:
    """Encoders: cosine of the mean-pooled sentence embeddings, and of each token's final vector."""
    import torch

    from ..experiments.metrics import sentence_embeddings

    intact, changed, inputs = _final_outputs(loaded, text, pair, change)  # [1, pos, d_model]
    mask = inputs["attention_mask"]
    cosine = float((sentence_embeddings(intact, mask) * sentence_embeddings(changed, mask)).sum())
    per_token = torch.nn.functional.cosine_similarity(intact[0], changed[0], dim=-1)  # [pos]
    return {"type": "embedding", "cosine": round(cosine, 6), "token_cosine": [round(float(c), 5) for c in per_token],
            "tokens": list(loaded.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0].tolist())),
            "what": "cosine similarity of the mean-pooled sentence embedding (and of each token's final vector) "
                    "to the intact model's; 1 = unchanged"}


def _top_tokens(loaded: LoadedModel, probabilities: Any) -> list[dict[str, Any]]:
    import torch

    top = torch.topk(probabilities, TOP_TOKENS)
    return [{"token": loaded.tokenizer.decode([int(i)]), "id": int(i), "probability": round(float(p), 5)}
            for p, i in zip(top.values, top.indices)]


def next_token_change(loaded: LoadedModel, text: str, pair: str | None, change: Change) -> dict[str, Any]:
    """Decoders: the next-token distribution after the input, intact and changed, with their KL divergence."""
    import torch

    intact, changed, _ = _final_outputs(loaded, text, pair, change)  # logits [1, pos, vocab]
    before, after = (torch.log_softmax(logits[0, -1], dim=-1) for logits in (intact, changed))
    kl = float((before.exp() * (before - after)).sum())
    return {"type": "next_token", "intact": _top_tokens(loaded, before.exp()), "changed": _top_tokens(loaded, after.exp()),
            "kl_divergence": round(kl, 6),
            "what": "the 10 most likely next tokens after the input; KL(intact || changed) in nats"}


def translation_change(loaded: LoadedModel, text: str, change: Change) -> dict[str, Any]:
    """Encoder-decoders: greedy translation and its step-by-step trace, intact and changed."""
    from ..capture.decode import decode_steps
    from ..present.steps import decoding_payload

    intact = decode_steps(loaded, text)
    with change_context(loaded, change):
        changed = decode_steps(loaded, text)
    return {"type": "translation", "intact": intact.output, "changed": changed.output,
            "intact_steps": decoding_payload(intact), "changed_steps": decoding_payload(changed),
            "what": "the greedy translation of the input, intact and changed, with the decoding steps"}


# ---- generation ------------------------------------------------------------------------------
# How the Generate tab chooses a KV budget's full heads: by the retrieval score at the explorer's settings (what the
# Head functions tab shows for it; higher = needs every key) or at random (seeded)
KV_CHOICES = {"retrieval": "the highest retrieval scores (the Head functions tab's, computed at its small settings)",
              "random": "at random (the seed)"}


@dataclass(frozen=True)
class KVAsk:
    """A generation's KV budget as the Generate tab asks for it: ``share`` (0-1) of the global layers' KV heads full
    (every key), the others streaming (the first ``sink`` keys and the ``window`` most recent), the full ones chosen
    by ``choose`` (:data:`KV_CHOICES`; ``seed`` for random)."""

    share: float
    sink: int
    window: int
    choose: str = "retrieval"
    seed: int = 0


def generation_kv_budget(loaded: LoadedModel, prompt: str, chat: bool, max_new_tokens: int, ask: KVAsk,
                         recorders: Sequence[Any] = ()) -> KVBudget:
    """The :class:`~attnscope.capture.kv_budget.KVBudget` ``ask`` names for a generation of ``max_new_tokens`` after
    ``prompt`` with ``recorders``; what needs no forward pass is checked first (a decoder that can write that much,
    recorders that run under a budget, a share in 0-1, a sink + window shorter than the text), then the retrieval
    score runs where it chooses."""
    from ..capture.generate import check_budget_recorders, check_generation, prompt_ids
    from ..capture.kv_budget import (
        DEFAULT_SCORE,
        check_evicts,
        choose_budget,
        kv_head_scores,
        kv_layout,
        random_budget,
    )

    if ask.choose not in KV_CHOICES:
        raise AttnscopeError(f"a KV budget chooses its full heads by {' or '.join(KV_CHOICES)}, not {ask.choose!r}")
    if not 0.0 <= ask.share <= 1.0:  # NaN fails too
        raise AttnscopeError(f"a share of full KV heads is between 0 and 1, got {ask.share}")
    n_prompt = len(prompt_ids(loaded, prompt, chat=chat))
    check_generation(loaded, n_prompt, max_new_tokens)
    check_budget_recorders(recorders)
    check_evicts(ask.sink, ask.window, n_prompt + max_new_tokens)
    layout = kv_layout(loaded)
    if ask.choose == "random" or ask.share in (0.0, 1.0):  # none full or all full: no score to compute
        return random_budget(layout, share=ask.share, seed=ask.seed, sink=ask.sink, window=ask.window)
    scores = kv_head_scores(head_function_scores(loaded, DEFAULT_SCORE), DEFAULT_SCORE)
    return choose_budget(scores, layout, share=ask.share, sink=ask.sink, window=ask.window)


def describe_generation(record: GenerationRecord, chosen_by: str | None = None) -> dict[str, Any]:
    """The answer of ``/api/generate``: the generated text, every position's token id (prompt and generated: what
    ``/api/qk`` reads for a step's cell), the step view's payload (``present/steps.schema.json``) and the KV budget it
    ran under (:func:`describe_kv_budget`; null without one)."""
    from ..present.steps import generation_payload

    return {"model": record.model.name, "prompt": record.prompt, "generated": record.generated_text,
            "token_ids": [int(i) for i in record.token_ids], "payload": generation_payload(record),
            "kv_budget": describe_kv_budget(record, chosen_by)}


def describe_kv_budget(record: GenerationRecord, chosen_by: str | None) -> dict[str, Any] | None:
    """A generation's KV budget (``KVBudget.to_dict``: ``full`` ``[layer][kv_head]`` 0/1, ``streamed`` ``[[layer,
    kv_head], ...]``, ``windows``, ``sink``, ``window``, ``share``), how its full heads were chosen, and the key/value
    bytes the budgeted cache held at the end (``bytes``, :func:`~attnscope.capture.kv_budget.kv_bytes` of the
    ``tokens`` it held: every token but the last, which generation never feeds back) against a plain cache's
    (``full_bytes``); None for a generation without a budget."""
    import torch

    from ..capture.kv_budget import KVBudget, kv_bytes

    settings = record.settings.get("kv_budget")
    if not settings:
        return None
    budget = KVBudget.from_dict(settings)
    held, dtype = len(record.token_ids) - 1, getattr(torch, record.model.dtype)
    stored, full = (kv_bytes(b, held, record.model.d_head, dtype) for b in (budget, budget.all_full()))
    return {**budget.to_dict(), "chosen_by": chosen_by, "tokens": held, "bytes": stored, "full_bytes": full,
            "saving": full / stored if stored else None}


# ---- QK attribution --------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """One attention cell: head ``head`` of layer ``layer``, query position ``query``, key position ``key``."""

    layer: int
    head: int
    query: int
    key: int


def check_ids(loaded: LoadedModel, ids: list[int]) -> None:
    """:class:`InputError` for token ids the model has no embedding for, or more than its context holds."""
    vocabulary = loaded.model.get_input_embeddings().num_embeddings
    outside = next((i for i in ids if not 0 <= i < vocabulary), None)
    if outside is not None:
        raise InputError(f"token id {outside} is outside {loaded.name}'s vocabulary (ids 0..{vocabulary - 1})")
    if len(ids) > loaded.max_length:
        raise InputError(f"the input is {len(ids)} tokens long; {loaded.name}'s limit is {loaded.max_length} tokens")


def qk(loaded: LoadedModel, text: str | None, ids: list[int] | None, cell: Cell, max_tokens: int) -> QKAttribution:
    """QK attribution of ``cell`` on ``text`` (checked as :func:`check_input` checks it) or on token ``ids`` (what a
    generation wrote: up to the model's context); exactly one of the two."""
    from ..attribution.qk import qk_attribution

    if (text is None) == (ids is None):
        raise InputError("give either the text or its token ids (ids), not both and not neither")
    if text is not None:
        check_input(loaded, text, None, max_tokens)
    else:
        check_ids(loaded, ids or [])
    return qk_attribution(loaded, text if text is not None else ids or [], cell.layer, cell.head, cell.query, cell.key)


def _pairs(found: QKAttribution, top: int, table: str) -> list[dict[str, Any]]:
    return [{"query_component": q, "key_component": k, "value": value} for q, k, value in found.top_pairs(top, table)]


def describe_qk(found: QKAttribution, top: int) -> dict[str, Any]:
    """``/api/qk``'s answer: the cell, the model's score and log attention, the tables' sums, the ``top`` pairs of the
    score table and of the centred one (None under softcapping), and the row term."""
    return {"model": found.model, "tokens": list(found.tokens), "layer": found.layer, "head": found.head,
            "query": found.query, "key": found.key, "score": found.score, "capped_score": found.capped_score,
            "table_sum": found.total(), "log_attention": found.log_attention, "softmax_sum": found.softmax_total(),
            "row_term": found.row_term, "sink_mass": found.sink_mass, "components": len(found.query_components),
            "top": {"score": _pairs(found, top, "score"),
                    "centred": None if found.centred is None else _pairs(found, top, "centred")}}


# ---- information-flow routes -----------------------------------------------------------------
def routes_of(loaded: LoadedModel, text: str, position: int, tau: float, max_tokens: int) -> Routes:
    """The route of the prediction at ``position`` of ``text`` (``attnscope.routes``): a model that is no decoder is
    refused before the text is read, then the text is checked as :func:`check_input` checks it."""
    from ..attribution.routes import check_route_model, routes

    check_route_model(loaded)
    check_input(loaded, text, None, max_tokens)
    return routes(loaded, text, position, tau)


# ---- head functions --------------------------------------------------------------------------
def head_function_choices() -> list[dict[str, Any]]:
    """The registered head-function scores the page offers (its menu): name, label, task, definition, paper, and
    whether a clicked head can be shown on one of the task's trials."""
    from ..analysis.head_functions import head_functions
    from ..experiments.head_trials import TRIALS

    return [{"name": f.name, "label": f.label, "task": f.task, "reference": f.reference, "cited": f.cited,
             "trial": f.task in TRIALS} for f in head_functions()]


def explorer_head_settings() -> HeadScoreSettings:
    """Small settings, so a request is answered in seconds on a CPU: 2 sequences of 2 x 32 random tokens; the first
    256 tokens of one document, windows 8 to 128 behind a sink of 4; one pass-key trial of 512 tokens (retrieval)."""
    from ..experiments.head_functions import HeadScoreSettings

    return HeadScoreSettings(period=32, repeats=2, sequences=2, max_tokens=256, sinks=(4,), windows=(8, 16, 32, 64, 128),
                             chunk=128, needles=("passkey-1",), needle_lengths=(512,), needle_depths=(0.5,))


def head_function_scores(loaded: LoadedModel, score: str) -> HeadScores:
    """``score`` for every layer and head of ``loaded`` (``attnscope.head_scores``) at the explorer's settings."""
    from ..experiments.head_functions import head_scores

    return head_scores(loaded, [score], explorer_head_settings())


def head_function_trial(loaded: LoadedModel, score: str, layer: int, head: int) -> HeadTrial:
    """Head ``layer``.``head`` on one trial of ``score``'s task (``head_trial``) at the explorer's settings."""
    from ..experiments.head_trials import head_trial

    return head_trial(loaded, score, layer, head, explorer_head_settings())
# ---- sentences -------------------------------------------------------------------------------
def sentences_of(loaded: LoadedModel, text: str, proximity: int, max_tokens: int) -> SentenceReport:
    """Sentence attention and receiver heads of ``text`` (``sentence_report``: a planned capture), after the checks
    that need no forward pass: the text as :func:`check_input` checks it, and a number of sentences the panel draws."""
    from ..experiments.sentences import sentence_report, text_sentences
    from ..present.sentence_panel import check_panel_sentences

    check_input(loaded, text, None, max_tokens)
    check_panel_sentences(len(text_sentences(loaded, text)))
    return sentence_report(loaded, text, proximity=proximity)


def describe_sentences(report: SentenceReport, model: str, top: int) -> dict[str, Any]:
    """``/api/sentences``' answer: the text's tokens and the sentence panel (``steps.schema.json``'s
    ``$defs/sentences``) with the ``top`` receiver heads; needs no model, so the web layer runs it after releasing
    the model for the next request."""
    from ..present.sentence_panel import sentence_panel

    attention = report.attention
    return {"model": model, "tokens": list(report.tokens),
            "n_layers": len(attention.layers), "n_heads": len(attention.heads),
            "sentences": sentence_panel(attention, proximity=report.receivers.proximity, top=top)}
