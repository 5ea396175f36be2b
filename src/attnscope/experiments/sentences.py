"""Sentence attention that runs a model: the planned capture that averages attention by sentence as it goes,
and attention suppression, the causal counterpart of receiver heads (Bogdan et al. 2025, "Thought Anchors").

**Suppression** (:func:`sentence_suppression`): for one sentence ``S_j = [start, stop)`` at a time, every
query at or after ``stop`` loses the keys of ``S_j`` in every layer and head, as if they were masked
before the softmax (:class:`SuppressSentence`: the kept weights are divided by what they sum to, which
equals the softmax over the kept keys, learned sinks included). The text is then scored again in one
forward pass, and each later token's log-probability (``log p(token_t | tokens_<t)``) is compared with the
intact pass. The result holds the change per (suppressed sentence, token) and the sentence x sentence
matrix of mean changes ``D[i, j]``: the mean over the tokens of sentence ``i > j`` of the change when
``S_j`` is suppressed (negative: the text became less likely without ``S_j``). Sentences are 0-indexed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..analysis.sentences import (
    PROXIMITY,
    ReceiverHeads,
    SentenceAttention,
    Sentences,
    record_sentences,
    require_sentences,
    sentence_attention,
    split_sentences,
)
from ..capture.attention import Intervention, intervene
from ..capture.extract import as_loaded, encode_window, extract
from ..capture.plan import CapturePlan
from ..errors import AttnscopeError
from ..models.adapters import AttentionSite

if TYPE_CHECKING:
    import pandas as pd

    from ..models.loading import LoadedModel
    from ..records.attention import AttentionRecord
    from ..records.generation import GenerationRecord


def capture_sentence_attention(model: LoadedModel | str, text: str, *, chunk: int = 256,
                               layers: tuple[int, ...] | None = None, heads: tuple[int, ...] | None = None,
                               max_length: int | None = None, progress: bool = False) -> SentenceAttention:
    """Sentence x sentence attention of ``text`` from a planned capture: the query x key matrix is never
    held, only ``[layer, head, S, S]`` block sums and one chunk of ``chunk`` query rows per layer (0-indexed
    ``layers`` and ``heads``: all by default). The text is tokenized as capture tokenizes it, split into
    sentences (:func:`~attnscope.analysis.sentences.split_sentences`), then run once."""
    loaded = as_loaded(model)
    sentences = text_sentences(loaded, text, max_length)
    record = sentence_record(loaded, text, sentences, chunk=chunk, layers=layers, heads=heads, max_length=max_length,
                             progress=progress)
    return sentence_attention(record, sentences)


def text_sentences(loaded: LoadedModel, text: str, max_length: int | None = None) -> Sentences:
    """The sentences of ``text`` as capture tokenizes it (truncated to ``max_length`` tokens; the first token, the
    attention sink, is in none)."""
    if max_length is not None and max_length < 1:
        raise AttnscopeError(f"the maximum length must be at least 1 token, got {max_length}")
    side = encode_window(loaded, [(0, (text, None))], min(max_length or loaded.max_length, loaded.max_length))[0].source
    return require_sentences(split_sentences(side.tokens, side.special_mask, sink_first=True))


def sentence_record(loaded: LoadedModel, text: str, sentences: Sentences, *, chunk: int = 256,
                    layers: tuple[int, ...] | None = None, heads: tuple[int, ...] | None = None,
                    max_length: int | None = None, progress: bool = False) -> AttentionRecord:
    """The partial record of a planned capture that averaged ``text``'s attention over ``sentences``."""
    plan = CapturePlan(layers=layers, heads=heads, attention=False, chunk=chunk, sentences=sentences.spans)
    return extract(loaded, text, plan=plan, max_length=max_length, progress=progress)


class SuppressSentence(Intervention):
    """Every query at or after ``stop`` loses the keys ``start .. stop - 1`` (all layers and heads of ``kind``):
    the same probabilities as a mask of those keys before the softmax."""

    def __init__(self, start: int, stop: int, kind: str = "self") -> None:
        self.start, self.stop, self.kind = start, stop, kind

    def applies_to(self, site: AttentionSite) -> bool:
        return site.kind == self.kind

    def modify_probs(self, site: AttentionSite, probs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        n_queries, n_keys = probs.shape[-2:]
        positions = torch.arange(n_keys - n_queries, n_keys, device=probs.device)  # the queries' (a cache's last)
        later = (positions >= self.stop)[:, None]  # [q, 1]
        keys = torch.arange(n_keys, device=probs.device)
        masked = later & (keys >= self.start)[None, :] & (keys < self.stop)[None, :]  # [q, k]
        kept = probs.masked_fill(masked, 0.0)
        removed = (probs - kept).sum(-1, keepdim=True)  # softmax over fewer keys: p / (1 - removed mass)
        return kept / (1.0 - removed).clamp_min(torch.finfo(probs.dtype).tiny)


@dataclass(frozen=True)
class SuppressionResult:
    """Attention suppression of each sentence: ``changes`` float32 ``[suppressed sentence, position]``, the change
    of each token's log-probability (NaN for the first token and for positions not after the suppressed sentence);
    ``log_probs`` float32 ``[position]`` of the intact text; ``matrix`` float32 ``[sentence, suppressed sentence]``
    (``D[i, j]``, NaN at and above the diagonal). ``suppressed``: which sentences were suppressed (0-indexed)."""

    sentences: Sentences
    tokens: tuple[str, ...]
    suppressed: tuple[int, ...]
    log_probs: np.ndarray
    changes: np.ndarray
    matrix: np.ndarray

    def to_frame(self) -> pd.DataFrame:
        """One row per (suppressed sentence, later token): its position, sentence, text and log-probabilities."""
        import pandas as pd

        labels = self.sentences.labels()
        rows = [{"suppressed": j, "position": int(t), "sentence": int(labels[t]), "token": self.tokens[t],
                 "log_prob": float(self.log_probs[t]), "change": float(row[t])}
                for j, row in zip(self.suppressed, self.changes) for t in np.flatnonzero(~np.isnan(row))]
        return pd.DataFrame(rows, columns=["suppressed", "position", "sentence", "token", "log_prob", "change"])

    def matrix_frame(self) -> pd.DataFrame:
        """The sentence x sentence matrix of mean changes as a table: rows are sentences, columns suppressed ones."""
        import pandas as pd

        return pd.DataFrame(self.matrix[:, list(self.suppressed)], columns=list(self.suppressed))

    def to_json(self) -> dict[str, Any]:
        return {"suppressed": list(self.suppressed),
                "matrix": [[None if np.isnan(v) else round(float(v), 6) for v in row] for row in self.matrix]}


def token_log_probs(loaded: LoadedModel, ids: torch.Tensor) -> np.ndarray:
    """``log p(token_t | tokens_<t)`` of ``ids`` ``[position]`` in one forward pass: float32 ``[position]``
    (NaN for position 0, which nothing predicts)."""
    with torch.no_grad():
        logits = loaded.model(input_ids=ids[None].to(loaded.model.device), use_cache=False).logits[0].float()
    chosen = logits[:-1].log_softmax(-1).gather(-1, ids[1:, None].to(logits.device))[:, 0]
    return np.concatenate([[np.nan], chosen.cpu().numpy()]).astype(np.float32)


def sentence_suppression(model: LoadedModel | str, record: AttentionRecord | GenerationRecord, *,
                         sentences: Sentences | None = None, which: Sequence[int] | None = None,
                         progress: bool = False) -> SuppressionResult:
    """Suppress each sentence of ``record``'s text in turn (``which``: these sentences only, 0-indexed) and report
    the change of every later token's log-probability (see the module docstring). One forward pass each."""
    loaded = as_loaded(model)
    check_decoder(loaded)
    ids, tokens = _record_ids(record)
    sentences = sentences or _sentences_of(record)
    chosen = chosen_sentences(sentences, which)
    intact = token_log_probs(loaded, ids)
    changes = np.full((len(chosen), len(ids)), np.nan, dtype=np.float32)
    from tqdm.auto import tqdm

    with tqdm(total=len(chosen), desc="suppressing sentences", unit="sentence", disable=not progress) as bar:
        for row, j in enumerate(chosen):
            start, stop = sentences.spans[j]
            with intervene(SuppressSentence(start, stop)):
                changed = token_log_probs(loaded, ids)
            changes[row, stop:] = changed[stop:] - intact[stop:]
            bar.update(1)
    return SuppressionResult(sentences, tokens, chosen, intact, changes, _mean_by_sentence(changes, chosen, sentences))


def check_decoder(loaded: LoadedModel) -> None:
    if not loaded.causal:
        raise AttnscopeError("attention suppression scores each token's log-probability: it needs a decoder")


def chosen_sentences(sentences: Sentences, which: Sequence[int] | None) -> tuple[int, ...]:
    """``which`` (every sentence when None), refused where one is not a sentence (0-indexed)."""
    chosen = tuple(range(len(sentences))) if which is None else tuple(which)
    bad = [j for j in chosen if not 0 <= j < len(sentences)]
    if bad:
        raise AttnscopeError(f"sentence {bad[0]} is outside 0..{len(sentences) - 1} (0-indexed)")
    return chosen


def _mean_by_sentence(changes: np.ndarray, chosen: tuple[int, ...], sentences: Sentences) -> np.ndarray:
    """``D[i, j]``: the mean change over sentence ``i``'s tokens when ``j`` is suppressed (``i > j``), else NaN."""
    matrix = np.full((len(sentences), len(sentences)), np.nan, dtype=np.float32)
    for row, j in enumerate(chosen):
        for i in range(j + 1, len(sentences)):
            start, stop = sentences.spans[i]
            matrix[i, j] = np.nanmean(changes[row, start:stop])
    return matrix


def _record_ids(record: AttentionRecord | GenerationRecord) -> tuple[torch.Tensor, tuple[str, ...]]:
    from ..records.generation import GenerationRecord

    if isinstance(record, GenerationRecord):
        return torch.tensor(np.array(record.token_ids), dtype=torch.long), record.tokens
    return torch.tensor(np.array(record.arrays["input.token_ids"]), dtype=torch.long), record.tokens


def _sentences_of(record: AttentionRecord | GenerationRecord) -> Sentences:
    return require_sentences(record_sentences(record))


@dataclass(frozen=True)
class SentenceReport:
    """What ``attnscope sentences`` reports: the sentence attention, its receiver heads and, when asked for, the
    suppression of each sentence; ``tokens``: the text's tokens (the positions of the sentences' spans)."""

    attention: SentenceAttention
    receivers: ReceiverHeads
    suppression: SuppressionResult | None = None
    tokens: tuple[str, ...] = ()

    def to_frame(self) -> pd.DataFrame:
        """The receiver heads, ranked (the sentence matrix: ``attention.to_frame()``; suppression:
        ``suppression.to_frame()``)."""
        return self.receivers.to_frame()

    def to_json(self, top: int = 10) -> dict[str, Any]:
        sentences = self.attention.sentences
        receivers = self.receivers
        best = receivers.ranked(1)
        vertical = None
        if best:  # the strongest receiver's vertical scores, per sentence
            layer, head = receivers.layers.index(best[0][0]), receivers.heads.index(best[0][1])
            vertical = [None if np.isnan(v) else round(float(v), 6) for v in receivers.vertical[layer, head]]
        return {**self.attention.to_json(), "proximity": receivers.proximity,
                "parts": [sentences.part(i) for i in range(len(sentences))],
                "receiver_heads": [{"layer": layer, "head": head, "kurtosis": None if np.isnan(k) else round(k, 4)}
                                   for layer, head, k in receivers.ranked(top)],
                "top_receiver_vertical_scores": vertical,
                "suppression": None if self.suppression is None else self.suppression.to_json()}


def sentence_report(model: LoadedModel | str, source: str | AttentionRecord | GenerationRecord, *,
                    proximity: int = PROXIMITY, suppress: bool | Sequence[int] = False, chunk: int = 256,
                    max_length: int | None = None, progress: bool = False) -> SentenceReport:
    """Sentence attention, receiver heads and (``suppress``: every sentence, or these 0-indexed ones) attention
    suppression of a text (a planned capture: bounded memory at any length) or of a record (a generation's kept
    rows, or a full record's matrix)."""
    loaded = as_loaded(model)
    if proximity < 1:
        raise AttnscopeError(f"proximity must be at least 1 (1: every later sentence), got {proximity}")
    which = None if isinstance(suppress, bool) else list(suppress)
    if suppress is not False:  # every premise before the slow work
        check_decoder(loaded)
    if isinstance(source, str):
        sentences = text_sentences(loaded, source, max_length)
        chosen_sentences(sentences, which)
        record: AttentionRecord | GenerationRecord = sentence_record(loaded, source, sentences, chunk=chunk,
                                                                     max_length=max_length, progress=progress)
        attention = sentence_attention(record, sentences)
    else:
        record, attention = source, sentence_attention(source)
        chosen_sentences(attention.sentences, which)
    suppression = None
    if suppress is not False:
        suppression = sentence_suppression(loaded, record, sentences=attention.sentences, which=which,
                                           progress=progress)
    return SentenceReport(attention, attention.receiver_heads(proximity), suppression, tuple(record.tokens))
