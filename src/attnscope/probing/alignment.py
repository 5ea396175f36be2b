"""Treebank words <-> a model's word pieces, through character offsets; word-level attention.

The model reads each sentence's text as any user's text would be read. Every word piece is
assigned to the treebank word its character span overlaps (the first such word when it overlaps
several). Word-level attention follows Clark et al. 2019: attention *to* a word is the sum over
its pieces, attention *from* a word the mean over its pieces; special tokens and pieces that
belong to no word are left out. Nothing is dropped silently: every mismatch is counted by kind
(:data:`MISMATCH_KINDS`), and words without a piece are marked unaligned so that the probes skip
them and count the arcs they lose.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..errors import AttnscopeError
from ..records.attention import AttentionRecord, aggregate_to_words

MISMATCH_KINDS = {
    "piece_spans_words": "word pieces that overlap two or more words (given to the first)",
    "word_without_piece": "words that no word piece overlaps (left out of every score)",
    "multiword_token_part": "words after the first of a multiword token such as UD's do+n't (left out)",
    "truncated_word": "words cut off by the model's length limit (left out)",
    "piece_outside_words": "non-special word pieces that overlap no word (e.g. lone space pieces; left out)",
}


class WordSpans(Protocol):
    """Anything with a ``text`` and one ``(start, end)`` character span per word in it."""

    @property
    def text(self) -> str: ...

    @property
    def spans(self) -> tuple[tuple[int, int], ...]: ...


@dataclass(frozen=True)
class WordAlignment:
    """``groups[w]``: the token positions of word ``w`` (empty when the word has none)."""

    groups: tuple[tuple[int, ...], ...]
    mismatches: Counter[str] = field(default_factory=Counter)

    @property
    def aligned(self) -> np.ndarray:
        """``[word]`` bool: the word has at least one piece."""
        return np.array([bool(group) for group in self.groups], dtype=bool)


def align_words(spans: Sequence[tuple[int, int]], offsets: Sequence[tuple[int, int]],
                special: Sequence[bool], truncated: bool = False) -> WordAlignment:
    """Assign token positions to words by character overlap and count every mismatch.

    ``spans``: ``[word]`` character spans; ``offsets``: ``[token]`` character spans from the
    tokenizer; ``special``: ``[token]`` True for [CLS]/[SEP]/<s>... ``truncated``: the model
    saw only the tokens given, so words after the last one are "truncated", not "without piece".

    >>> align_words([(0, 3), (4, 9)], [(0, 0), (0, 3), (4, 6), (6, 9), (0, 0)], [1, 0, 0, 0, 1]).groups
    ((1,), (2, 3))
    """
    groups: list[list[int]] = [[] for _ in spans]
    mismatches: Counter[str] = Counter()
    for position, ((start, end), is_special) in enumerate(zip(offsets, special)):
        if is_special:
            continue
        overlapping = [w for w, (w_start, w_end) in enumerate(spans) if max(start, w_start) < min(end, w_end)]
        if not overlapping:
            if start < end:  # empty pieces carry no text at all
                mismatches["piece_outside_words"] += 1
            continue
        if len({spans[w] for w in overlapping}) > 1:
            mismatches["piece_spans_words"] += 1
        groups[overlapping[0]].append(position)
    last_end = max((end for (_, end), s in zip(offsets, special) if not s), default=0)
    for word, group in enumerate(groups):
        if group:
            continue
        if word > 0 and spans[word] == spans[word - 1]:
            mismatches["multiword_token_part"] += 1
        elif truncated and spans[word][0] >= last_end:
            mismatches["truncated_word"] += 1
        else:
            mismatches["word_without_piece"] += 1
    return WordAlignment(tuple(tuple(g) for g in groups), mismatches)


def word_attention(attention: np.ndarray, alignment: WordAlignment,
                   rows: Sequence[int] | None = None) -> np.ndarray:
    """``[layer, head, q_tok, k_tok]`` -> ``[layer, head, q_word, k_word]`` over the treebank's words.

    Sum over the attended word's pieces, mean over the attending word's pieces; rows and columns
    of unaligned words are 0 (check :attr:`WordAlignment.aligned`). With ``rows``, only those
    attending words: ``[layer, head, len(rows), k_word]`` (a long window needs a few rows only).
    """
    n_layers, n_heads = attention.shape[:2]
    n_words = len(alignment.groups)
    wanted = np.arange(n_words) if rows is None else np.asarray(rows, dtype=np.int64)
    result = np.zeros((n_layers, n_heads, len(wanted), n_words), dtype=np.float32)
    aligned = np.flatnonzero(alignment.aligned)
    kept_rows = np.flatnonzero(alignment.aligned[wanted]) if len(wanted) else wanted
    if aligned.size and kept_rows.size:
        queries = [list(alignment.groups[w]) for w in wanted[kept_rows]]
        keys = [list(alignment.groups[w]) for w in aligned]
        result[:, :, kept_rows[:, None], aligned[None, :]] = aggregate_to_words(attention, queries, keys)
    return result


@dataclass(frozen=True)
class AlignedSentence:
    """One sentence's word-level attention ``[layer, head, word, word]`` and which words have pieces."""

    words: Any  # the Sentence (or coreference item) the words come from
    attention: np.ndarray
    aligned: np.ndarray
    truncated: bool = False  # the model's limit cut the text: some words were never seen

    def most_attended(self) -> np.ndarray:
        """``[layer, head, word]``: the word each word attends to most among aligned words (specials excluded)."""
        masked = np.where(self.aligned[None, None, None, :], self.attention, -np.inf)
        return masked.argmax(axis=-1)


class MismatchTally:
    """Counts of alignment mismatches over a corpus, by kind, plus sentences touched."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.sentences = 0
        self.sentences_with_mismatch = 0
        self.words = 0
        self.unaligned_words = 0

    def add(self, alignment: WordAlignment) -> None:
        self.counts.update(alignment.mismatches)
        self.sentences += 1
        self.sentences_with_mismatch += any(alignment.mismatches.values())
        self.words += len(alignment.groups)
        self.unaligned_words += int((~alignment.aligned).sum())

    def to_dict(self) -> dict[str, int]:
        return {"sentences": self.sentences, "sentences_with_mismatch": self.sentences_with_mismatch,
                "words": self.words, "unaligned_words": self.unaligned_words,
                **{kind: self.counts.get(kind, 0) for kind in MISMATCH_KINDS}}


def token_offsets(tokenizer: Any, text: str, token_ids: np.ndarray) -> tuple[list[tuple[int, int]], list[bool], bool]:
    """Character offsets and special flags of the tokens the model saw; True when it saw fewer than all."""
    if not getattr(tokenizer, "is_fast", False):
        raise AttnscopeError("aligning treebank words needs a fast tokenizer (character offsets); this model's is slow")
    encoding = tokenizer(text, return_offsets_mapping=True, return_special_tokens_mask=True)
    seen = [int(i) for i in token_ids]
    truncated = len(seen) < len(encoding["input_ids"])
    if truncated:  # the model's length limit cut the text: cut it the same way
        encoding = tokenizer(text, return_offsets_mapping=True, return_special_tokens_mask=True, truncation=True,
                             max_length=len(seen))
    ids = list(encoding["input_ids"])
    if ids != seen:
        raise AttnscopeError("the tokenizer gives different tokens than the model saw; cannot align words")
    return [tuple(o) for o in encoding["offset_mapping"]], [bool(s) for s in encoding["special_tokens_mask"]], truncated


def attend_words(loaded: Any, items: Sequence[WordSpans], *, batch_size: int = 16, progress: bool = True,
                 tally: MismatchTally | None = None,
                 rows: Callable[[Any], Sequence[int]] | None = None) -> Iterator[AlignedSentence]:
    """Run the model over each item's text and yield its word-level attention, in order.

    ``loaded`` is a :class:`~attnscope.models.loading.LoadedModel`; for encoder-decoders the
    encoder's attention is used (the text is given as its own target so nothing is generated).
    Mismatches are added to ``tally`` when one is given. ``rows(item)``: the attending words to
    keep (default: all; see :func:`word_attention`).
    """
    from ..capture.extract import extract_corpus

    inputs: Iterable[Any] = [(item.text, item.text) if loaded.is_encoder_decoder else item.text for item in items]
    records = extract_corpus(loaded, inputs, batch_size=batch_size, progress=progress, total=len(items))
    for item, record in zip(items, records):
        yield align_record(loaded.tokenizer, item, record, tally, None if rows is None else rows(item))


def align_record(tokenizer: Any, item: WordSpans, record: AttentionRecord, tally: MismatchTally | None = None,
                 rows: Sequence[int] | None = None) -> AlignedSentence:
    """One record's attention at the level of ``item``'s words (only the attending words ``rows`` if given)."""
    offsets, special, truncated = token_offsets(tokenizer, item.text, record.token_ids)
    alignment = align_words(item.spans, offsets, special, truncated)
    if tally is not None:
        tally.add(alignment)
    return AlignedSentence(item, word_attention(record.attention, alignment, rows), alignment.aligned, truncated)


def word_token_counts(tokenizer: Any, text: str, spans: Sequence[tuple[int, int]]) -> list[int]:
    """``[word]``: how many of the tokenizer's pieces each word gets in ``text`` (no special tokens, no limit)."""
    encoding = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False, verbose=False)
    offsets = [tuple(o) for o in encoding["offset_mapping"]]
    alignment = align_words(spans, offsets, [False] * len(offsets))
    return [len(group) for group in alignment.groups]
