"""The sentence panel: sentence-level attention (Bogdan et al. 2025, "Thought Anchors") packed for the step page and
the explorer (schema: ``steps.schema.json``, ``$defs/sentences``; drawn by ``static/sentences.js``).

Every number is the analysis's (:mod:`attnscope.analysis.sentences`), packed as the step view packs its rows
(:class:`~attnscope.present.rows.RowPacker`): query sentence ``i`` is a "row" of ``i + 1`` keys (the key sentences
``0..i``: the block means at and below the diagonal; the cells above it are the future), rows placed back to back,
uint8 scaled per row by its maximum (``SENTENCE_LEVELS`` levels, so a cell is at most ``row_max / 510`` plus the
float16 rounding of ``row_max`` off). Three sets, as the page chooses them:

* ``heads`` ``[layer, head, ...]``: the analysis's ``matrix`` of every head;
* ``layers`` ``[layer, ...]``: the mean over each layer's heads;
* ``all`` ``[1, ...]``: the mean over every layer and head.

``vertical`` holds each sentence's vertical score (its mean attention from the sentences at least ``proximity``
later: :func:`~attnscope.analysis.sentences.vertical_scores`) for the same three sets, float16, NaN where no
sentence is that far below; ``kurtosis`` float16 ``[layer, head]`` the receiver score of each head and ``receivers``
uint16 ``[rank, 2]`` the (layer, head) of the strongest receivers, strongest first (:class:`ReceiverHeads.ranked`).

A generation that did not keep its prompt's rows (``--prompt-rows auto`` on a long prompt) has no row for the
query sentences before ``first_query``: their rows are shipped as zeros and drawn as "not kept" (their columns, the
attention later sentences give them, are whole). Layers, heads, sentences and positions are 0-indexed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict

import numpy as np

from ..analysis.sentences import PROXIMITY, SentenceAttention, vertical_scores
from ..errors import AttnscopeError
from .payload import PackedArray, pack_float16, pack_uint16, unpack
from .rows import RowPacker, Rows, row_values

if TYPE_CHECKING:
    from ..records.generation import GenerationRecord

UINT16_MAX = int(np.iinfo(np.uint16).max)
SENTENCE_LEVELS = 255  # S x S cells are few next to the token rows: every set gets 256 shades
MAX_PANEL_SENTENCES = 256  # beyond this the heatmap's cells are under a pixel and the heads' set grows with S^2
TOP_RECEIVERS = 10


class SentenceSets(TypedDict):
    """The block means as rows: ``heads`` ``[layer, head, ...]``, ``layers`` ``[layer, ...]``, ``all`` ``[1, ...]``."""

    heads: Rows
    layers: Rows
    all: Rows


class VerticalScores(TypedDict):
    """float16 vertical scores ``[layer, head, sentence]``, ``[layer, sentence]`` and ``[1, sentence]``."""

    heads: PackedArray
    layers: PackedArray
    all: PackedArray


class SentencePanel(TypedDict):
    """The payload of the sentence panel (see the module docstring); ``spans`` uint16 ``[sentence, 2]`` is each
    sentence's ``[start, stop)`` of token positions, ``prompt_sentences`` how many lie in a generation's prompt
    (None for a text)."""

    spans: PackedArray
    prompt_sentences: int | None
    first_query: int
    proximity: int
    attention: SentenceSets
    vertical: VerticalScores
    kurtosis: PackedArray
    receivers: PackedArray


def check_panel_sentences(n_sentences: int) -> None:
    """One line for a number of sentences the panel cannot draw: one (nothing to compare) or more than it holds."""
    if n_sentences < 2:
        raise AttnscopeError(f"the text has {n_sentences} sentence{'s' if n_sentences != 1 else ''}: the sentence view "
                             "compares sentences, give at least two (a sentence ends at . ! ? before a space, or at "
                             "a new line)")
    if n_sentences > MAX_PANEL_SENTENCES:
        raise AttnscopeError(f"the text has {n_sentences} sentences; the sentence view draws at most "
                             f"{MAX_PANEL_SENTENCES} (attnscope sentences reports any number)")


def sentence_panel(attention: SentenceAttention, *, proximity: int = PROXIMITY, top: int = TOP_RECEIVERS,
                   compress: bool = True) -> SentencePanel:
    """The panel's payload of ``attention`` (every layer and head of the record, as the page numbers them)."""
    sentences = attention.sentences
    check_panel_sentences(len(sentences))
    matrix = attention.matrix  # [layer, head, q_sentence, k_sentence]
    means = (matrix, matrix.mean(axis=1), matrix.mean(axis=(0, 1))[None])  # heads, layers, all
    receivers = attention.receiver_heads(proximity)
    ranked = [(layer, head) for layer, head, kurtosis in receivers.ranked(top) if np.isfinite(kurtosis)]
    spans = np.array(sentences.spans, dtype=np.int64).reshape(-1, 2)
    if spans.max() > UINT16_MAX:
        raise AttnscopeError(f"the sentence panel ships token positions as uint16; {int(spans.max())} is past "
                             f"{UINT16_MAX}")
    heads, layers, overall = (_packed_rows(values, compress) for values in means)
    vertical = [pack_float16(vertical_scores(values, proximity), compress) for values in means]
    return SentencePanel(
        spans=pack_uint16(spans, compress), prompt_sentences=sentences.prompt_sentences,
        first_query=_first_query(matrix), proximity=proximity,
        attention=SentenceSets(heads=heads, layers=layers, all=overall),
        vertical=VerticalScores(heads=vertical[0], layers=vertical[1], all=vertical[2]),
        kurtosis=pack_float16(receivers.kurtosis, compress),
        receivers=pack_uint16(np.array(ranked, dtype=np.int64).reshape(-1, 2), compress))


def _first_query(matrix: np.ndarray) -> int:
    """How many leading query sentences have no row (NaN throughout: rows the record did not keep)."""
    missing = np.isnan(matrix).all(axis=(0, 1, 3))  # [q_sentence]
    first = int(np.argmin(missing)) if not missing.all() else len(missing)
    if missing[first:].any():
        raise AttnscopeError("the sentence panel expects the rows it lacks to be the first sentences' (a prompt's)")
    return first


def _packed_rows(values: np.ndarray, compress: bool) -> Rows:
    """``[*lead, S, S]`` -> rows of the cells at and below the diagonal, query sentence ``i`` holding ``i + 1``."""
    n = values.shape[-1]
    packer = RowPacker(values.shape[:-2], range(1, n + 1), SENTENCE_LEVELS)
    for query in range(n):
        block = values[..., query, : query + 1]
        if not np.isnan(block).any():  # a row that was not kept stays 0
            packer.put(query, block)
    return packer.packed(compress)


def generation_sentences(gen: GenerationRecord, compress: bool = True) -> SentencePanel | None:
    """The panel of a generation's prompt and generated text (its kept rows averaged by sentence), or None when the
    panel cannot draw it (fewer than two sentences, or more than :data:`MAX_PANEL_SENTENCES`)."""
    from ..analysis.sentences import record_sentences, sentence_attention

    sentences = record_sentences(gen)
    if not 2 <= len(sentences) <= MAX_PANEL_SENTENCES:
        return None
    return sentence_panel(sentence_attention(gen, sentences), compress=compress)


def decoded_panel(panel: SentencePanel) -> dict[str, np.ndarray]:
    """What the page draws, decoded (for tests and tools): ``heads`` ``[layer, head, S, S]``, ``layers``
    ``[layer, S, S]`` and ``all`` ``[S, S]`` (NaN above the diagonal and in the rows before ``first_query``),
    the vertical scores ``vertical_heads`` / ``vertical_layers`` / ``vertical_all``, ``kurtosis`` ``[layer, head]``,
    ``receivers`` ``[rank, 2]`` and ``spans`` ``[S, 2]``."""
    spans = unpack(panel["spans"]).astype(np.int64)
    n = len(spans)
    decoded: dict[str, np.ndarray] = {"spans": spans, "kurtosis": unpack(panel["kurtosis"]).astype(np.float32),
                                      "receivers": unpack(panel["receivers"]).astype(np.int64)}
    for name in ("heads", "layers", "all"):
        values, row_max, levels = row_values(panel["attention"][name])  # uint8 [*lead, sum keys], [*lead, S]
        matrix = np.full((*row_max.shape[:-1], n, n), np.nan, dtype=np.float32)
        start = 0
        for query in range(n):  # row i: the key sentences 0..i
            cells = values[..., start : start + query + 1] / np.float32(levels)
            matrix[..., query, : query + 1] = cells * row_max[..., query, None]
            start += query + 1
        matrix[..., : panel["first_query"], :] = np.nan
        decoded[name] = matrix[0] if name == "all" else matrix
        vertical = unpack(panel["vertical"][name]).astype(np.float32)
        decoded[f"vertical_{name}"] = vertical[0] if name == "all" else vertical
    return decoded
