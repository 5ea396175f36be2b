"""Coreference heads on Winograd schemas (after Clark et al. 2019, section 4.3).

Each item is a sentence, a pronoun, its gold antecedent and a wrong candidate (the antecedent of
the item's twin sentence). A head resolves the item when the pronoun attends more to the
antecedent's head word than to the wrong candidate's head word. Baselines:

* nearest mention: the candidate whose head word is closest to the pronoun;
* same head word (Clark et al.'s head-match rule): the nearest candidate whose head word is the
  pronoun's own word, falling back to the nearest mention; on pronouns it almost always falls
  back, which the result reports.

Spans are found in the sentence case-insensitively at word boundaries, trying the whole phrase,
then the phrase without its determiner, then its head word (plural allowed), then its other
words; two candidates never share words, and the pronoun is its first occurrence after both
candidates. Items whose spans cannot be found are counted by reason, never silently dropped.
Layers and heads are 0-indexed.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import AttnscopeError
from .alignment import AlignedSentence
from .dependencies import SELECTED_ON_SCORED, ScoredHeads, head_name

WINOWHY_ITEMS = "winowhy_items.jsonl"
WORD = re.compile(r"\w+(?:['’]\w+)*|[^\w\s]")
DETERMINERS = {"the", "a", "an", "some", "my", "his", "her", "its", "their", "our", "your", "this", "that"}
PREPOSITIONS = {"in", "on", "under", "of", "with", "at", "by", "from", "for", "behind", "above", "below", "near"}


@dataclass(frozen=True)
class CorefItem:
    """A sentence, its pronoun, the gold antecedent and a wrong candidate (None if it has no twin)."""

    sentence: str
    pronoun: str
    antecedent: str
    wrong: str | None
    id: int = 0


@dataclass(frozen=True)
class LocatedItem:
    """An item with its words, their character spans, and the word positions of pronoun and mention heads."""

    item: CorefItem
    words: tuple[str, ...]
    spans: tuple[tuple[int, int], ...]
    pronoun: int
    antecedent: int
    wrong: int

    @property
    def text(self) -> str:
        return self.item.sentence


@cache
def _winowhy_lines() -> tuple[str, ...]:
    return tuple(files("attnscope.data").joinpath(WINOWHY_ITEMS).read_text(encoding="utf-8").splitlines())


def winowhy_items(n: int | None = None) -> list[CorefItem]:
    """The 273 Winograd items derived from BIG-bench ``winowhy`` (see ``scripts/derive_winowhy.py``)."""
    items = []
    for line in _winowhy_lines():
        row = json.loads(line)
        items.append(CorefItem(row["sentence"], row["pronoun"], row["antecedent"], row["wrong"], row["id"]))
    return items if n is None else items[:n]


# ---- locating spans ---------------------------------------------------------------------------------
def _phrase_pattern(phrase: str, plural: bool = False) -> re.Pattern[str]:
    words = [re.escape(w) for w in phrase.split()]
    suffix = r"(?:s|es)?" if plural else ""
    return re.compile(r"(?<!\w)" + r"\s+".join(words) + suffix + r"(?!\w)", re.IGNORECASE)


def mention_head(words: Sequence[str]) -> int:
    """Index of a noun phrase's head word: the last word before its first preposition, else the last word.

    >>> mention_head(["the", "spot", "under", "the", "tree"])
    1
    """
    for index, word in enumerate(words):
        if index and word.lower() in PREPOSITIONS:
            return index - 1
    return len(words) - 1


def _search_forms(phrase: str) -> list[tuple[str, bool]]:
    """What to look for, most exact first: ``(phrase, plural allowed)``."""
    words = phrase.split()
    content = words[1:] if len(words) > 1 and words[0].lower() in DETERMINERS else words
    head = content[mention_head(content)]
    others = [w for w in reversed(content) if w != head and w.lower() not in PREPOSITIONS | DETERMINERS]
    forms = [(phrase, False), (" ".join(content), False), (head, True)] + [(w, False) for w in others]
    return list(dict.fromkeys(forms))


def _find(form: tuple[str, bool], text: str, taken: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The first match of ``form`` that overlaps no span in ``taken``."""
    for match in _phrase_pattern(*form).finditer(text):
        if all(match.end() <= start or match.start() >= end for start, end in taken):
            return match.span()
    return None


def locate_mentions(text: str, phrases: Sequence[str]) -> list[tuple[int, int] | None]:
    """Character spans of ``phrases`` in ``text``: exact forms are tried for all before looser ones."""
    forms = [_search_forms(phrase) for phrase in phrases]
    found: list[tuple[int, int] | None] = [None] * len(phrases)
    for level in range(max(len(f) for f in forms)):
        for index, phrase_forms in enumerate(forms):
            if found[index] is None and level < len(phrase_forms):
                found[index] = _find(phrase_forms[level], text, [s for s in found if s is not None])
    return found


def split_words(text: str) -> tuple[tuple[str, ...], tuple[tuple[int, int], ...]]:
    """Words (``\\w+`` with inner apostrophes, or one punctuation mark) and their character spans."""
    matches = list(WORD.finditer(text))
    return tuple(m.group() for m in matches), tuple(m.span() for m in matches)


def locate(item: CorefItem) -> LocatedItem | str:
    """The item's word positions, or the reason it cannot be located."""
    if item.wrong is None:
        return "no wrong candidate (no twin sentence)"
    antecedent, wrong = locate_mentions(item.sentence, [item.antecedent, item.wrong])
    if antecedent is None:
        return "antecedent not found"
    if wrong is None:
        return "wrong candidate not found"
    after = max(antecedent[1], wrong[1])
    pronoun = next((m.span() for m in _phrase_pattern(item.pronoun).finditer(item.sentence) if m.start() >= after),
                   None)
    if pronoun is None:
        return "pronoun not found after both candidates"
    words, spans = split_words(item.sentence)
    return LocatedItem(item, words, spans, _word_at(spans, pronoun),
                       _mention_head_word(words, spans, antecedent), _mention_head_word(words, spans, wrong))


def _word_at(spans: Sequence[tuple[int, int]], span: tuple[int, int]) -> int:
    return next(i for i, (start, end) in enumerate(spans) if start < span[1] and end > span[0])


def _mention_head_word(words: Sequence[str], spans: Sequence[tuple[int, int]], span: tuple[int, int]) -> int:
    inside = [i for i, (start, end) in enumerate(spans) if start < span[1] and end > span[0]]
    inside = [i for i in inside if words[i].lower() not in DETERMINERS] or inside
    return inside[mention_head([words[i] for i in inside])]


def locate_items(items: Iterable[CorefItem]) -> tuple[list[LocatedItem], Counter[str]]:
    """The located items and, by reason, how many could not be located."""
    located, failures = [], Counter[str]()
    for item in items:
        result = locate(item)
        if isinstance(result, str):
            failures[result] += 1
        else:
            located.append(result)
    return located, failures


# ---- scoring ----------------------------------------------------------------------------------------
def nearest_mention(item: LocatedItem) -> int:
    """The candidate head word (antecedent or wrong) closest to the pronoun; ties go to the later one."""
    return min((item.antecedent, item.wrong), key=lambda w: (abs(item.pronoun - w), -w))


def same_head_word(item: LocatedItem) -> tuple[int, bool]:
    """Clark et al.'s head-match rule: the nearest candidate whose head word equals the pronoun's word.

    Returns the prediction and whether a head word matched (False = fell back to the nearest mention).
    """
    pronoun = item.words[item.pronoun].lower()
    matching = [w for w in (item.antecedent, item.wrong) if item.words[w].lower() == pronoun]
    if not matching:
        return nearest_mention(item), False
    return min(matching, key=lambda w: abs(item.pronoun - w)), True


@dataclass(frozen=True)
class CorefResult(ScoredHeads):
    """Per-head accuracy ``[layer, head]`` on located items (the pronoun attends more to the antecedent), baselines
    and the items left out."""

    correct: np.ndarray  # [item, layer, head] bool
    items: tuple[LocatedItem, ...]
    left_out: Counter[str]
    unaligned: int
    model: str

    def best_head_p_value(self, permutations: int = 2000, seed: int = 0) -> float:
        """How often a best head at least this good appears when heads cannot tell the candidates apart.

        Each permutation swaps the two candidates of a random half of the items (the same swap for
        every head, so heads stay as correlated as they are) and takes the best head's accuracy;
        as the maximum over all heads is compared, choosing the best of many heads is accounted for.
        """
        correct = self.correct.reshape(len(self.items), -1).astype(np.float64)  # [item, layer * head]
        observed = correct.mean(axis=0).max()
        flips = (np.random.default_rng(seed).random((permutations, len(self.items))) < 0.5).astype(np.float64)
        # correct XOR flip, summed over items: correct + flip - 2 * correct * flip
        flipped = correct.sum(axis=0)[None, :] + flips.sum(axis=1)[:, None] - 2 * flips @ correct
        best = flipped.max(axis=1) / len(self.items)  # [permutation]
        return float((1 + np.sum(best >= observed - 1e-12)) / (1 + permutations))

    def baseline(self, name: str) -> float:
        if name == "nearest_mention":
            return float(np.mean([nearest_mention(i) == i.antecedent for i in self.items]))
        return float(np.mean([same_head_word(i)[0] == i.antecedent for i in self.items]))

    def to_frame(self) -> Any:
        """One row per layer and head (0-indexed)."""
        import pandas as pd

        n_layers, n_heads = self.accuracy.shape
        return pd.DataFrame([{"layer": layer, "head": head, "head_name": head_name(layer, head),
                              "accuracy": float(self.accuracy[layer, head]), "items": len(self.items)}
                             for layer in range(n_layers) for head in range(n_heads)])

    def items_frame(self) -> Any:
        """One row per located item: the words used and whether the best head and the baselines got it."""
        import pandas as pd

        layer, head = self.best_head()
        return pd.DataFrame([{"id": i.item.id, "sentence": i.item.sentence, "pronoun": i.words[i.pronoun],
                              "antecedent_head": i.words[i.antecedent], "wrong_head": i.words[i.wrong],
                              "best_head_right": bool(self.correct[n, layer, head]),
                              "nearest_mention_right": nearest_mention(i) == i.antecedent}
                             for n, i in enumerate(self.items)])

    def save(self, folder: str | Path) -> Path:
        """Tables (CSV + DuckDB), the per-head chart and ``index.html`` in ``folder``; returns the page."""
        import pandas as pd

        from ..experiments.report import write_summary
        from .report import plot_head_grid, write_tables

        folder = Path(folder)
        headline = self.headline()
        left_out = pd.DataFrame({"reason": list(self.left_out) + ["a pronoun or head word without word pieces"],
                                 "items": list(self.left_out.values()) + [self.unaligned]})
        write_tables({"head_accuracy": self.to_frame(), "items": self.items_frame(), "left_out": left_out},
                     folder, "probe_coref")
        plot_head_grid(self.accuracy, f"{self.model}: share of Winograd items whose pronoun attends more to its "
                       f"antecedent than to the other candidate\nn = {headline['items']}, chance = 0.5, nearest "
                       f"mention {headline['nearest_mention_acc']:.3f}; best head {headline['best_head']}: "
                       f"permutation p = {headline['best_head_p_value']:.2g} (max over heads)",
                       folder / "coref_heads.png", chance=0.5)
        facts = {"model": self.model, "data": "Winograd schemas from BIG-bench winowhy (gold antecedents)",
                 "items scored": headline["items"],
                 "items left out": sum(self.left_out.values()) + self.unaligned,
                 **{f"left out: {reason}": count for reason, count in self.left_out.items()},
                 "best head": f"{headline['best_head']} ({headline['best_head_acc']:.3f})",
                 "p-value of the best head (candidates swapped at random, max over heads)":
                     headline["best_head_p_value"],
                 "nearest-mention baseline": headline["nearest_mention_acc"],
                 "same-head-word baseline": f"{headline['same_head_word_acc']} (a head word matched the pronoun in "
                 f"{headline['same_head_word_matches']} items; otherwise it falls back to the nearest mention)",
                 "layers and heads": "0-indexed (layer-head)"}
        ranked = self.to_frame().sort_values("accuracy", ascending=False).head(20)
        return write_summary(folder / "index.html", f"Coreference heads: {self.model}", facts, ["coref_heads.png"],
                             ranked, "The 20 best heads")

    def _repr_html_(self) -> str:
        ranked = self.to_frame().sort_values("accuracy", ascending=False).head(10)
        return str(ranked.to_html(index=False, float_format=lambda v: f"{v:.3f}"))

    def headline(self) -> dict[str, Any]:
        layer, head = self.best_head()
        matched = sum(same_head_word(i)[1] for i in self.items)
        return {"model": self.model, "heads_indexing": "layer-head, both 0-indexed",
                "best_head": head_name(layer, head), "selected_on": SELECTED_ON_SCORED,
                "best_head_acc": round(float(self.accuracy[layer, head]), 4),
                "best_head_p_value": round(self.best_head_p_value(), 4),
                "nearest_mention_acc": round(self.baseline("nearest_mention"), 4),
                "same_head_word_acc": round(self.baseline("same_head_word"), 4),
                "same_head_word_matches": matched, "items": len(self.items),
                "items_left_out": dict(self.left_out), "items_unaligned": self.unaligned}


def score_coref(aligned: Iterable[AlignedSentence], left_out: Counter[str], model: str) -> CorefResult:
    """Per head, whether each item's pronoun attends more to its antecedent than to the wrong candidate.

    Items whose pronoun or candidate head word has no word piece are left out and counted.
    """
    rows, kept, unaligned = [], [], 0
    for sentence in aligned:
        item: LocatedItem = sentence.words
        if not sentence.aligned[[item.pronoun, item.antecedent, item.wrong]].all():
            unaligned += 1
            continue
        row = sentence.attention[:, :, item.pronoun]  # [layer, head, word]
        rows.append(row[:, :, item.antecedent] > row[:, :, item.wrong])
        kept.append(item)
    if not rows:
        raise AttnscopeError("no coreference item could be scored")
    return CorefResult(np.stack(rows), tuple(kept), left_out, unaligned, model)
