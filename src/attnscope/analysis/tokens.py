"""What the analyses need to know about the tokens of one record: token types, sentences, repeats.

Every array has one entry per position; the same positions index queries and keys
(``q_pos``/``k_pos``), so masks over pairs of positions are ``[q_pos, k_pos]``.

Definitions used by every statistic and pattern (documented once, here):

* ``[CLS]`` = the special token(s) at the start of the input (``[CLS]``, ``<s>``, a BOS token);
  ``[SEP]`` = every other special token (``[SEP]``, ``</s>``).
* punctuation = the tokens ``.`` and ``,`` (Clark et al. 2019 measure these two).
* same word = two positions in *different* words whose lowercased word forms are equal (word
  pieces are joined into words first, so ``straw ##berries`` is the word ``strawberries``); words
  without a letter or digit and special tokens never count. This finds repeated words, not related
  ones: Vig's "same or related word" is detected through its "same" half.
* sentences come from ``record.sentence_ids`` (specials join the sentence they close).
* causal models: a query may only see keys at or before it (``allowed``), and the first position
  is the *attention sink* (Xiao et al. 2023): heads park attention there whatever its token is, so
  it counts only as itself (``sink``) and never as another occurrence of a word ("The" at position
  0 is not what a later "the" looks for). Bidirectional models have no sink position.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..records.attention import AttentionRecord, join_pieces, word_groups

PUNCTUATION = frozenset({".", ","})
_SPACE_MARKS = "\u2581\u0120 "  # sentencepiece "▁", byte-level "Ġ", a decoded leading space
_HAS_WORD = re.compile(r"\w")


@dataclass(frozen=True, eq=False)
class TokenContext:
    """Token facts of one input, as boolean/int arrays over positions ``[pos]``."""

    tokens: tuple[str, ...]
    special: np.ndarray  # [pos] bool
    sentence: np.ndarray  # [pos] int, 0 or 1
    word: np.ndarray  # [pos] int, word index (-1 for specials)
    word_form: tuple[str, ...]  # [pos] lowercased word each position belongs to ("" if it never counts)
    causal: bool

    @property
    def n(self) -> int:
        return len(self.tokens)

    @cached_property
    def cls(self) -> np.ndarray:
        """[pos] bool: the leading run of special tokens."""
        leading = np.cumprod(self.special.astype(np.int8)).astype(bool)
        return leading

    @cached_property
    def sep(self) -> np.ndarray:
        """[pos] bool: special tokens that are not leading."""
        return self.special & ~self.cls

    @cached_property
    def punct(self) -> np.ndarray:
        """[pos] bool: ``.`` and ``,`` tokens."""
        return np.array([not s and t.strip(_SPACE_MARKS) in PUNCTUATION for t, s in zip(self.tokens, self.special)])

    @cached_property
    def allowed(self) -> np.ndarray:
        """[q_pos, k_pos] bool: keys a query can see (lower triangle for causal models)."""
        full = np.ones((self.n, self.n), dtype=bool)
        return np.tril(full) if self.causal else full

    @cached_property
    def sink(self) -> np.ndarray:
        """[pos] bool: the first position of a causal model (the attention sink); none for bidirectional models."""
        first = np.zeros(self.n, dtype=bool)
        first[:1] = self.causal
        return first

    @cached_property
    def same_sentence(self) -> np.ndarray:
        """[q_pos, k_pos] bool."""
        return self.sentence[:, None] == self.sentence[None, :]

    @cached_property
    def same_word(self) -> np.ndarray:
        """[q_pos, k_pos] bool: the key is another occurrence of the query's word (see module doc)."""
        forms = np.array(self.word_form, dtype=object)
        counted = forms != ""
        equal = (forms[:, None] == forms[None, :]) & counted[:, None] & counted[None, :]
        return equal & (self.word[:, None] != self.word[None, :]) & self.allowed & ~self.sink[None, :]

    @cached_property
    def same_word_other_sentence(self) -> np.ndarray:
        """[q_pos, k_pos] bool: another occurrence of the query's word, in the other sentence."""
        return self.same_word & ~self.same_sentence

    @property
    def is_pair(self) -> bool:
        return bool(self.sentence.max() > self.sentence.min())


def _word_form(word: str) -> str:
    form = word.strip(_SPACE_MARKS).lower()
    return form if _HAS_WORD.search(form) else ""


def token_context(record: AttentionRecord) -> TokenContext:
    """The :class:`TokenContext` of a record's input side (token or word level)."""
    word_ids = np.asarray(record.word_ids)
    groups = word_groups(word_ids)
    words = join_pieces(record.tokens, groups)
    forms = [""] * len(record.tokens)
    special = np.asarray(record.special_mask, dtype=bool)
    for group, word in zip(groups, words):
        if not special[group[0]]:
            for position in group:
                forms[position] = _word_form(word)
    group_of = np.empty(len(record.tokens), dtype=np.int64)
    for index, group in enumerate(groups):
        group_of[group] = index
    return TokenContext(
        tokens=tuple(record.tokens),
        special=special,
        sentence=np.asarray(record.sentence_ids, dtype=np.int64),
        word=np.where(special, -1, group_of),
        word_form=tuple(forms),
        causal=bool(record.model.causal),
    )
