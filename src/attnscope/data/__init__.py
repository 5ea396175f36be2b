"""Small text samples shipped with attnscope (sources and licences in ``README.md`` beside this file).

>>> from attnscope.data import brown_sentences
>>> len(brown_sentences())
2000
>>> brown_sentences(2)
['In the prayer Jesus taught his disciples to pray we find these words, "Forgive us our debts."', 'The latter, members of two regiments of Swiss mercenaries transported by Great Britain to Canada to fight the Americans in the War of 1812, had settled in Montreal and Kingston at the close of the war in 1815.']
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from typing import TYPE_CHECKING, Any

from ..errors import AttnscopeError

if TYPE_CHECKING:
    import pandas as pd

BROWN_SAMPLE = "brown_sample.txt"
BROWN_PAIRS = "brown_pairs.txt"
DOCUMENTS = "documents"
NEEDLES = "needles.jsonl"
HEAD_LISTS = "head_lists"

__all__ = ["BROWN_PAIRS", "BROWN_SAMPLE", "HEAD_LISTS", "NEEDLES", "Needle", "brown_pairs", "brown_sentences", "document",
           "documents", "head_list", "head_list_summary", "head_lists", "needle", "needles"]


@cache
def _brown_lines() -> tuple[str, ...]:
    text = files(__package__).joinpath(BROWN_SAMPLE).read_text(encoding="utf-8")
    return tuple(line for line in text.splitlines() if line.strip())


@cache
def _pair_lines() -> tuple[tuple[str, str], ...]:
    text = files(__package__).joinpath(BROWN_PAIRS).read_text(encoding="utf-8")
    pairs = (line.partition("\t")[::2] for line in text.splitlines())
    return tuple((first, second) for first, second in pairs if first.strip() and second.strip())


def _first(items: tuple, n: int | None, what: str) -> list:
    """The first ``n`` of ``items`` (all when None), with one clear error for a bad ``n``."""
    if n is None:
        return list(items)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise AttnscopeError(f"number of {what} must be a non-negative integer, got {n!r}")
    if n > len(items):
        raise AttnscopeError(f"the Brown {what} sample has {len(items)} {what}; {n} were asked for")
    return list(items[:n])


def brown_sentences(n: int | None = None) -> list[str]:
    """The first ``n`` (default: all 2,000) sentences of the Brown Corpus sample, one string each.

    The sample is a seeded random draw of 6-40-word sentences from all 15 genres of the Brown
    Corpus (Francis & Kučera), detokenized to plain text; its order is random, so the first ``n``
    are a random sample too. See ``scripts/derive_brown_sample.py`` for how it was made.
    """
    return _first(_brown_lines(), n, "sentences")


def brown_pairs(n: int | None = None) -> list[tuple[str, str]]:
    """The first ``n`` (default: all 500) pairs of adjacent Brown Corpus sentences, as ``(first, second)``.

    Pairs are a seeded random draw (so the first ``n`` are a random sample too); see
    ``scripts/derive_brown_pairs.py`` for how they were made.
    """
    return _first(_pair_lines(), n, "pairs")


@cache
def documents() -> tuple[str, ...]:
    """Names of the long public-domain documents shipped with attnscope (``attnscope view --file NAME``):
    the five longest State of the Union addresses (``sotu-1981-jimmy-carter``, ...) and four chapters of
    *Moby-Dick* (``moby-dick-001``, ...); sources and licence in ``documents/README.md``, derived by
    ``scripts/derive_documents.py``."""
    folder = files(__package__).joinpath(DOCUMENTS)
    return tuple(sorted(entry.name.removesuffix(".txt") for entry in folder.iterdir() if entry.name.endswith(".txt")))


def document(name: str) -> str:
    """The whole text of the shipped document ``name`` (one of :func:`documents`)."""
    if name not in documents():
        raise AttnscopeError(f"no shipped document {name!r}; the shipped documents are: {', '.join(documents())}")
    return files(__package__).joinpath(DOCUMENTS, f"{name}.txt").read_text(encoding="utf-8")


@dataclass(frozen=True)
class Needle:
    """A fact to hide in a haystack and ask back (needle-in-a-haystack trials): ``text`` is inserted, ``question``
    asks for it, ``answer_prefix`` starts a plain prompt's answer, and an answer counts when it holds ``answer``."""

    id: str
    kind: str  # "pass key" (random digits) or "sentence"
    text: str
    question: str
    answer_prefix: str
    answer: str


@cache
def needles() -> tuple[Needle, ...]:
    """The needles shipped with attnscope (``needles.jsonl``, written for attnscope: source in ``README.md``): four
    pass keys (seven random digits) and four invented sentences, each with its question and answer."""
    lines = files(__package__).joinpath(NEEDLES).read_text(encoding="utf-8").splitlines()
    items = (json.loads(line) for line in lines if line.strip())
    return tuple(Needle(item["id"], item["kind"], item["needle"], item["question"], item["answer_prefix"],
                        item["answer"]) for item in items)


def needle(needle_id: str) -> Needle:
    """The shipped needle ``needle_id`` (one of :func:`needles`)."""
    by_id = {item.id: item for item in needles()}
    if needle_id not in by_id:
        raise AttnscopeError(f"no shipped needle {needle_id!r}; the shipped needles are: {', '.join(by_id)}")
    return by_id[needle_id]


def head_lists() -> tuple[str, ...]:
    """Aliases of the models whose head-function lists ship with attnscope (``head_lists/``, made by
    ``scripts/head_lists.py``: every registered head score, on two disjoint sets of evidence; see its README)."""
    folder = files(__package__).joinpath(HEAD_LISTS)
    if not folder.is_dir():
        return ()
    return tuple(sorted(entry.name.removesuffix(".json") for entry in folder.iterdir() if entry.name.endswith(".json")))


def _check_head_list(alias: str) -> None:
    if alias not in head_lists():
        raise AttnscopeError(f"no head-function list ships for {alias!r}; lists ship for: {', '.join(head_lists())}")


def head_list(alias: str, per: str = "head") -> pd.DataFrame:
    """The shipped head-function list of ``alias``: ``per="head"``, one row per (layer, head), 0-indexed, with
    ``kv_head``, the layer's ``window`` (0: global), each score pooled over both evidence sets and each set's own
    (``<score>_a``, ``<score>_b``); ``per="kv_head"``, one row per (layer, KV head), ``<score>_max`` and
    ``<score>_mean`` over the group's query heads."""
    import pandas as pd

    _check_head_list(alias)
    if per not in ("head", "kv_head"):
        raise AttnscopeError(f"per must be 'head' or 'kv_head', got {per!r}")
    name = f"{alias}.csv" if per == "head" else f"{alias}_kv.csv"
    with files(__package__).joinpath(HEAD_LISTS, name).open("r", encoding="utf-8") as table:
        return pd.read_csv(table)


def head_list_summary(alias: str) -> dict[str, Any]:
    """What the list of ``alias`` was measured on and what it shows: the evidence sets and grid, the trials and which
    counted, each score's stability between the sets (Spearman's rho), the share of retrieval heads, the top heads,
    the date, CPU, attnscope version and licence."""
    _check_head_list(alias)
    summary: dict[str, Any] = json.loads(files(__package__).joinpath(HEAD_LISTS, f"{alias}.json").read_text("utf-8"))
    return summary
