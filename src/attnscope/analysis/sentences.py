"""Sentence-level attention: sentences of a text, attention averaged to sentence x sentence, each
sentence's received attention from later sentences, and receiver heads (Bogdan et al. 2025,
"Thought Anchors: Which LLM Reasoning Steps Matter?", arXiv:2506.19143).

**Sentences** (:func:`split_sentences`) are spans of tokens ``[start, stop)``, 0-indexed. A sentence
ends after a token whose text ends in ``.``, ``!``, ``?`` or ``…`` (closing quotes and brackets may
follow) when the next token starts with whitespace (so ``3.14`` and ``e.g.x`` do not split), after a
token holding a newline, before and after every special token, and at the prompt's end (a generated
text starts a new sentence). Special tokens (``<|im_start|>``, BOS), whitespace-only pieces and a chat
template's role header (a line of one word between a special token and a newline: ``user``,
``assistant``) belong to no sentence: they are neither queries nor keys of the sentence matrix. Nor does a
model's text's first token (``sink_first``, as records and texts are split): a BOS token is special already, and
a model that adds none (Qwen2.5, SmolLM2, GPT-2) sinks its attention on the first token instead (Xiao et al.
2024). Left in, it made the first sentence the one every later sentence attends to, so such heads all had the
largest kurtosis one spike can give (n − 5 + 1/(n − 1) over n vertical scores): on Qwen2.5 0.5B and the
2,048-token 1912 address, 120 of 336 heads came within 5% of it, 80% of heads scored the first sentence highest,
and it held 86-96% of the vertical-score sums of the three top heads. Bogdan et al.'s models have a BOS token,
outside every sentence.

**Sentence attention** (:class:`SentenceAttention`) follows Bogdan et al.: each block of the token
matrix is averaged, ``M[l, h, i, j] = mean over query tokens q of S_i of the mean over key tokens k of
S_j of A[l, h, q, k]`` (the mean over the block's cells, the future's zeros of a diagonal block included,
as their ``compute_averaged_matrix`` does). Sentence ``j``'s **vertical score** is the mean of
``M[i, j]`` over the sentences ``i >= j + proximity`` (``proximity = 4`` in their receiver-head code:
the nearest later sentences are left out); NaN where no sentence is that far below. A head's
**receiver score** is the kurtosis of its vertical scores across sentences (NaN ones left out), Fisher's
definition (excess kurtosis, 0 for a normal distribution; ``scipy.stats.kurtosis``'s default, which
their code calls): a head whose later sentences return to a few sentences has a heavy-tailed spread of
vertical scores. Heads are ranked by it, largest first. Layers and heads are 0-indexed.

>>> s = split_sentences(["The", " cat", " sat", ".", " It", " ran", "!"])
>>> s.spans
((0, 4), (4, 7))
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import AttnscopeError
from ..records.format import SENTENCE_ATTENTION

if TYPE_CHECKING:
    import pandas as pd

    from ..records.attention import AttentionRecord
    from ..records.generation import GenerationRecord

PROXIMITY = 4  # Bogdan et al.'s receiver-head code: the 4 nearest later sentences are left out
SENTENCE_END = re.compile(r"[.!?…][\"'”’)\]]*\s*$")


@dataclass(frozen=True)
class Sentences:
    """Sentences of a token sequence: ``spans`` ``[(start, stop), ...]`` of 0-indexed token positions,
    ``texts`` the sentences' text, ``n_tokens`` the sequence's length and ``prompt_sentences`` how many
    of the sentences lie in a generation's prompt (None for a plain text)."""

    spans: tuple[tuple[int, int], ...]
    texts: tuple[str, ...]
    n_tokens: int
    prompt_sentences: int | None = None

    def __len__(self) -> int:
        return len(self.spans)

    @property
    def sizes(self) -> np.ndarray:
        """Tokens per sentence: int64 ``[sentence]``."""
        return np.array([stop - start for start, stop in self.spans], dtype=np.int64)

    def labels(self) -> np.ndarray:
        """Each token's sentence: int64 ``[position]``, -1 for tokens in no sentence."""
        return sentence_labels(self.spans, self.n_tokens)

    def part(self, index: int) -> str:
        """``prompt`` or ``generated`` for a generation's sentence, ``text`` otherwise."""
        if self.prompt_sentences is None:
            return "text"
        return "prompt" if index < self.prompt_sentences else "generated"

    def to_frame(self) -> pd.DataFrame:
        """One row per sentence: its index, token span, size, part and text."""
        import pandas as pd

        return pd.DataFrame({"sentence": range(len(self)), "start": [s for s, _ in self.spans],
                             "stop": [e for _, e in self.spans], "tokens": self.sizes,
                             "part": [self.part(i) for i in range(len(self))],
                             "text": self.texts})


def sentence_labels(spans: Sequence[tuple[int, int]], n_tokens: int) -> np.ndarray:
    """int64 ``[position]``: the index of the span holding each position, -1 outside every span."""
    labels = np.full(n_tokens, -1, dtype=np.int64)
    for index, (start, stop) in enumerate(spans):
        labels[start:stop] = index
    return labels


def split_sentences(tokens: Sequence[str], special_mask: Sequence[bool] | np.ndarray | None = None, *,
                    prompt_length: int | None = None, sink_first: bool = False) -> Sentences:
    """The sentences of ``tokens`` (the rule in the module docstring); ``special_mask`` bool ``[position]``
    marks special tokens; ``prompt_length``: the prompt's end ends a sentence (a generation's); ``sink_first``:
    the tokens are a model's whole text, whose first token, the attention sink, belongs to no sentence."""
    special = np.zeros(len(tokens), dtype=bool) if special_mask is None else np.asarray(special_mask, dtype=bool)
    spans: list[tuple[int, int]] = []
    start, header = 0, False  # header: inside the role line after a special token
    for position, token in enumerate(tokens):
        if sink_first and position == 0 and not special[0]:
            start = 1
            continue
        if special[position]:
            _close(spans, tokens, start, position, False)
            start, header = position + 1, True
            continue
        if "\n" in token or _ends_sentence(tokens, position) or position + 1 == prompt_length:
            _close(spans, tokens, start, position + 1, header and "\n" in token)
            start, header = position + 1, False
    _close(spans, tokens, start, len(tokens), False)
    prompt_sentences = None if prompt_length is None else sum(stop <= prompt_length for _, stop in spans)
    return Sentences(tuple(spans), tuple("".join(tokens[a:b]) for a, b in spans), len(tokens), prompt_sentences)


def _ends_sentence(tokens: Sequence[str], position: int) -> bool:
    """Sentence punctuation at the token's end, followed by whitespace or nothing."""
    following = tokens[position + 1] if position + 1 < len(tokens) else " "
    return bool(SENTENCE_END.search(tokens[position])) and (not following or following[0].isspace())


def _close(spans: list[tuple[int, int]], tokens: Sequence[str], start: int, stop: int, header: bool) -> None:
    """Keep ``[start, stop)`` as a sentence unless it is only whitespace or a one-word role header."""
    text = "".join(tokens[start:stop]).strip()
    if text and not (header and len(text.split()) == 1):
        spans.append((start, stop))


def record_sentences(record: AttentionRecord | GenerationRecord) -> Sentences:
    """The sentences of a record's tokens (a generation's prompt ends a sentence; the first token, the attention sink,
    is in none)."""
    from ..records.generation import GenerationRecord

    if isinstance(record, GenerationRecord):
        return split_sentences(record.tokens, record.arrays["special_mask"], prompt_length=record.prompt_length,
                               sink_first=True)
    return split_sentences(record.tokens, record.arrays.get("input.special_mask"), sink_first=True)


# ---- sentence x sentence ----------------------------------------------------------------------


def key_weights(sentences: Sentences) -> np.ndarray:
    """float32 ``[position, sentence]``: ``1 / |S_j|`` where position is in sentence ``j``, else 0, so
    ``row @ key_weights`` is a row's mean over each sentence's keys."""
    weights = np.zeros((sentences.n_tokens, len(sentences)), dtype=np.float32)
    for index, (start, stop) in enumerate(sentences.spans):
        weights[start:stop, index] = 1.0 / (stop - start)
    return weights


def block_average(attention: np.ndarray, sentences: Sentences) -> np.ndarray:
    """``attention`` ``[..., q_pos, k_pos]`` -> ``[..., q_sentence, k_sentence]``, each block's mean."""
    weights = key_weights(sentences)
    per_key = np.asarray(attention, dtype=np.float32) @ weights  # [..., q_pos, k_sentence]
    return np.swapaxes(np.swapaxes(per_key, -1, -2) @ weights, -1, -2)


def rows_block_average(record: GenerationRecord, sentences: Sentences) -> np.ndarray:
    """A generation's kept rows averaged by sentence: float32 ``[layer, head, q_sentence, k_sentence]``.

    A query sentence with a token whose row was not kept (before ``first_row``) is NaN throughout."""
    weights = key_weights(sentences)
    n_sentences = len(sentences)
    sums = np.zeros((record.n_layers, record.n_heads, n_sentences, n_sentences), dtype=np.float64)
    for index, (start, stop) in enumerate(sentences.spans):
        if start < record.first_row:
            sums[:, :, index] = np.nan
            continue
        for position in range(start, stop):  # row q holds keys 0..q
            sums[:, :, index] += record.row(position) @ weights[: position + 1]
        sums[:, :, index] /= stop - start
    return sums.astype(np.float32)


@dataclass(frozen=True)
class SentenceAttention:
    """Attention averaged to sentence x sentence: ``matrix`` float32 ``[layer, head, q_sentence,
    k_sentence]`` (the block means of the module docstring) over ``layers`` and ``heads`` (0-indexed model
    numbers of its leading axes) and the ``sentences``; ``source``: ``rows`` (a record's token rows) or
    ``planned`` (averaged by a capture plan as the forward ran)."""

    sentences: Sentences
    matrix: np.ndarray
    layers: tuple[int, ...]
    heads: tuple[int, ...]
    source: str = "rows"

    def vertical_scores(self, proximity: int = PROXIMITY) -> np.ndarray:
        """Each sentence's mean attention from the sentences at least ``proximity`` later:
        float32 ``[layer, head, sentence]`` (NaN where there is none)."""
        return vertical_scores(self.matrix, proximity)

    def receiver_heads(self, proximity: int = PROXIMITY) -> ReceiverHeads:
        """Heads ranked by the kurtosis of their vertical scores (Bogdan et al.'s receiver heads)."""
        scores = self.vertical_scores(proximity)
        return ReceiverHeads(kurtosis=excess_kurtosis(scores), vertical=scores, layers=self.layers,
                             heads=self.heads, proximity=proximity)

    def to_frame(self) -> pd.DataFrame:
        """One row per (layer, head, query sentence, key sentence) at or below the diagonal."""
        import pandas as pd

        n = len(self.sentences)
        queries, keys = np.tril_indices(n)
        layer, head = np.meshgrid(self.layers, self.heads, indexing="ij")
        count = queries.size
        return pd.DataFrame({"layer": np.repeat(layer.ravel(), count), "head": np.repeat(head.ravel(), count),
                             "query_sentence": np.tile(queries, layer.size), "key_sentence": np.tile(keys, layer.size),
                             "attention": self.matrix[:, :, queries, keys].ravel()})

    def to_json(self) -> dict[str, Any]:
        return {"sentences": [{"start": a, "stop": b, "text": t} for (a, b), t in
                              zip(self.sentences.spans, self.sentences.texts)],
                "prompt_sentences": self.sentences.prompt_sentences, "layers": list(self.layers),
                "heads": list(self.heads), "source": self.source}


def vertical_scores(matrix: np.ndarray, proximity: int = PROXIMITY) -> np.ndarray:
    """``matrix`` ``[..., q_sentence, k_sentence]`` -> ``[..., sentence]``: column ``j``'s mean over rows
    ``i >= j + proximity`` (NaN where there is none, and NaN cells are left out)."""
    if proximity < 1:
        raise AttnscopeError(f"proximity must be at least 1 (1: every later sentence), got {proximity}")
    n = matrix.shape[-1]
    far = np.subtract.outer(np.arange(n), np.arange(n)) >= proximity  # [q, k]
    cells = np.where(far, matrix, np.nan)
    counts = np.sum(~np.isnan(cells), axis=-2)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (np.nansum(cells, axis=-2) / counts).astype(np.float32)


def excess_kurtosis(values: np.ndarray) -> np.ndarray:
    """Fisher's (excess) kurtosis over the last axis, NaN values left out, moments without bias correction
    (``scipy.stats.kurtosis(x, fisher=True, bias=True, nan_policy="omit")``): ``[...]``; NaN where fewer
    than two values differ."""
    values = np.asarray(values, dtype=np.float64)
    count = np.sum(~np.isnan(values), axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        # a sum over the count, not np.nanmean: a head without scores (too few sentences) is NaN without a warning
        centred = values - np.nansum(values, axis=-1, keepdims=True) / count[..., None]
        second = np.nansum(centred**2, axis=-1) / count
        fourth = np.nansum(centred**4, axis=-1) / count
        kurtosis = fourth / second**2 - 3.0
    return np.where(second > 0, kurtosis, np.nan)


@dataclass(frozen=True)
class ReceiverHeads:
    """Receiver heads: ``kurtosis`` float ``[layer, head]`` of each head's ``vertical`` scores ``[layer, head,
    sentence]``, over ``layers`` and ``heads`` (0-indexed), with the ``proximity`` used."""

    kurtosis: np.ndarray
    vertical: np.ndarray
    layers: tuple[int, ...]
    heads: tuple[int, ...]
    proximity: int = PROXIMITY

    def ranked(self, k: int | None = None) -> list[tuple[int, int, float]]:
        """``[(layer, head, kurtosis), ...]``, largest kurtosis first (NaN last), the first ``k``."""
        flat = np.nan_to_num(self.kurtosis, nan=-np.inf).ravel()
        order = np.argsort(-flat, kind="stable")[:k]
        return [(self.layers[i // len(self.heads)], self.heads[i % len(self.heads)], float(self.kurtosis.ravel()[i]))
                for i in order]

    def to_frame(self) -> pd.DataFrame:
        """One row per head, ranked: rank (0 = the strongest receiver), layer, head, kurtosis."""
        import pandas as pd

        ranked = self.ranked()
        return pd.DataFrame({"rank": range(len(ranked)), "layer": [r[0] for r in ranked],
                             "head": [r[1] for r in ranked], "kurtosis": [r[2] for r in ranked]})


def sentence_attention(record: AttentionRecord | GenerationRecord,
                       sentences: Sentences | None = None) -> SentenceAttention:
    """Attention averaged to sentence x sentence from what ``record`` holds: a generation's kept rows, a full
    record's matrix, or a planned record's sentence averages (``CapturePlan(sentences=...)``).

    ``sentences``: default :func:`record_sentences`; a planned record keeps the spans it was captured with.
    """
    from ..records.generation import GenerationRecord

    if isinstance(record, GenerationRecord):
        sentences = sentences or record_sentences(record)
        _check_spans(sentences, len(record.tokens))
        return SentenceAttention(sentences, rows_block_average(record, sentences), tuple(range(record.n_layers)),
                                 tuple(range(record.n_heads)))
    planned = record.get(record.model.main_kind, SENTENCE_ATTENTION)
    if planned is not None:
        return _planned(record, planned, sentences)
    if record.is_partial:
        raise AttnscopeError(f"sentence attention needs the whole matrix or sentence averages, but this record is "
                             f"{record.holdings()}; capture it with CapturePlan(sentences=...) "
                             "(attnscope.experiments.sentences.capture_sentence_attention)")
    sentences = sentences or record_sentences(record)
    _check_spans(sentences, len(record.tokens))
    return SentenceAttention(sentences, block_average(record.attention, sentences), record.layers_held,
                             record.heads_held)


def _planned(record: AttentionRecord, planned: np.ndarray, sentences: Sentences | None) -> SentenceAttention:
    """The sentence averages a capture plan kept, with the spans it kept them for."""
    spans = tuple(tuple(span) for span in (record.selection.plan if record.selection else {}).get("sentences") or ())
    if sentences is not None and sentences.spans != spans:
        raise AttnscopeError("this record was averaged over other sentences than the ones given; capture again "
                             "with CapturePlan(sentences=...) for these")
    tokens = record.tokens
    found = sentences or Sentences(spans, tuple("".join(tokens[a:b]) for a, b in spans), len(tokens))  # type: ignore[misc]
    return SentenceAttention(found, np.asarray(planned, dtype=np.float32), record.layers_held, record.heads_held,
                             source="planned")


def require_sentences(sentences: Sentences) -> Sentences:
    """``sentences``, refused in one line where there are none (only special tokens, whitespace or the sink)."""
    if not len(sentences):
        raise AttnscopeError("the text has no sentence (only special tokens, whitespace or a single token)")
    return sentences


def _check_spans(sentences: Sentences, n_tokens: int) -> None:
    require_sentences(sentences)
    if sentences.n_tokens != n_tokens:
        raise AttnscopeError(f"the sentences were split from {sentences.n_tokens} tokens, the record has {n_tokens}")
