"""Small built-in tasks for asking what heads do to a prediction: prompts with a target next token.

* :func:`ioi_pairs`: indirect-object identification (Wang et al. 2022) from templates: "When Mary
  and John went to the store, John gave a drink to" -> " Mary"; its corrupted twin names a third
  person as the giver (for activation patching), the other token is the repeated name.
* :func:`brown_next_tokens`: sentences of the repository's Brown Corpus sample cut before their
  last word; the target is that word's first token (what the text really says next);
  :func:`brown_patch_pairs` pairs two of them of one token length for patching.

The first two keep only prompts whose tokens fit the model's tokenizer as the task needs (one-token names,
clean and corrupted prompts of one length), so they work on any causal LM's tokenizer.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from ..capture.generate import prompt_ids
from ..data import brown_sentences
from ..errors import AttnscopeError
from ..models.loading import LoadedModel
from .patching import PromptPair

NAMES = (" Mary", " John", " Tom", " Anna", " Paul", " Sarah", " David", " Kate", " James", " Emma", " Peter", " Lucy")
PLACES = (" store", " park", " school", " beach", " office")
IOI_TEMPLATE = "When{a} and{b} went to the{place},{giver} gave a drink to"
SPACE_MARKERS = ("\u0120", "\u2581")  # GPT-2 byte-level BPE's and SentencePiece's "a space before"
BROWN_MAX_TOKENS = 20  # a sentence's first tokens: some context, and cheap to patch head by head


@dataclass(frozen=True)
class NextToken:
    """A prompt (token ids) and the token that follows it (the target)."""

    ids: tuple[int, ...]
    target: int
    text: str


def ioi_pairs(loaded: LoadedModel, n: int, seed: int = 0) -> list[PromptPair]:
    """``n`` indirect-object pairs: the clean prompt names the giver B, the corrupted one a third person C;
    target A (the indirect object), other B. Names drawn from :data:`NAMES` that are one token each, in a
    seeded order (the same pairs every run); only pairs whose prompts have equal token lengths."""
    tokenizer = loaded.tokenizer
    single = [name for name in NAMES if len(tokenizer(name, add_special_tokens=False)["input_ids"]) == 1]
    triples = list(itertools.permutations(single, 3))
    random.Random(seed).shuffle(triples)
    pairs = []
    for index, (a, b, c) in enumerate(triples):
        place = PLACES[index % len(PLACES)]
        clean = IOI_TEMPLATE.format(a=a, b=b, place=place, giver=b)
        corrupt = IOI_TEMPLATE.format(a=a, b=b, place=place, giver=c)
        if len(tokenizer(clean)["input_ids"]) == len(tokenizer(corrupt)["input_ids"]):
            pairs.append(PromptPair(clean, corrupt, a, b))
        if len(pairs) == n:
            return pairs
    raise AttnscopeError(f"only {len(pairs)} indirect-object pairs fit {loaded.name}'s tokenizer ({n} asked for)")


def ioi_next_tokens(loaded: LoadedModel, n: int, seed: int = 0) -> list[NextToken]:
    """The clean prompts of :func:`ioi_pairs` with their targets (the indirect object)."""
    tokenizer = loaded.tokenizer
    return [NextToken(tuple(prompt_ids(loaded, pair.clean, chat=False)),
                      int(tokenizer(str(pair.target), add_special_tokens=False)["input_ids"][0]), pair.clean)
            for pair in ioi_pairs(loaded, n, seed)]


def brown_next_tokens(loaded: LoadedModel, n: int) -> list[NextToken]:
    """``n`` Brown sentences (the sample's order, a random draw) cut to their first
    :data:`BROWN_MAX_TOKENS` tokens and then before the last token that starts a word of letters (at
    position 4 or later); the target is that token. Sentences without one are skipped."""
    tokenizer = loaded.tokenizer
    found: list[NextToken] = []
    for sentence in brown_sentences():
        ids = prompt_ids(loaded, sentence, chat=False)[:BROWN_MAX_TOKENS]
        pieces = tokenizer.convert_ids_to_tokens(ids)
        marked = any(piece.startswith(SPACE_MARKERS) for piece in pieces)
        starts = [p for p in range(4, len(ids)) if _starts_a_word(pieces[p], marked)]
        if starts:
            cut = starts[-1]
            found.append(NextToken(tuple(ids[:cut]), int(ids[cut]), str(tokenizer.decode(ids[:cut]))))
        if len(found) == n:
            return found
    raise AttnscopeError(f"only {len(found)} Brown sentences give a next word for {loaded.name} ({n} asked for)")


def brown_patch_pairs(loaded: LoadedModel, n: int) -> list[PromptPair]:
    """``n`` patching pairs from :func:`brown_next_tokens`: two Brown prompts of one token length (the earlier one
    clean, target its next word; the later corrupted, other its next word; pairs whose next words are the same
    token are skipped). The corruption replaces the whole context, as resampling from another text does."""
    waiting: dict[int, NextToken] = {}
    pairs: list[PromptPair] = []
    for item in brown_next_tokens(loaded, max(8 * n, 40)):
        length = len(prompt_ids(loaded, item.text, chat=False))  # as the pair will be encoded
        first = waiting.pop(length, None)
        if first is None or first.target == item.target:
            waiting[length] = item
            continue
        pairs.append(PromptPair(first.text, item.text, first.target, item.target))
        if len(pairs) == n:
            return pairs
    raise AttnscopeError(f"only {len(pairs)} Brown prompt pairs of equal token length for {loaded.name} ({n} asked "
                         "for)")


def _starts_a_word(piece: str, marked: bool) -> bool:
    """A token that begins a new word of letters: with space markers (``marked``: GPT-2's Ġ,
    SentencePiece's ▁), a marker then letters; in WordPiece (no markers), letters (continuations
    start with ##)."""
    if marked:
        return piece.startswith(SPACE_MARKERS) and piece[1:].isalpha()
    return piece.isalpha()
