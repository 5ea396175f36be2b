"""Whole documents with gold coreference: CorefUD ``Entity=`` brackets (as GUM writes them) -> mentions and chains.

In MISC, ``Entity=`` holds brackets over words: ``(5-person-new-...`` opens a mention of entity
``5`` on this word (the first field is the entity id, the others are the file's attributes, see
its ``# global.Entity``), ``5)`` closes the latest open mention of entity ``5``, ``(5-person...)``
is a one-word mention. Several brackets follow each other without separator
(``(2-abstract-...)17)``); mentions nest. A discontinuous mention is written in parts,
``(5[1/2-...`` ... ``5[1/2])`` ... ``(5[2/2-...`` ... ``5[2/2])``: its words are the union of the
parts. A mention's *head word* is the word of the mention whose syntactic head (basic UD tree) is
outside the mention (the first such word). Word positions are 0-indexed over the document.
Brackets that never close, or close what was never opened, are counted, not fatal.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import AttnscopeError
from .treebank import ROOT, Sentence, Treebank

PART = re.compile(r"^(?P<eid>.*?)(?:\[(?P<part>\d+)/(?P<parts>\d+)\])?$")


@dataclass(frozen=True)
class Bracket:
    """One bracket of an ``Entity=`` value: ``kind`` is "open", "close" or "single"."""

    kind: str
    eid: str
    part: tuple[int, int] | None = None  # (k, n) of a discontinuous mention's part k of n
    attributes: str = ""


def parse_entity_field(value: str) -> list[Bracket]:
    """The brackets of one word's ``Entity=`` value, in order.

    >>> [(b.kind, b.eid) for b in parse_entity_field("(2-abstract-new)17)(4-place")]
    [('single', '2'), ('close', '17'), ('open', '4')]
    """
    brackets, position = [], 0
    while position < len(value):
        if value[position] == "(":
            end = _next_bracket(value, position + 1)
            body = value[position + 1:end]
            single = end < len(value) and value[end] == ")"
            eid, _, attributes = body.partition("-")
            brackets.append(_bracket("single" if single else "open", eid, attributes, value))
            position = end + 1 if single else end
        else:
            end = value.find(")", position)
            if end < 0:
                raise AttnscopeError(f"Entity={value!r}: text after the last bracket is neither '(' nor 'id)'")
            brackets.append(_bracket("close", value[position:end], "", value))
            position = end + 1
    return brackets


def _next_bracket(value: str, start: int) -> int:
    found = [i for i in (value.find("(", start), value.find(")", start)) if i >= 0]
    return min(found) if found else len(value)


def _bracket(kind: str, eid: str, attributes: str, value: str) -> Bracket:
    match = PART.match(eid)
    if match is None or not match.group("eid"):
        raise AttnscopeError(f"Entity={value!r}: a bracket without an entity id")
    part = (int(match.group("part")), int(match.group("parts"))) if match.group("part") else None
    return Bracket(kind, match.group("eid"), part, attributes)


@dataclass(frozen=True)
class Mention:
    """A gold mention: its entity (chain), its words and head word (document positions, 0-indexed)."""

    entity: str
    words: tuple[int, ...]
    head: int
    attributes: str = ""


@dataclass(frozen=True)
class Document:
    """One ``# newdoc``: its sentences as one text (joined by a space), every word's span in it,
    and its mentions in order of their head word."""

    id: str
    sentences: tuple[Sentence, ...]
    text: str
    spans: tuple[tuple[int, int], ...]
    words: tuple[str, ...]
    heads: tuple[int, ...]  # document position of each word's syntactic head (-1: a root)
    feats: tuple[str, ...]
    mentions: tuple[Mention, ...]
    problems: Counter[str] = field(default_factory=Counter)

    def chain_sizes(self) -> Counter[str]:
        return Counter(mention.entity for mention in self.mentions)


def documents_of(treebank: Treebank) -> list[Document]:
    """The treebank's documents (consecutive sentences with one ``# newdoc id``), with their mentions."""
    groups: list[list[Sentence]] = []
    for sentence in treebank.sentences:
        if not groups or sentence.doc_id != groups[-1][0].doc_id:
            groups.append([])
        groups[-1].append(sentence)
    return [document_from(group) for group in groups]


def document_from(sentences: Sequence[Sentence]) -> Document:
    """One document: the sentences' words at document positions, and the mentions their brackets make."""
    text_parts: list[str] = []
    spans: list[tuple[int, int]] = []
    words: list[str] = []
    heads: list[int] = []
    feats: list[str] = []
    entities: list[str] = []
    start = 0
    for sentence in sentences:
        first = len(words)
        spans += [(start + a, start + b) for a, b in sentence.spans]
        words += sentence.words
        heads += [ROOT if head == ROOT else first + head for head in sentence.heads]
        feats += sentence.feats or ("_",) * len(sentence)
        entities += sentence.entities or ("",) * len(sentence)
        text_parts.append(sentence.text)
        start += len(sentence.text) + 1
    mentions, problems = mentions_from(entities, heads)
    return Document(sentences[0].doc_id if sentences else "", tuple(sentences), " ".join(text_parts), tuple(spans),
                    tuple(words), tuple(heads), tuple(feats), tuple(mentions), problems)


def mentions_from(entities: Sequence[str], heads: Sequence[int]) -> tuple[list[Mention], Counter[str]]:
    """Mentions from per-word ``Entity=`` values (document positions), sorted by head word, and the problems met."""
    open_mentions: dict[str, list[tuple[int, tuple[int, int] | None, str]]] = {}  # eid -> stack of openings
    parts: dict[str, list[int]] = {}  # eid -> words of a discontinuous mention so far
    found: list[tuple[str, list[int], str]] = []
    problems: Counter[str] = Counter()
    for position, value in enumerate(entities):
        for bracket in parse_entity_field(value) if value else []:
            if bracket.kind == "open":
                open_mentions.setdefault(bracket.eid, []).append((position, bracket.part, bracket.attributes))
                continue
            if bracket.kind == "single":
                start, part, attributes = position, bracket.part, bracket.attributes
            elif open_mentions.get(bracket.eid):
                start, part, attributes = open_mentions[bracket.eid].pop()
            else:
                problems["closing bracket without an opening"] += 1
                continue
            span = list(range(start, position + 1))
            if part is None:
                found.append((bracket.eid, span, attributes))
                continue
            parts.setdefault(bracket.eid, []).extend(span)
            if part[0] == part[1]:  # the last part closes the discontinuous mention
                found.append((bracket.eid, sorted(set(parts.pop(bracket.eid))), attributes))
    problems["opening bracket never closed"] += sum(len(stack) for stack in open_mentions.values())
    problems["discontinuous mention never completed"] += len(parts)
    mentions = [Mention(eid, tuple(span), mention_head(span, heads), attributes) for eid, span, attributes in found]
    return sorted(mentions, key=lambda m: (m.head, m.words)), +problems


def mention_head(span: Sequence[int], heads: Sequence[int]) -> int:
    """The first word of ``span`` whose syntactic head lies outside it (or is the root).

    >>> mention_head([3, 4, 5], [-1, 0, 0, 4, 0, 4])  # "the old dog": the/old depend on dog
    4
    """
    inside = set(span)
    return next((word for word in span if heads[word] not in inside), span[0])


def require_entities(treebank: Treebank) -> Treebank:
    """``treebank``, or a clear error when no word carries an ``Entity=`` annotation (no coreference) or one
    carries a damaged value: read before the model loads, named by file, sentence and word, so that a user who gave
    two files (``--conllu`` and ``--select-on``) knows which to mend."""
    if not any(value for sentence in treebank.sentences for value in sentence.entities):
        raise AttnscopeError(f"{treebank.source} has no coreference annotation (MISC Entity=, as in GUM or CorefUD)")
    for number, sentence in enumerate(treebank.sentences, 1):
        for word, value in enumerate(sentence.entities, 1):
            try:
                parse_entity_field(value) if value else None
            except AttnscopeError as error:
                where = f"sentence {sentence.sent_id!r}" if sentence.sent_id else f"sentence {number}"
                raise AttnscopeError(f"{treebank.source}, {where}, word {word}: {error}") from None
    return treebank


def first_documents(treebank: Treebank, n: int | None) -> Treebank:
    """The sentences of the first ``n`` documents (all when ``n`` is None)."""
    if n is None:
        return treebank
    kept: list[str] = []
    for sentence in treebank.sentences:
        if sentence.doc_id not in kept:
            kept.append(sentence.doc_id)
    wanted = set(kept[:n])
    return Treebank(tuple(s for s in treebank.sentences if s.doc_id in wanted), treebank.source, treebank.silver,
                    treebank.annotation)


def feature(feats: str, name: str) -> str | None:
    """The value of ``name`` in a FEATS string (``Number=Plur|Person=3``), None when absent.

    >>> feature("Number=Plur|Person=3", "Person")
    '3'
    """
    for pair in feats.split("|"):
        key, _, value = pair.partition("=")
        if key == name:
            return value
    return None


def describe(document: Document) -> dict[str, Any]:
    """Sizes of a document, for reports."""
    sizes = document.chain_sizes()
    return {"id": document.id, "sentences": len(document.sentences), "words": len(document.words),
            "mentions": len(document.mentions), "chains": sum(1 for n in sizes.values() if n > 1)}
