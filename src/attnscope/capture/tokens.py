"""Turn one text (or sentence pair, or source/target pair) into token-level inputs with alignment."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import AttnscopeError

Item = str | tuple[str, str | None]
"""One input: a text, or ``(text, second)`` where second is the pair's second sentence
(encoders, decoders) or the target text (encoder-decoders; None = generate it)."""


@dataclass(frozen=True)
class Side:
    """One token sequence with its alignment; every list has one entry per token."""

    input_ids: list[int]
    tokens: tuple[str, ...]
    special_mask: list[bool]
    sentence_ids: list[int]
    word_ids: list[int]
    token_type_ids: list[int] | None = None


@dataclass(frozen=True)
class Encoded:
    """A tokenized item: the input side and, for encoder-decoders, the decoder's input side."""

    index: int
    text: tuple[str, ...]
    source: Side
    target: Side | None = None

    @property
    def length(self) -> int:
        return len(self.source.input_ids) + (len(self.target.input_ids) if self.target else 0)


def split_item(item: Item, index: int) -> tuple[str, str | None]:
    """Validate an item and return ``(first, second)``; empty text is an error naming the item."""
    first, second = (item, None) if isinstance(item, str) else (item[0], item[1] if len(item) > 1 else None)
    if not isinstance(first, str) or not first.strip():
        raise AttnscopeError(f"input {index}: text is empty")
    if second is not None and (not isinstance(second, str) or not second.strip()):
        raise AttnscopeError(f"input {index}: second text is empty")
    return first, second


def readable_tokens(tokenizer: Any, ids: list[int]) -> tuple[str, ...]:
    """Tokens as a person reads them: WordPiece keeps ``##berries``; byte-level BPE and
    sentencepiece pieces are decoded one by one (``Ġstore`` -> `` store``, ``▁Haus`` -> ``Haus``)."""
    raw = tokenizer.convert_ids_to_tokens(ids)
    if not any(("Ġ" in t or "▁" in t or "Ċ" in t) for t in raw if t):
        return tuple(raw)
    return tuple(tokenizer.decode([i], clean_up_tokenization_spaces=False) or t for i, t in zip(ids, raw))


def guess_word_ids(tokens: tuple[str, ...], special: list[bool]) -> list[int]:
    """Word index per token from the pieces' own marks, for tokenizers without ``word_ids()``.

    Specials get -1. With WordPiece, every piece but a ``##`` continuation starts a word. With
    space markers (``▁``, ``Ġ``, or a leading space once decoded), a piece starts a word when it
    carries the marker, follows a special token, or is or follows punctuation.

    >>> guess_word_ids(("<s>", "▁Ich", "▁esse", "▁Äpf", "el", "."), [True] + [False] * 5)
    [-1, 0, 1, 2, 2, 3]
    """
    marked = any(t[:1] in _SPACE_MARKS for t, s in zip(tokens, special) if t and not s)
    word_ids, word, previous = [], -1, None
    for token, is_special in zip(tokens, special):
        if is_special:
            word_ids.append(-1)
            previous = None
            continue
        if marked:
            starts = previous is None or token[:1] in _SPACE_MARKS or _is_punct(token) or _is_punct(previous)
        else:
            starts = previous is None or not token.startswith("##")
        word += int(starts)
        word_ids.append(word)
        previous = token
    return word_ids


_SPACE_MARKS = (" ", "▁", "Ġ")


def _is_punct(token: str) -> bool:
    stripped = token.lstrip("".join(_SPACE_MARKS))
    return bool(stripped) and not any(c.isalnum() for c in stripped)


def _sentence_ids(sequence_ids: list[int | None], token_type_ids: list[int] | None, has_pair: bool) -> list[int]:
    """0/1 per token; special tokens join the sentence they close (the one before them)."""
    if not has_pair:
        return [0] * len(sequence_ids)
    if token_type_ids is not None and any(token_type_ids):
        return list(token_type_ids)
    result, current = [], 0
    for sequence in sequence_ids:
        current = sequence if sequence is not None else current
        result.append(current)
    return result


def _global_word_ids(word_ids: list[int | None], sequence_ids: list[int | None]) -> list[int]:
    """Number words across both sentences of a pair (the tokenizer restarts at 0 for the second)."""
    first_count = 1 + max((w for w, s in zip(word_ids, sequence_ids) if w is not None and s == 0), default=-1)
    return [-1 if w is None else w + (first_count if s == 1 else 0) for w, s in zip(word_ids, sequence_ids)]


def encode_sides(tokenizer: Any, texts: list[tuple[str, str | None]], max_length: int,
                 indices: list[int], model_limit: int | None = None) -> list[Side]:
    """Tokenize many inputs with alignment, in one tokenizer call for the single texts and one for
    the pairs. Inputs over ``max_length`` tokens are truncated with a warning naming them and the
    limit (the model's own ``model_limit``, or a lower one the user chose)."""
    sides: dict[int, Side] = {}
    for has_pair in (False, True):
        rows = [i for i, (_, second) in enumerate(texts) if (second is not None) == has_pair]
        if not rows:
            continue
        seconds = [texts[i][1] for i in rows] if has_pair else None
        encoding = tokenizer([texts[i][0] for i in rows], seconds, return_special_tokens_mask=True)
        for row, i in enumerate(rows):
            length = len(encoding["input_ids"][row])
            if length > max_length:
                warn_truncated(f"input {indices[i]}", length, max_length, model_limit)
                truncated = tokenizer([texts[i][0]], None if seconds is None else [texts[i][1]],
                                      return_special_tokens_mask=True, truncation=True, max_length=max_length)
                sides[i] = _side(tokenizer, truncated, 0, has_pair)
            else:
                sides[i] = _side(tokenizer, encoding, row, has_pair)
    return [sides[i] for i in range(len(texts))]


class TruncationWarning(UserWarning):
    """An input was cut to the length limit (pages drawn from it say so)."""


def warn_truncated(what: str, length: int, limit: int, model_limit: int | None = None) -> None:
    """Long inputs are cut, never silently: one warning naming the input and the limit, and whose it is
    (the model's own ``model_limit``, or a lower one the user chose)."""
    why = "the model's limit" if model_limit in (None, limit) else f"chosen; the model takes up to {model_limit}"
    warnings.warn(f"{what}: {length} tokens, truncated to {limit} ({why})", TruncationWarning, stacklevel=3)


def ids_within(tokenizer: Any, texts: list[str], limit: int, what: str, *, target: bool = False) -> list[list[int]]:
    """Token ids of each text (of the decoder's target text with ``target``), cut to ``limit`` tokens
    with a warning naming ``what`` (and the text's position when there are several)."""
    key = "text_target" if target else "text"
    whole = tokenizer(**{key: texts}, verbose=False)["input_ids"]  # our warning replaces transformers' own
    if all(len(ids) <= limit for ids in whole):
        return [list(ids) for ids in whole]
    cut = tokenizer(**{key: texts}, truncation=True, max_length=limit)["input_ids"]
    for index, (full, kept) in enumerate(zip(whole, cut)):
        if len(full) > len(kept):
            warn_truncated(what if len(texts) == 1 else f"{what} {index}", len(full), limit)
    return [list(ids) for ids in cut]


def encode_side(tokenizer: Any, first: str, second: str | None, max_length: int, index: int,
                model_limit: int | None = None) -> Side:
    """One input's :func:`encode_sides`."""
    return encode_sides(tokenizer, [(first, second)], max_length, [index], model_limit)[0]


def _side(tokenizer: Any, encoding: Any, row: int, has_pair: bool) -> Side:
    """Row ``row`` of a batched encoding as a :class:`Side`."""
    ids = list(encoding["input_ids"][row])
    special = [bool(s) for s in encoding["special_tokens_mask"][row]]
    tokens = readable_tokens(tokenizer, ids)
    token_type_ids = encoding["token_type_ids"][row] if "token_type_ids" in encoding else None
    try:
        sequence_ids = encoding.sequence_ids(row)
        word_ids = _global_word_ids(encoding.word_ids(row), sequence_ids)
    except (ValueError, AttributeError):  # slow tokenizers have no alignment
        sequence_ids = [0] * len(ids)
        word_ids = guess_word_ids(tokens, special)
    word_ids = [-1 if s else w for w, s in zip(word_ids, special)]
    return Side(ids, tokens, special, _sentence_ids(sequence_ids, token_type_ids, has_pair), word_ids,
                None if token_type_ids is None else list(token_type_ids))


def target_side(tokenizer: Any, decoder_ids: list[int], decoder_start_id: int | None) -> Side:
    """The decoder's input side (teacher forcing) from its token ids."""
    special_ids = set(tokenizer.all_special_ids) | ({decoder_start_id} if decoder_start_id is not None else set())
    special = [i in special_ids for i in decoder_ids]
    tokens = readable_tokens(tokenizer, decoder_ids)
    return Side(list(decoder_ids), tokens, special, [0] * len(decoder_ids), guess_word_ids(tokens, special))


def ids_side(tokenizer: Any, ids: list[int]) -> Side:
    """A :class:`Side` of token ``ids`` as given (no tokenizer pass: random-token tasks): one sentence, special
    tokens marked by the tokenizer's own list, words guessed from the readable tokens."""
    special_ids = set(getattr(tokenizer, "all_special_ids", ()) or ())
    tokens = readable_tokens(tokenizer, ids)
    special = [i in special_ids for i in ids]
    return Side(list(ids), tokens, special, [0] * len(ids), guess_word_ids(tokens, special))


def side_arrays(prefix: str, side: Side) -> dict[str, Any]:
    """A record's token arrays of one side: ``<prefix>.token_ids``, ``.special_mask``, ``.sentence_ids``, ``.word_ids``."""
    return {
        f"{prefix}.token_ids": np.array(side.input_ids, dtype=np.int64),
        f"{prefix}.special_mask": np.array(side.special_mask, dtype=bool),
        f"{prefix}.sentence_ids": np.array(side.sentence_ids, dtype=np.int64),
        f"{prefix}.word_ids": np.array(side.word_ids, dtype=np.int64),
    }
