"""One head on one trial of a head-function score's task: the attention row the score reads, with the keys it
reads marked. What the explorer's "Head functions" view shows when a head of the grid is clicked.

A trial builder is registered per task (:func:`register_trial`, as tasks are in
:mod:`attnscope.experiments.head_functions`), so a task registered later (needle trials) adds its own view without
changes here. Built in:

* ``repeated_tokens``: the first sequence of the task (same seed, same tokens); the row of its last query (in the
  last copy), with the keys the score reads marked: induction ``q - period + 1``, duplicate-token ``q - period``,
  echo every ``q - r * period``, previous-token ``q - 1``;
* ``document``: the first document, cut as the task cuts it; the row of its last query, with the first ``k``
  (the settings' first sink size) and the ``w`` most recent keys marked, ``w`` the smallest window of the grid
  whose cache keeps ``share`` of this row (the largest where none does);
* ``sentences``: the first document's sentences (each named by its first characters); the last sentence's
  row of block means, with the sentence of the largest vertical score marked (the receiver's column).

Only that one row of one layer and head is captured (a capture plan), never the whole matrix. Layers, heads and
positions are 0-indexed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..analysis.head_functions import get_head_function
from ..analysis.sentences import PROXIMITY, sentence_attention
from ..capture.extract import as_loaded, extract, extract_ids
from ..capture.plan import CapturePlan, QuerySelection
from ..errors import AttnscopeError
from ..models.loading import LoadedModel
from ..records.attention import AttentionRecord
from .head_functions import HeadScoreSettings, check_settings, cut_quietly, document_texts
from .interventions import check_layers_and_heads
from .random_tokens import repeated_random_tokens
from .sentences import sentence_record, text_sentences


@dataclass(frozen=True)
class HeadTrial:
    """Head ``layer``.``head``'s attention on one trial of ``score``'s task: ``row`` float ``[k_pos]`` of query
    ``query`` over ``tokens[:query + 1]``; ``marked``: the key positions the score reads; ``note``: in words."""

    model: str
    score: str
    task: str
    layer: int
    head: int
    tokens: tuple[str, ...]
    query: int
    row: np.ndarray
    marked: tuple[int, ...]
    note: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (the row as a list of floats)."""
        return {"model": self.model, "score": self.score, "task": self.task, "layer": self.layer, "head": self.head,
                "tokens": list(self.tokens), "query": self.query, "row": [float(v) for v in self.row],
                "marked": list(self.marked), "marked_share": self.marked_share, "note": self.note}

    @property
    def marked_share(self) -> float:
        """The share of the row on the marked keys."""
        return float(self.row[list(self.marked)].sum())


TrialBuilder = Callable[[LoadedModel, HeadScoreSettings, str, int, int], HeadTrial]
TRIALS: dict[str, TrialBuilder] = {}


def register_trial(task: str, builder: TrialBuilder) -> None:
    """Add the trial view of ``task``: ``builder(loaded, settings, score, layer, head)`` -> :class:`HeadTrial`."""
    TRIALS[task] = builder


def one_row_plan(layer: int, head: int, query: int) -> CapturePlan:
    """Keep one row (``query``: negative counts from the end): ``[1, 1, 1, k_pos]``."""
    return CapturePlan(layers=(layer,), heads=(head,), queries=QuerySelection("list", given=(query,)))


def held_row(record: AttentionRecord, layer: int, head: int, query: int) -> np.ndarray:
    """float64 ``[k_pos]``: the row of ``query`` up to itself (a causal row has nothing after it)."""
    return np.asarray(record.head_rows(layer, head)[0][: query + 1], dtype=np.float64)


# ---- repeated random tokens ----------------------------------------------------------------------------
def repeated_marks(score: str, query: int, period: int, prefix: int) -> tuple[int, ...]:
    """The keys ``score`` reads for ``query`` (module docstring); none for a score this module does not know."""
    earlier = [query - r * period for r in range(1, query // period + 1) if query - r * period >= prefix]
    return {"induction": (query - period + 1,), "duplicate_token": (query - period,), "echo": tuple(earlier),
            "previous_token": (query - 1,)}.get(score, ())


def repeated_trial(loaded: LoadedModel, settings: HeadScoreSettings, score: str, layer: int, head: int) -> HeadTrial:
    ids = repeated_random_tokens(loaded, settings.period, repeats=settings.repeats, sequences=1, seed=settings.seed)[0]
    query = len(ids) - 1
    record = extract_ids(loaded, [ids], plan=one_row_plan(layer, head, query))[0]
    prefix = len(ids) - settings.period * settings.repeats
    note = (f"{settings.repeats} copies of {settings.period} random tokens; the last query ({query}), in the last "
            f"copy; marked: the keys the {score} score reads")
    return HeadTrial(record.model.name, score, "repeated_tokens", layer, head, record.tokens, query,
                     held_row(record, layer, head, query), repeated_marks(score, query, settings.period, prefix), note)


# ---- documents ------------------------------------------------------------------------------------------
def smallest_kept_window(row: np.ndarray, sink: int, windows: tuple[int, ...], share: float) -> tuple[int, float]:
    """The smallest of ``windows`` whose first-``sink`` + recent-``w`` cache keeps ``share`` of ``row``
    ``[k_pos]`` (the largest where none does), and the share it keeps."""
    query = len(row) - 1
    kept = 0.0
    for window in sorted(windows):
        keys = np.zeros(len(row), dtype=bool)
        keys[:sink] = True
        keys[max(0, query - window + 1):] = True
        kept = float(row[keys].sum())
        if kept >= share:
            return window, kept
    return max(windows), kept


def document_trial(loaded: LoadedModel, settings: HeadScoreSettings, score: str, layer: int, head: int) -> HeadTrial:
    with cut_quietly():
        record = extract(loaded, document_texts(settings)[0], plan=one_row_plan(layer, head, -1),
                         max_length=settings.document_tokens(loaded))
    query = len(record.tokens) - 1
    row = held_row(record, layer, head, query)
    sink = settings.sinks[0]
    window, kept = smallest_kept_window(row, sink, settings.windows, settings.share)
    marked = sorted(set(range(min(sink, query + 1))) | set(range(max(0, query - window + 1), query + 1)))
    note = (f"the first document's last query ({query}); marked: the first {sink} and the {window} most recent keys, "
            f"which keep {kept:.2f} of this row (the smallest window of the grid keeping {settings.share:g}, or the "
            "largest)")
    return HeadTrial(record.model.name, score, "document", layer, head, record.tokens, query, row, tuple(marked),
                     note)


# ---- sentences ------------------------------------------------------------------------------------------
SENTENCE_CHARACTERS = 60  # a sentence stands in a trial's row by its first characters


def sentence_trial(loaded: LoadedModel, settings: HeadScoreSettings, score: str, layer: int, head: int) -> HeadTrial:
    text = document_texts(settings)[0]
    with cut_quietly():
        sentences = text_sentences(loaded, text, settings.document_tokens(loaded))
        record = sentence_record(loaded, text, sentences, chunk=settings.chunk, layers=(layer,), heads=(head,),
                                 max_length=settings.document_tokens(loaded))
    found = sentence_attention(record, sentences)
    matrix = found.matrix[0, 0]  # [q_sentence, k_sentence]
    vertical = found.vertical_scores()[0, 0]  # [sentence]
    query = len(sentences) - 1
    marked = () if np.isnan(vertical).all() else (int(np.nanargmax(vertical)),)
    names = tuple(" ".join(part.split())[:SENTENCE_CHARACTERS] for part in sentences.texts)
    note = (f"the first document's {len(sentences)} sentences; the row: the last sentence's mean attention to each "
            f"(block means); marked: the sentence with the largest vertical score (what sentences at least "
            f"{PROXIMITY} later give it)")
    return HeadTrial(record.model.name, score, "sentences", layer, head, names, query,
                     np.asarray(matrix[query, : query + 1], dtype=np.float64), marked, note)


register_trial("repeated_tokens", repeated_trial)
register_trial("document", document_trial)
register_trial("sentences", sentence_trial)


def head_trial(model: LoadedModel | str, score: str, layer: int, head: int,
               settings: HeadScoreSettings | None = None) -> HeadTrial:
    """Head ``layer``.``head`` (0-indexed) of ``model`` on one trial of ``score``'s task, as the settings build it
    (module docstring). Every premise is checked first, one line each (as :func:`head_scores` checks them)."""
    loaded = as_loaded(model)
    settings = settings or HeadScoreSettings()
    check_settings(loaded, [score], settings)
    task = get_head_function(score).task
    if task not in TRIALS:
        raise AttnscopeError(f"no trial view for the {task!r} task of {score} (views exist for {', '.join(TRIALS)})")
    check_layers_and_heads(loaded, [layer], [head], options=("layer", "head"))
    return TRIALS[task](loaded, settings, score, layer, head)
