"""Coreference heads on whole documents with gold chains (Clark et al. 2019, section 4.3, on real text).

For every mention that has an antecedent (an earlier mention of its chain) in the model's window,
each head is asked: of the earlier mentions in the window, which one does the mention's head word
attend to most (word-level attention to the candidate's head word)? The head is right when that
mention belongs to the same chain. Candidates are the earlier mentions of chains with two or more
mentions, as in CoNLL-2012 where Clark et al. measured (GUM also marks singletons; with
``singletons=True`` they are candidates too); candidates sharing a head word count once.

Baselines on the same candidates, as Clark et al.: the nearest earlier mention; the nearest with
the same head word (no such mention: wrong); and their rule-based sieves after Lee et al. 2011:
the nearest candidate with (1) the same words, else (2) the same head word, else (3) no clash in
Number, Person or Gender of the two head words (UD FEATS, where the file marks them; a feature
marked on one side only does not clash), else (4) the nearest.

Windows: a document is read in windows of ``window`` tokens, as many whole words as fit; the next
window starts so that it overlaps the previous one by about half (``overlap`` tokens), and each
mention is scored once, in the window where its head word is in the new part, so it has at least
the overlap as left context (the first window excepted). Left out and counted by reason: mentions
whose earlier chain mentions all lie before the window, head words without word pieces.
Layers and heads are 0-indexed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import AttnscopeError
from .alignment import AlignedSentence
from .dependencies import HeadChoice, ScoredHeads, choose_head, head_name, selection_note
from .documents import Document, Mention, feature

AGREEMENT = ("Number", "Person", "Gender")
BASELINES = ("nearest", "headword", "rule")
OUTSIDE = "every earlier mention of its chain lies before the window"
UNALIGNED = "head word or antecedents without word pieces"
MIN_WINDOW = 2  # tokens of text a window holds at least


@dataclass(frozen=True)
class Window:
    """Words ``[start, end)`` of a document go to the model; mentions headed in ``[own, end)`` are scored."""

    start: int
    end: int
    own: int


def plan_windows(token_counts: Sequence[int], budget: int) -> list[Window]:
    """Cover the words (``token_counts[w]`` pieces each) with windows of at most ``budget`` pieces,
    each next one overlapping the previous by at most half the budget.

    >>> plan_windows([1] * 10, 4)
    [Window(start=0, end=4, own=0), Window(start=2, end=6, own=4), Window(start=4, end=8, own=6), \
Window(start=6, end=10, own=8)]
    """
    if budget < MIN_WINDOW:
        raise AttnscopeError(f"a window must hold at least {MIN_WINDOW} tokens, got {budget}")
    windows, start, own, n = [], 0, 0, len(token_counts)
    while own < n:
        end, used = start, 0
        while end < n and used + token_counts[end] <= budget:
            used += token_counts[end]
            end += 1
        end = max(end, own + 1)  # a word longer than the window still gets one (cut) window
        windows.append(Window(start, end, own))
        back, new_start = 0, end
        while new_start > start + 1 and back + token_counts[new_start - 1] <= budget // 2:
            new_start -= 1
            back += token_counts[new_start]
        start, own = new_start, end
    return windows


@dataclass(frozen=True)
class Task:
    """One mention to resolve: its head word and the candidates' head words (document positions)."""

    mention: Mention
    candidates: tuple[int, ...]  # sorted, earlier than the mention's head, inside the window
    antecedents: frozenset[int]  # the candidates of its own chain


@dataclass(frozen=True)
class WindowText:
    """The text of one window (words ``window.start`` to ``window.end``) with spans relative to it."""

    document: Document
    window: Window
    tasks: tuple[Task, ...]

    @property
    def text(self) -> str:
        first, last = self.document.spans[self.window.start][0], self.document.spans[self.window.end - 1][1]
        return self.document.text[first:last]

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        offset = self.document.spans[self.window.start][0]
        return tuple((a - offset, b - offset) for a, b in self.document.spans[self.window.start:self.window.end])

    def rows(self) -> list[int]:
        """The attending words (window positions): the tasks' head words."""
        return [task.mention.head - self.window.start for task in self.tasks]


def window_tasks(document: Document, window: Window, singletons: bool, left_out: Counter[str]) -> list[Task]:
    """The mentions scored in ``window``, and (into ``left_out``) those whose antecedents are out of it."""
    sizes = document.chain_sizes()
    pool = [m for m in document.mentions if singletons or sizes[m.entity] > 1]
    tasks = []
    for mention in document.mentions:
        if not window.own <= mention.head < window.end or sizes[mention.entity] < 2:
            continue
        earlier = [m for m in pool if m.head < mention.head]
        if not any(m.entity == mention.entity for m in earlier):
            continue  # the first mention of its chain: nothing to resolve
        inside = [m for m in earlier if m.head >= window.start]
        antecedents = frozenset(m.head for m in inside if m.entity == mention.entity)
        if not antecedents:
            left_out[OUTSIDE] += 1
            continue
        tasks.append(Task(mention, tuple(sorted({m.head for m in inside})), antecedents))
    return tasks


def plan_documents(documents: Sequence[Document], token_counts: Sequence[Sequence[int]], budget: int,
                   singletons: bool = False) -> tuple[list[WindowText], Counter[str]]:
    """Every document's windows that have a mention to score, and the mentions left out by reason."""
    left_out: Counter[str] = Counter()
    texts = []
    for document, counts in zip(documents, token_counts):
        for window in plan_windows(counts, budget):
            tasks = window_tasks(document, window, singletons, left_out)
            if tasks:
                texts.append(WindowText(document, window, tuple(tasks)))
    return texts, left_out


# ---- baselines -------------------------------------------------------------------------------------
def _nearest(candidates: Iterable[int]) -> int | None:
    return max(candidates, default=None)


def _strings(document: Document, head: int) -> set[str]:
    return {" ".join(document.words[w].lower() for w in m.words) for m in document.mentions if m.head == head}


def _agree(document: Document, a: int, b: int) -> bool:
    for name in AGREEMENT:
        one, other = feature(document.feats[a], name), feature(document.feats[b], name)
        if one is not None and other is not None and one != other:
            return False
    return True


def baseline_choices(document: Document, task: Task, candidates: Sequence[int]) -> dict[str, int | None]:
    """Each baseline's chosen candidate head word (None: the baseline has no answer)."""
    head = task.mention.head
    word = document.words[head].lower()
    strings = _strings(document, head)
    same_words = [c for c in candidates if _strings(document, c) & strings]
    same_head = [c for c in candidates if document.words[c].lower() == word]
    agreeing = [c for c in candidates if _agree(document, head, c)]
    rule = same_words or same_head or agreeing or list(candidates)  # the first sieve that has a candidate
    return {"nearest": _nearest(candidates), "headword": _nearest(same_head), "rule": _nearest(rule)}


# ---- scoring ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scored:
    """One resolved mention: per head whether it chose the chain, and what the baselines chose."""

    document: str
    mention: Mention
    word: str
    candidates: int
    distance: int  # words back to the nearest antecedent
    correct: np.ndarray  # [layer, head] bool
    baselines: dict[str, bool]


def score_window(aligned: AlignedSentence) -> tuple[list[Scored], int]:
    """The window's tasks scored on its word-level attention rows ``[layer, head, task, word]``;
    also how many were left out for want of word pieces."""
    item: WindowText = aligned.words
    start, scored, unaligned = item.window.start, [], 0
    for row, task in enumerate(item.tasks):
        candidates = [c for c in task.candidates if aligned.aligned[c - start]]
        if not aligned.aligned[task.mention.head - start] or not task.antecedents & set(candidates):
            unaligned += 1
            continue
        local = np.array(candidates) - start
        attended = aligned.attention[:, :, row, local]  # [layer, head, candidate]
        chosen = np.array(candidates)[attended.argmax(axis=-1)]  # [layer, head]
        choices = baseline_choices(item.document, task, candidates)
        scored.append(Scored(item.document.id, task.mention, item.document.words[task.mention.head],
                             len(candidates), task.mention.head - max(task.antecedents & set(candidates)),
                             np.isin(chosen, list(task.antecedents)),
                             {name: choice in task.antecedents for name, choice in choices.items()}))
    return scored, unaligned


@dataclass(frozen=True)
class ChainsResult(ScoredHeads):
    """Per head, the share of mentions whose most-attended earlier mention is of their chain; baselines."""

    scored: tuple[Scored, ...]
    left_out: Counter[str]
    model: str
    source: str
    documents: int
    settings: dict[str, Any]
    selection: np.ndarray | None = None  # [layer, head] accuracy on other data (dev), where the head is chosen
    selection_source: str = ""
    selection_mentions: int = 0

    def choice(self) -> HeadChoice:
        """The head reported: chosen on ``selection`` (dev) if given, else the best here; the oracle beside it."""
        return choose_head(self.correct.sum(axis=0), len(self.scored), self.selection)

    def with_selection(self, dev: ChainsResult) -> ChainsResult:
        """This result with its head chosen on ``dev`` (the same model's result on other documents)."""
        return replace(self, selection=dev.accuracy, selection_source=dev.source,
                       selection_mentions=len(dev.scored))

    @property
    def correct(self) -> np.ndarray:
        """``[mention, layer, head]`` bool."""
        return np.stack([s.correct for s in self.scored])

    def baseline(self, name: str) -> float:
        return float(np.mean([s.baselines[name] for s in self.scored]))

    def to_frame(self) -> Any:
        """One row per layer and head (0-indexed)."""
        import pandas as pd

        n = len(self.scored)
        return pd.DataFrame([{"layer": layer, "head": head, "head_name": head_name(layer, head),
                              "accuracy": float(acc), "mentions": n}
                             for (layer, head), acc in np.ndenumerate(self.accuracy)])

    def mentions_frame(self) -> Any:
        """One row per scored mention: its head word, candidates, distance, the best head's and baselines' answers."""
        import pandas as pd

        choice = self.choice()
        layer, head = choice.layer, choice.head
        return pd.DataFrame([{"document": s.document, "head_word": s.word, "position": s.mention.head,
                              "entity": s.mention.entity, "candidates": s.candidates, "distance": s.distance,
                              "best_head_right": bool(s.correct[layer, head]),
                              **{f"{name}_right": right for name, right in s.baselines.items()}}
                             for s in self.scored])

    def headline(self) -> dict[str, Any]:
        """JSON figures: ``best_head`` (the chosen head) with ``best_head_acc`` and its 95% interval ``ci`` here,
        ``selected_on``, the ``oracle_head`` and its accuracy, the baselines, what was left out, the settings."""
        choice = self.choice()
        low, high = choice.interval()
        selection = {} if self.selection is None else {
            "selection_source": self.selection_source, "selection_mentions": self.selection_mentions,
            "selection_acc": round(choice.selection_accuracy, 4)}
        return {"model": self.model, "source": self.source, "heads_indexing": "layer-head, both 0-indexed",
                "documents": self.documents, "mentions": len(self.scored), "best_head": choice.name,
                "best_head_acc": round(choice.accuracy, 4), "ci": [round(low, 4), round(high, 4)],
                "selected_on": choice.selected_on, **selection,
                "selection": selection_note(None if self.selection is None else self.selection_source,
                                            f"{self.selection_mentions} mentions"),
                "oracle_head": choice.oracle_name, "oracle_head_acc": round(choice.oracle_accuracy, 4),
                **{f"{name}_acc": round(self.baseline(name), 4) for name in BASELINES},
                "mean_candidates": round(float(np.mean([s.candidates for s in self.scored])), 2),
                "left_out": dict(self.left_out), **self.settings}

    def save(self, folder: str | Path) -> Path:
        """Tables (CSV + DuckDB), the per-head chart and ``index.html`` in ``folder``; returns the page."""
        import pandas as pd

        from ..experiments.report import write_summary
        from .report import plot_head_grid, write_tables

        folder = Path(folder)
        h = self.headline()
        left_out = pd.DataFrame({"reason": list(self.left_out), "mentions": list(self.left_out.values())})
        write_tables({"head_accuracy": self.to_frame(), "mentions": self.mentions_frame(), "left_out": left_out},
                     folder, "probe_coref")
        plot_head_grid(self.accuracy, f"{self.model}: share of {h['mentions']} mentions whose most-attended earlier "
                       f"mention is of their chain ({self.source})\nnearest mention {h['nearest_acc']:.3f}, "
                       f"same head word {h['headword_acc']:.3f}, rule-based {h['rule_acc']:.3f}",
                       folder / "coref_heads.png", chance=h["nearest_acc"])
        facts = {"model": self.model, "data": f"{self.source}: gold chains (MISC Entity=), {self.documents} documents",
                 "mentions scored": h["mentions"], **{f"left out: {k}": v for k, v in self.left_out.items()},
                 "heads": h["selection"],
                 "head": f"{h['best_head']}: {h['best_head_acc']:.3f} (95% interval {h['ci'][0]:.3f}–"
                 f"{h['ci'][1]:.3f}" + ("; the best of all heads, so optimistic)" if self.selection is None else
                                        f"); oracle {h['oracle_head']}: {h['oracle_head_acc']:.3f} (upper bound)"),
                 "nearest mention": h["nearest_acc"], "same head word": h["headword_acc"],
                 "rule-based (Lee et al. 2011 sieves)": h["rule_acc"],
                 "candidates per mention (mean)": h["mean_candidates"],
                 **{key: value for key, value in self.settings.items()},
                 "layers and heads": "0-indexed (layer-head)"}
        ranked = self.to_frame().sort_values("accuracy", ascending=False).head(20)
        return write_summary(folder / "index.html", f"Coreference heads on gold chains: {self.model}", facts,
                             ["coref_heads.png"], ranked, "The 20 best heads")

    def _repr_html_(self) -> str:
        ranked = self.to_frame().sort_values("accuracy", ascending=False).head(10)
        return str(ranked.to_html(index=False, float_format=lambda v: f"{v:.3f}"))


def score_chains(aligned: Iterable[AlignedSentence], left_out: Counter[str], model: str, source: str,
                 documents: int, settings: dict[str, Any]) -> ChainsResult:
    """Score every window's mentions; windows cut by the model's limit lose their mentions (counted)."""
    scored: list[Scored] = []
    left_out = Counter(left_out)
    for window in aligned:
        found, unaligned = score_window(window)
        scored += found
        left_out[UNALIGNED] += unaligned
    if not scored:
        raise AttnscopeError(f"{source}: no mention with an antecedent in the window could be scored")
    return ChainsResult(tuple(scored), +left_out, model, source, documents, settings)
