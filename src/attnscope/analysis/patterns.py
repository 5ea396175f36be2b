"""Classify what each head does: Kovaleva et al. 2019's pattern types and Jesse Vig's patterns.

One map (a head on an input) gets one label from :data:`PATTERNS`. The labels refine Kovaleva's
five types with Vig's named patterns; each label belongs to one Kovaleva type:

==========================  ==================  ==========================================================
label                       Kovaleva type       what the map shows
==========================  ==================  ==========================================================
previous_word (Vig)         diagonal            each token attends to the token before it
next_word (Vig)             diagonal            ... to the token after it (encoders only)
diagonal                    diagonal            ... to itself
delimiter (Vig)             vertical            columns on [CLS]/[SEP] (encoders; for causal models see vertical)
vertical                    vertical            columns on one or two ordinary tokens or on '.'/',' (causal: on
                                                any token but the first)
vertical_diagonal           vertical+diagonal   a column and a diagonal line together
block                       block               pairs: each sentence attends within itself, unevenly
bag_of_words (Vig)          block               attention spread evenly over the own sentence or the input
same_word (Vig)             heterogeneous       tokens attend to other occurrences of their word
same_word_other_sentence    heterogeneous       ... to occurrences of their word in the other sentence (Vig)
heterogeneous               heterogeneous       none of the above
sink (Xiao et al. 2023)     vertical            causal models: a column on the first token, the "attention sink"
==========================  ==================  ==========================================================

**Evidence.** Scores are taken over the *scored queries*: the non-special tokens (and, in causal
models, not the first position, whose only key is itself). A person labelling a map asks which
cell is darkest in most rows and how dark it is, so each structure gets three scores:

* its *mass*: the mean attention a query puts on the structure's keys;
* ``_top1``: the share of queries whose largest key belongs to it;
* ``_top2``: the share of queries whose two largest keys include one of it.

Structures: ``previous_word``/``next_word``/``diagonal`` (the key at offset -1/+1/0; in causal
models never the first position, the attention sink, so the second token's pull to the sink is
not read as a previous-word line);
``delimiter`` (special tokens; causal models: NaN, folded into vertical); ``vertical`` (per head,
its two most-attended candidate columns, non-special keys or in causal models any key, or the
punctuation if that holds more); ``same_word``/``same_word_other_sentence`` (other occurrences of
the query's word, over queries whose word has one; NaN when no word repeats; never the sink of a
causal model, where "The" at position 0 gets the attention of every query, a later "the" too;
scored on attention minus each key's mean over the scored rows, so that a column that happens to
sit on a repeated word does not count). Column structures
leave out the band ``|q_pos - k_pos| <= 1``, so that a line never also passes for a column. Two
more scores: ``uniformity``, the histogram intersection ``sum_k min(a_k, u_k)`` of each row with a
uniform row over the own sentence or over all visible keys (the larger), averaged; ``block``, the
mass on the own sentence's ordinary tokens over queries that can see the other sentence (pairs
only, else NaN); ``block_share``, of the attention those queries give ordinary tokens, the share
that stays in their own sentence (whatever they give [CLS]/[SEP]). Two scores read a map the way
a person does: ``<line>_contrast``, the mean weight on the line's key divided by the mean weight
of an ordinary key in the same rows (a light line under a dark column still stands out by it), and ``<column>_dark``, the share of rows whose weight
on the column reaches :data:`DARK_WEIGHT` (mid-grey; a column that never does is background).

**Rules**, in order (thresholds in :data:`THRESHOLDS` and :data:`CAUSAL_THRESHOLDS`, calibrated on
the synthetic set by :func:`attnscope.analysis.evaluate.calibrate`, except ``vd_line_contrast``,
``column_dark`` and ``uniform_pale``, fitted on batch 1 of the real labelled set by
:func:`attnscope.analysis.evaluate.fit_real_thresholds` and off for causal models, and the four
thresholds of rules 0 and 2b, set by hand on batches 1-2 of the real set; rules 0 and 2b also
apply to causal models, without 2b's line-contrast test):

0. *same_word_other_sentence*, else *same_word*, when the other occurrence is the largest key in a
   share ``>= same_strong_top1`` of its rows and its mass beyond the column means reaches
   :data:`DARK_WEIGHT` (mid-grey cells name the head even under a column and a line);
1. *vertical_diagonal*: a column structure has ``_top1 >= vd_column_top1`` and a line has
   ``_top1 >= vd_line_top1``, or ``_top2 >= vd_line_top2`` with mass ``>= vd_line_mass``, or
   ``_contrast >= vd_line_contrast`` (a light line under a dark column);
2. *same_word_other_sentence*, else *same_word*: ``_top2 >= same_top2`` and mass ``>= same_mass``
   (a same-word head shows itself on the queries whose word repeats; the others may do anything,
   except show a column and a line over every row, which rule 1 names first);
2b. *block* (pairs): ``block_share >= block_share``, no column with ``_top1 >= block_column_top1``,
   no line with ``_top1 >= dominant_top1`` or ``_contrast >= block_line_contrast``, and uniformity
   under ``uniform`` (rows keep to their sentence, unevenly, even if [CLS] is dark on some of them);
3. the line or column with the largest ``_top1``, if that is ``>= dominant_top1``, its mass
   ``>= dominant_mass`` and, for a column, its ``_dark >= column_dark``;
4. *bag_of_words* if uniformity ``>= uniform``;
5. *block* (pairs) if block ``>= block`` and no line shows (as in 2b);
6. *bag_of_words* if uniformity ``>= uniform_pale`` and no column has ``_dark >= column_dark``
   (light everywhere, a pale column at most);
7. else *heterogeneous*.

Causal models then split rule 3's *vertical* heads: a head is *sink* when the first position is
the largest key in a share ``>= dominant_top1`` of the scored rows (``sink_top1``; the same test
rule 3 asked of its winning column), i.e. the column that made it vertical is the attention sink
(Xiao et al. 2023). Every other label is left as the rules gave it. ``sink``/``sink_top1``/
``sink_top2`` are the first position's shares (NaN for bidirectional models, which have no sink).

Rule 1 before 2, ``_contrast`` and ``_dark`` follow the written labelling rules of
``labels/README.md`` (a line "continuously visible, even if light"; a column "at least mid-grey
on many rows"). ``_contrast`` grows with the number of ordinary keys (a line can weigh at most
that many times the mean), so short inputs need a darker line to pass.

**Confidence** falls smoothly to 0.5 (a coin toss) wherever a small change of the scores would
change the label. Each condition of a rule has a *margin*: how far its score lies from its
threshold, in units of :data:`MARGIN_WIDTH` (0.1 of a share; a tenth of a ratio threshold). A
rule's margin is that of its closest condition (of its strongest alternative, for "or"); the
label's margin is the smaller of the margin of the rule that gave it and the distance by which
each earlier rule failed (a delimiter head whose column is mid-grey on 29% of rows, against 30%,
is a coin toss between bag_of_words and delimiter, whatever its uniformity), and for rule 3 also
the winner's lead in ``_top1`` over the runner-up. Confidence is ``0.5 + 0.5 tanh(margin)``: 0.88
one width past every threshold, 0.98 two widths past. *heterogeneous* gets the distance to the
closest rule.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import AttnscopeError
from ..records.attention import AttentionRecord
from .tokens import TokenContext, token_context


@dataclass(frozen=True)
class PatternClass:
    name: str
    kovaleva: str  # one of KOVALEVA_TYPES
    source: str  # who named it
    description: str
    encoder: bool = True  # can be assigned to heads of bidirectional models
    causal: bool = True  # can be assigned to heads of causal models
    short: str = ""  # 2-4 letters for tables and maps


KOVALEVA_TYPES = ("vertical", "diagonal", "vertical+diagonal", "block", "heterogeneous")

PATTERNS: dict[str, PatternClass] = {p.name: p for p in (
    PatternClass("previous_word", "diagonal", "Vig", "attends to the previous token", short="prev"),
    PatternClass("next_word", "diagonal", "Vig", "attends to the next token", causal=False, short="next"),
    PatternClass("diagonal", "diagonal", "Kovaleva", "attends to itself", short="self"),
    PatternClass("delimiter", "vertical", "Vig", "attends to [CLS]/[SEP]", causal=False, short="delim"),
    PatternClass("vertical", "vertical", "Kovaleva",
                 "attends to one or two ordinary tokens or punctuation (causal: not the first token)",
                 short="vert"),
    PatternClass("vertical_diagonal", "vertical+diagonal", "Kovaleva", "a column and a diagonal line together",
                 short="v+d"),
    PatternClass("block", "block", "Kovaleva", "attends within its own sentence, unevenly (pairs)", short="blk"),
    PatternClass("bag_of_words", "block", "Vig", "attends evenly over its sentence or the input", short="bow"),
    PatternClass("same_word", "heterogeneous", "Vig", "attends to other occurrences of its word", short="same"),
    PatternClass("same_word_other_sentence", "heterogeneous", "Vig",
                 "attends to occurrences of its word in the other sentence", short="s-oth"),
    PatternClass("heterogeneous", "heterogeneous", "Kovaleva", "no dominant pattern", short="het"),
    # last: the synthetic set draws its maps class by class in this order, so the other classes keep theirs
    PatternClass("sink", "vertical", "Xiao et al. 2023", "causal: attends mostly to the first token, the attention sink",
                 encoder=False, short="sink"),
)}

# One palette for pattern labels wherever they are drawn (report, figures, explorer): lines warm,
# columns cool, blocks purple, same-word brown, no pattern grey; a class registered later gets a spare.
PATTERN_COLOURS = {"previous_word": "#f28e2b", "next_word": "#e15759", "diagonal": "#ff9da7", "delimiter": "#76b7b2",
                   "vertical": "#4e79a7", "vertical_diagonal": "#edc948", "block": "#b07aa1", "bag_of_words": "#d4a6c8",
                   "same_word": "#9c755f", "same_word_other_sentence": "#c9a77c", "heterogeneous": "#d9d9d9",
                   "sink": "#1f5f8b"}
SPARE_COLOURS = ("#59a14f", "#8cd17d", "#a0cbe8", "#86bcb6", "#bab0ac")


def pattern_colour(name: str) -> str:
    """The colour of pattern label ``name`` (hex), the same in the report, the figures and the explorer."""
    if name in PATTERN_COLOURS:
        return PATTERN_COLOURS[name]
    others = [other for other in PATTERNS if other not in PATTERN_COLOURS]
    return SPARE_COLOURS[(others.index(name) if name in others else 0) % len(SPARE_COLOURS)]


LINES = ("previous_word", "next_word", "diagonal")
COLUMNS = ("delimiter", "vertical")
SAME = ("same_word_other_sentence", "same_word")
STRUCTURES = (*LINES, *COLUMNS, *SAME)
EVIDENCE = (*STRUCTURES, *(f"{name}_top1" for name in STRUCTURES), *(f"{name}_top2" for name in STRUCTURES),
            *(f"{name}_contrast" for name in LINES), *(f"{name}_dark" for name in COLUMNS), "uniformity", "block",
            "block_share", "sink", "sink_top1", "sink_top2")
# "mid-grey" on a map drawn from white (0) to black (1): a column must reach it on many rows to count
DARK_WEIGHT = 0.4

# Calibrated with attnscope.analysis.evaluate.calibrate (synthetic set of seed 1, 12 maps per class,
# length and layout; macro-F1 0.944 for bidirectional and 0.901 for causal models there). The real
# labelled set played no part in it.
THRESHOLDS: dict[str, float] = {  # bidirectional models
    "same_top2": 0.5,  # same word: the other occurrence is among the 2 largest keys in this share of its rows
    "same_mass": 0.1,  # ... and holds at least this mass on them
    "vd_column_top1": 0.35,  # vertical+diagonal: a column is the largest key in this share of rows
    "vd_line_top1": 0.25,  # ... and a line is the largest key in this share of rows,
    "vd_line_top2": 0.7,  # ... or among the 2 largest in this share
    "vd_line_mass": 0.1,  # ... with at least this mass
    "dominant_top1": 0.45,  # one line or column is the largest key in this share of rows (the most of any)
    "dominant_mass": 0.3,  # ... and holds at least this mass
    "uniform": 0.7,  # bag of words: overlap with a uniform row
    "block": 0.6,  # block: mass on the own sentence's ordinary tokens
    # set by hand on batches 1-2 of the real labelled set, before batch 3 (held out) was scored
    "same_strong_top1": 0.5,  # same word before vertical+diagonal: the other occurrence is the largest key
    "block_share": 0.85,  # block before a column: this share of the ordinary attention stays in the sentence
    "block_column_top1": 0.6,  # ... and no column is the largest key in this share of rows
    "block_line_contrast": 6.0,  # block: no line weighs this many times an average ordinary key
    # fitted on the real labelled set's batch 1 only (see evaluate.REAL_CALIBRATION_GRID)
    "vd_line_contrast": 8.0,  # vertical+diagonal: a light line weighs this many times an average ordinary key
    "column_dark": 0.3,  # a dominant column reaches mid-grey (DARK_WEIGHT) on this share of rows
    "uniform_pale": 0.55,  # bag of words when no column is dark: a lower overlap with a uniform row suffices
}
# causal rows see few keys early on, which makes every map look more even and more columnar
CAUSAL_THRESHOLDS: dict[str, float] = {
    "same_top2": 0.5,
    "same_mass": 0.1,
    "vd_column_top1": 0.35,
    "vd_line_top1": 0.3,
    "vd_line_top2": 0.9,
    "vd_line_mass": 0.1,
    "dominant_top1": 0.7,
    "dominant_mass": 0.4,
    "uniform": 0.8,
    "block": 0.6,
    "same_strong_top1": 0.5,
    "block_share": 0.85,
    "block_column_top1": 0.6,
    "block_line_contrast": float("inf"),
    # the real-set rules are not calibrated for causal models: these values switch them off
    "vd_line_contrast": float("inf"),
    "column_dark": 0.0,
    "uniform_pale": 0.8,
}


def thresholds_for(causal: bool) -> dict[str, float]:
    """The calibrated thresholds for causal or bidirectional models."""
    return CAUSAL_THRESHOLDS if causal else THRESHOLDS


def pattern_names(causal: bool | None = None) -> list[str]:
    """Names of the pattern classes (those possible for causal or bidirectional models, or all)."""
    if causal is None:
        return list(PATTERNS)
    return [name for name, p in PATTERNS.items() if (p.causal if causal else p.encoder)]


# ---- evidence -------------------------------------------------------------------------------
def scored_queries(ctx: TokenContext) -> np.ndarray:
    """[q_pos] bool: the queries every score is averaged over."""
    rows = ~ctx.special
    if ctx.causal:
        rows = rows & (np.arange(ctx.n) > 0)
    return rows


def _vertical_columns(attention: np.ndarray, ctx: TokenContext, off_band: np.ndarray, rows: np.ndarray
                      ) -> np.ndarray:
    """``[layer, head, k_pos]`` bool: each head's two most-attended candidate columns, or the punctuation
    if that holds more (candidates: non-special keys; in causal models every key)."""
    candidates = np.ones(ctx.n, dtype=bool) if ctx.causal else ~ctx.special
    off = attention * (off_band & ctx.allowed)  # a line never passes for a column
    column_means = off[:, :, rows, :].mean(axis=2) * candidates  # [layer, head, k_pos]
    top = np.argsort(column_means, axis=-1)[..., -2:]
    chosen = np.zeros(column_means.shape, dtype=bool)
    np.put_along_axis(chosen, top, True, axis=-1)
    chosen &= candidates & (column_means > 0)
    punct_mass = (column_means * ctx.punct).sum(axis=-1, keepdims=True)
    top_mass = (column_means * chosen).sum(axis=-1, keepdims=True)
    return np.where(punct_mass > top_mass, ctx.punct, chosen)


def _shares(attention: np.ndarray, masks: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, ...]:
    """Mass, top-1 share and top-2 share of a key set, over the scored rows that have keys in it.

    ``attention`` ``[layer, head, q_pos, k_pos]`` (or column-centred attention, whose mass then
    counts only the positive part); ``masks`` bool, broadcastable to it. A row counts for top-1
    when the set's largest key is strictly larger than every key outside it, and for top-2 when it
    is strictly larger than all outside keys but one (so ties, as in a uniform row, count for
    neither). Each result is ``[layer, head]`` (NaN where no row has keys in the set).
    """
    masks = np.broadcast_to(masks & rows[:, None], attention.shape)
    counted = masks.any(axis=-1)  # [layer, head, q_pos]
    n_counted = counted.sum(axis=-1)
    inside = np.where(masks, attention, -np.inf).max(axis=-1)
    outside = np.where(masks, -np.inf, attention)
    if attention.shape[-1] >= 2:
        second, first = np.moveaxis(np.partition(outside, -2, axis=-1)[..., -2:], -1, 0)
    else:
        first = second = np.full(inside.shape, -np.inf)
    with np.errstate(invalid="ignore", divide="ignore"):
        denominator = np.where(n_counted > 0, n_counted, np.nan)
        mass = (np.clip(attention, 0.0, None) * masks).sum(axis=-1).sum(axis=-1) / denominator
        top1 = ((inside > first) & counted).sum(axis=-1) / denominator
        top2 = ((inside > second) & counted).sum(axis=-1) / denominator
    return mass, top1, top2


def _contrast(attention: np.ndarray, mask: np.ndarray, ordinary: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """How many times an average ordinary key a line's key weighs: ``[layer, head]`` (NaN without rows).

    ``mask`` ``[q_pos, k_pos]`` marks one key per row (a line), ``ordinary`` the visible non-special
    keys. A line that is light but continuous under a dark column still stands out by this ratio,
    the way a person sees it on the map: the mean line weight over the scored rows that have one,
    divided by the mean weight of those rows' ordinary keys.
    """
    counted = mask.any(axis=-1) & rows  # [q_pos]
    if not counted.any():
        return np.full(attention.shape[:2], np.nan)
    line = (attention * mask).sum(axis=-1)[:, :, counted].mean(axis=-1)
    per_key = (attention * ordinary).sum(axis=-1) / np.maximum(ordinary.sum(axis=-1), 1)  # [layer, head, q_pos]
    with np.errstate(invalid="ignore", divide="ignore"):
        return line / per_key[:, :, counted].mean(axis=-1)


def _dark_share(attention: np.ndarray, masks: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Share of the scored rows whose weight on the keys in ``masks`` reaches :data:`DARK_WEIGHT`: ``[layer, head]``."""
    masks = np.broadcast_to(masks & rows[:, None], attention.shape)
    counted = masks.any(axis=-1)  # [layer, head, q_pos]
    dark = ((attention * masks).sum(axis=-1) >= DARK_WEIGHT) & counted
    with np.errstate(invalid="ignore", divide="ignore"):
        return dark.sum(axis=-1) / np.where(counted.any(axis=-1), counted.sum(axis=-1), np.nan)


def _beyond_columns(attention: np.ndarray, ctx: TokenContext, rows: np.ndarray) -> np.ndarray:
    """Attention minus what each key gets on average from the scored rows that can see it.

    ``[layer, head, q_pos, k_pos]``; keys a query cannot see get -1. A same-word head attends to the
    other occurrence *more than other tokens do*; without this, a column that happens to sit on a
    repeated word (in causal models the first token, where heads park attention) would pass for one.
    """
    seen = ctx.allowed & rows[:, None]  # [q_pos, k_pos]
    column_means = (attention * seen).sum(axis=2) / np.maximum(seen.sum(axis=0), 1)  # [layer, head, k_pos]
    return np.where(ctx.allowed, attention - column_means[:, :, None, :], -1.0)


def _uniformity(attention: np.ndarray, ctx: TokenContext, rows: np.ndarray) -> np.ndarray:
    """Histogram intersection with uniform rows (own sentence or all visible keys), the larger: ``[layer, head]``."""
    best = np.zeros(attention.shape[:2])
    for support in (ctx.allowed & ctx.same_sentence, ctx.allowed):
        uniform = support / support.sum(axis=1, keepdims=True)  # [q_pos, k_pos]
        overlap = np.minimum(attention, uniform).sum(axis=-1)[:, :, rows].mean(axis=-1)
        best = np.maximum(best, overlap)
    return best


def _own_sentence_share(attention: np.ndarray, own: np.ndarray, ordinary: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Of the attention a row gives ordinary tokens, the share that stays in its own sentence, averaged
    over the scored rows that see the other sentence: ``[layer, head]`` (NaN for a single sentence).

    A block head keeps to its sentence whatever it does with [CLS]/[SEP]; a bag of words over the
    whole input or a delimiter head spreading the rest evenly gives about half.
    """
    counted = ordinary.any(axis=-1) & rows  # [q_pos]
    if not counted.any():
        return np.full(attention.shape[:2], np.nan)
    inside = (attention * own).sum(axis=-1)[:, :, counted]
    total = (attention * ordinary).sum(axis=-1)[:, :, counted]
    return (inside / np.maximum(total, 1e-12)).mean(axis=-1)


def pattern_evidence(attention: np.ndarray, ctx: TokenContext) -> dict[str, np.ndarray]:
    """Every score of :data:`EVIDENCE` per head: ``[layer, head, q_pos, k_pos]`` -> name -> ``[layer, head]``.

    For each structure: its mass (``name``), the share of rows whose largest key is in it
    (``name_top1``) and the share whose two largest keys include one of it (``name_top2``).
    Scores that cannot apply (no repeated word, a single sentence, next word or delimiter in causal
    models) are NaN.
    """
    attention = np.asarray(attention, dtype=np.float64)
    rows = scored_queries(ctx)
    shape = attention.shape[:2]
    if not rows.any():
        return {name: np.full(shape, np.nan) for name in EVIDENCE}
    # columns are counted off the band |q - k| <= 1, so that a line is never also a column
    off_band = np.abs(np.arange(ctx.n)[:, None] - np.arange(ctx.n)[None, :]) > 1
    specials = np.broadcast_to(ctx.special[None, :], (ctx.n, ctx.n))
    masks = {
        "previous_word": np.eye(ctx.n, k=-1, dtype=bool) & ~ctx.sink[None, :],  # the sink is no line's key
        "next_word": np.eye(ctx.n, k=1, dtype=bool) & ctx.allowed,
        "diagonal": np.eye(ctx.n, dtype=bool) & ~ctx.sink[None, :],
        "delimiter": specials & ctx.allowed & off_band & (not ctx.causal),  # causal: folded into vertical
        "vertical": _vertical_columns(attention, ctx, off_band, rows)[:, :, None, :] & off_band & ctx.allowed,
        "same_word_other_sentence": ctx.same_word_other_sentence,
        "same_word": ctx.same_word,
    }
    evidence: dict[str, np.ndarray] = {}
    centred = _beyond_columns(attention, ctx, rows)
    for name, mask in masks.items():
        scored = centred if name in SAME else attention
        evidence[name], evidence[f"{name}_top1"], evidence[f"{name}_top2"] = _shares(scored, mask, rows)
    ordinary = ctx.allowed & ~specials
    for name in LINES:
        evidence[f"{name}_contrast"] = _contrast(attention, masks[name] & ordinary, ordinary, rows)
    for name in COLUMNS:
        evidence[f"{name}_dark"] = _dark_share(attention, masks[name], rows)
    evidence["uniformity"] = _uniformity(attention, ctx, rows)
    sees_other = (ctx.allowed & ~ctx.same_sentence).any(axis=1)[:, None]
    block = ctx.same_sentence & ~specials & ctx.allowed & sees_other
    evidence["block"] = _shares(attention, block, rows)[0]
    evidence["block_share"] = _own_sentence_share(attention, block, ordinary & sees_other, rows)
    evidence["sink"], evidence["sink_top1"], evidence["sink_top2"] = _shares(attention, ctx.sink[None, :] & ctx.allowed,
                                                                             rows)
    return {name: evidence[name] for name in EVIDENCE}


# ---- rules ----------------------------------------------------------------------------------
# how far a score must lie past its threshold for confidence 0.88 (0.5 + 0.5 tanh 1): a tenth of
# the scale of a share; for a ratio threshold (a line's contrast) a tenth of the threshold
MARGIN_WIDTH = 0.1


def _width(threshold: float) -> float:
    return MARGIN_WIDTH * max(1.0, threshold) if np.isfinite(threshold) else MARGIN_WIDTH


@dataclass(frozen=True)
class _Test:
    """One condition of a rule, per head ``[layer, head]``: whether it ``holds``, and its ``margin``:
    how far, in :data:`MARGIN_WIDTH` units, the scores lie from the threshold that would flip it
    (> 0: holds by that much; < 0: fails by that much). ``&`` and ``|`` combine conditions: a
    conjunction flips at its closest condition, a disjunction at its strongest."""

    holds: np.ndarray
    margin: np.ndarray

    def __and__(self, other: _Test) -> _Test:
        return _Test(self.holds & other.holds, np.minimum(self.margin, other.margin))

    def __or__(self, other: _Test) -> _Test:
        return _Test(self.holds | other.holds, np.maximum(self.margin, other.margin))


def _above(score: np.ndarray, threshold: float) -> _Test:
    """``score >= threshold``; a threshold of 0 or less on a share is switched off (no margin)."""
    holds = score >= threshold
    margin = (score - threshold) / _width(threshold)
    return _Test(holds, np.where(holds, np.inf, margin) if threshold <= 0 else margin)


def _below(score: np.ndarray, threshold: float) -> _Test:
    """``score < threshold`` (an infinite threshold always holds, with no margin)."""
    return _Test(score < threshold, (threshold - score) / _width(threshold))


def _either(tests: Iterable[_Test]) -> _Test:
    return functools.reduce(operator.or_, tests)


def margin_confidence(margin: np.ndarray | float) -> np.ndarray:
    """``0.5 + 0.5 tanh(margin)``: 0.5 at a threshold (a coin toss), 0.88 one :data:`MARGIN_WIDTH`
    past it, 0.98 two widths past it."""
    return 0.5 + 0.5 * np.tanh(np.maximum(np.asarray(margin, dtype=np.float64), 0.0))


def decide(evidence: dict[str, np.ndarray], is_pair: bool, causal: bool = False,
           thresholds: dict[str, float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Apply the rules of the module docstring to evidence ``name -> [layer, head]``.

    ``thresholds`` override the calibrated ones for the model kind. Returns labels (``[layer,
    head]`` of str) and confidences (``[layer, head]`` floats, see the module docstring).
    """
    t = {**thresholds_for(causal), **(thresholds or {})}
    shape = next(iter(evidence.values())).shape
    score = {name: np.nan_to_num(np.asarray(evidence[name], dtype=np.float64), nan=-1.0) for name in EVIDENCE}
    labels = np.full(shape, "heterogeneous", dtype=object)
    confidence = np.zeros(shape)
    undecided = np.ones(shape, dtype=bool)
    blocked = np.full(shape, np.inf)  # how far the earlier rules, which failed, are from holding

    def assign(test: _Test, label: np.ndarray | str) -> None:
        nonlocal blocked
        chosen = test.holds & undecided
        labels[chosen] = label[chosen] if isinstance(label, np.ndarray) else label
        confidence[chosen] = margin_confidence(np.minimum(test.margin, blocked))[chosen]
        undecided[chosen] = False
        blocked = np.where(test.holds, blocked, np.minimum(blocked, -test.margin))

    def best(names: tuple[str, ...], suffix: str) -> np.ndarray:
        return np.max([score[name + suffix] for name in names], axis=0)

    # a word whose other occurrence is the darkest key of most of its rows, and mid-grey, names the
    # head even under a column and a line (labelling rule 1 comes first)
    for name in SAME:
        assign(_above(score[f"{name}_top1"], t["same_strong_top1"]) & _above(score[name], DARK_WEIGHT), name)

    column_top1 = best(COLUMNS, "_top1")
    line_top1 = best(LINES, "_top1")
    line_seen = _either(_above(score[f"{name}_top2"], t["vd_line_top2"]) & _above(score[name], t["vd_line_mass"])
                        for name in LINES)
    line_contrast = best(LINES, "_contrast")
    line_stands_out = _above(line_contrast, t["vd_line_contrast"])
    assign(_above(column_top1, t["vd_column_top1"]) & (_above(line_top1, t["vd_line_top1"]) | line_seen
                                                      | line_stands_out), "vertical_diagonal")

    # after vertical+diagonal: a column and a line over every row describe a head better than
    # the few rows whose word repeats
    for name in SAME:
        assign(_above(score[f"{name}_top2"], t["same_top2"]) & _above(score[name], t["same_mass"]), name)

    # block: rows keep to their own sentence unevenly, with no line in sight (not even a faint one)
    no_line = _below(line_top1, t["dominant_top1"]) & _below(line_contrast, t["block_line_contrast"])
    if is_pair:  # ... even when a column is the darkest cell of some rows, if not of most
        keeps = _above(score["block_share"], t["block_share"]) & _below(column_top1, t["block_column_top1"])
        assign(keeps & no_line & _below(score["uniformity"], t["uniform"]), "block")

    single = (*LINES, *COLUMNS)
    top1 = np.stack([score[f"{name}_top1"] for name in single])  # [structure, layer, head]
    winner = top1.argmax(axis=0)
    winner_top1, runner_up_top1 = np.sort(top1, axis=0)[-1], np.sort(top1, axis=0)[-2]
    winner_mass = np.take_along_axis(np.stack([score[name] for name in single]), winner[None], axis=0)[0]
    # a column must also be dark (mid-grey) on enough rows; a pale one is the background of a bag of words
    dark = np.stack([np.ones(shape) if name in LINES else score[f"{name}_dark"] for name in single])
    winner_dark = np.take_along_axis(dark, winner[None], axis=0)[0]
    # the winner's lead over the runner-up: a near tie could go to the other structure
    lead = _Test(np.ones(shape, dtype=bool), (winner_top1 - runner_up_top1) / MARGIN_WIDTH)
    assign(_above(winner_top1, t["dominant_top1"]) & _above(winner_mass, t["dominant_mass"])
           & _above(winner_dark, t["column_dark"]) & lead, np.array(single, dtype=object)[winner])
    assign(_above(score["uniformity"], t["uniform"]), "bag_of_words")
    if is_pair:
        assign(_above(score["block"], t["block"]) & no_line, "block")
    # a map whose only column is pale reads as even, if less so than rule 4's bag of words
    assign(_above(score["uniformity"], t["uniform_pale"]) & _below(best(COLUMNS, "_dark"), t["column_dark"]),
           "bag_of_words")
    assign(_Test(undecided.copy(), np.full(shape, np.inf)), "heterogeneous")  # as sure as the closest rule is far
    if causal:
        _split_sink(labels, confidence, _above(score["sink_top1"], t["dominant_top1"]))
    return labels, confidence


def _split_sink(labels: np.ndarray, confidence: np.ndarray, on_sink: _Test) -> None:
    """Causal *vertical* heads whose column is the first position become *sink*; a near miss either way lowers
    the confidence to that margin (changes ``labels`` and ``confidence`` in place)."""
    vertical = labels == "vertical"
    labels[vertical & on_sink.holds] = "sink"
    closeness = margin_confidence(np.abs(on_sink.margin))
    confidence[vertical] = np.minimum(confidence, closeness)[vertical]


# ---- results --------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class HeadPatterns:
    """The pattern of every head on one input: ``labels``/``confidence`` ``[layer, head]`` (0-indexed),
    ``evidence`` name -> ``[layer, head]`` (see the module docstring)."""

    labels: np.ndarray
    confidence: np.ndarray
    evidence: dict[str, np.ndarray]
    model: str = ""
    tokens: tuple[str, ...] = ()
    causal: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.labels.shape[0]), int(self.labels.shape[1])

    def kovaleva(self) -> np.ndarray:
        """Kovaleva et al.'s type of each head ``[layer, head]``."""
        return np.vectorize(lambda name: PATTERNS[name].kovaleva, otypes=[object])(self.labels)

    def to_frame(self) -> Any:
        """One row per head: ``layer``, ``head`` (0-indexed), ``label``, ``kovaleva``, ``confidence``, evidence."""
        import pandas as pd

        layers, heads = np.indices(self.shape)
        columns: dict[str, Any] = {"layer": layers.ravel(), "head": heads.ravel(), "label": self.labels.ravel(),
                                   "kovaleva": self.kovaleva().ravel(), "confidence": self.confidence.ravel()}
        columns.update({name: value.ravel() for name, value in self.evidence.items()})
        return pd.DataFrame(columns)

    def to_text(self) -> str:
        """A layers x heads table of ``label confidence`` (short label names, legend below)."""
        layers, heads = self.shape
        lines = ["pattern per head (layers and heads 0-indexed); cell = label confidence"]
        lines.append(" " * 9 + "".join(f"{'h' + str(h):<11}" for h in range(heads)).rstrip())
        for layer in range(layers):
            cells = [f"{PATTERNS[self.labels[layer, h]].short:<6}{self.confidence[layer, h]:.2f} "
                     for h in range(heads)]
            lines.append(f"layer {layer:<2} " + "".join(cells).rstrip())
        used = sorted(set(self.labels.ravel()), key=list(PATTERNS).index)
        lines.append("legend: " + ", ".join(f"{PATTERNS[name].short} = {name}" for name in used))
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()

    def _repr_html_(self) -> str:
        caption = f"{self.model}: pattern per head (layers and heads 0-indexed)"
        frame = self.to_frame()[["layer", "head", "label", "kovaleva", "confidence"]]
        return str(frame.style.set_caption(caption).format(precision=2).hide(axis="index").to_html())


def classify_heads(record: AttentionRecord, context: TokenContext | None = None,
                   thresholds: dict[str, float] | None = None) -> HeadPatterns:
    """Classify every head of ``record`` on its input (attention ``[layer, head, q_pos, k_pos]``).

    Causal models are scored against causal templates: no next word, no delimiter class (attention
    to the first token counts as vertical), and only keys at or before the query. A model with learned
    sinks (gpt-oss) is classified on each row's share of what it gives the tokens (the row over 1 minus its
    sink mass): the pattern is the shape of the attention a head spends on tokens; how much it parks in the
    learned sink is the sink report's ``learned``.
    """
    ctx = context or token_context(record)
    row_mass = record.row_mass()  # [layer, head, q_pos], or None: every row sums to 1
    attention = record.attention if row_mass is None else record.attention / np.maximum(row_mass, 1e-12)[..., None]
    evidence = pattern_evidence(attention, ctx)
    labels, confidence = decide(evidence, ctx.is_pair, ctx.causal, thresholds)
    return HeadPatterns(labels, confidence, evidence, model=record.model.name, tokens=ctx.tokens, causal=ctx.causal)


def label_codes(labels: np.ndarray) -> np.ndarray:
    """``[layer, head]`` label names -> their indices in :data:`PATTERNS`."""
    index = {name: i for i, name in enumerate(PATTERNS)}
    return np.vectorize(index.__getitem__, otypes=[np.int64])(labels)


# A head is *stable* over a corpus when its most common label is carried by at least this share of
# the inputs, counted over at least STABLE_MIN_INPUTS inputs. Checked out of sample by
# `attnscope patterns --evaluate` (evaluate.evaluate_stability): on Brown sentences the report never
# saw, a stable head keeps its label on a share of inputs close to this one.
STABLE_SHARE = 0.85
STABLE_MIN_INPUTS = 20


@dataclass(frozen=True, eq=False)
class CorpusPatterns:
    """Patterns per head over a corpus: ``counts`` ``[layer, head, class]`` of inputs per label
    (classes in :data:`PATTERNS` order); the head's label is its most frequent one (its *modal*
    label), ``share`` (also ``confidence``) the share of inputs that carried it, and the head is
    ``stable`` when that share is at least :data:`STABLE_SHARE` over at least
    :data:`STABLE_MIN_INPUTS` inputs."""

    counts: np.ndarray
    mean_evidence: dict[str, np.ndarray] = field(default_factory=dict)
    model: str = ""
    _evidence_sums: dict[str, Any] = field(default_factory=dict, repr=False)
    _evidence_counts: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def n_inputs(self) -> int:
        return int(self.counts[0, 0].sum())

    @property
    def labels(self) -> np.ndarray:
        return np.array(list(PATTERNS), dtype=object)[self.counts.argmax(axis=-1)]

    @property
    def share(self) -> np.ndarray:
        """``[layer, head]``: the share of inputs that carried the head's modal label."""
        return self.counts.max(axis=-1) / np.maximum(self.counts.sum(axis=-1), 1)

    @property
    def confidence(self) -> np.ndarray:
        return self.share

    @property
    def stable(self) -> np.ndarray:
        """``[layer, head]`` bool: the modal label's share is at least :data:`STABLE_SHARE` (never on
        fewer than :data:`STABLE_MIN_INPUTS` inputs, where a share says little)."""
        return (self.share >= STABLE_SHARE) & (self.n_inputs >= STABLE_MIN_INPUTS)

    @property
    def runner_up(self) -> np.ndarray:
        """``[layer, head]``: each head's second most common label (``""`` where one label carried every input)."""
        second = np.argsort(-self.counts, axis=-1, kind="stable")[..., 1]
        names = np.array(list(PATTERNS), dtype=object)[second]
        return np.where(np.take_along_axis(self.counts, second[..., None], axis=-1)[..., 0] > 0, names, "")

    @property
    def runner_up_share(self) -> np.ndarray:
        """``[layer, head]``: the share of inputs that carried the runner-up label."""
        return np.sort(self.counts, axis=-1)[..., -2] / np.maximum(self.counts.sum(axis=-1), 1)

    @property
    def mixed(self) -> np.ndarray:
        """``[layer, head]`` bool: a head that is not stable, but whose two most common labels together carry
        at least :data:`STABLE_SHARE` of the inputs (over at least :data:`STABLE_MIN_INPUTS`): one behaviour
        whose strength sits near the threshold between two labels on different inputs (e.g. a [CLS] column
        that is ``delimiter`` on some inputs and too faint for it, ``heterogeneous``, on others), reported as
        "mixed with" its runner-up rather than as one label it keeps on too few inputs."""
        both = self.share + self.runner_up_share
        return ~self.stable & (both >= STABLE_SHARE) & (self.n_inputs >= STABLE_MIN_INPUTS)

    def share_of(self, labels: np.ndarray) -> np.ndarray:
        """``[layer, head]``: the share of inputs on which each head got ``labels[layer, head]``
        (e.g. the labels another corpus gave the heads)."""
        carried = np.take_along_axis(self.counts, label_codes(labels)[..., None], axis=-1)[..., 0]
        return carried / np.maximum(self.counts.sum(axis=-1), 1)

    def shares(self) -> dict[str, float]:
        """Share of all (head, input) maps per class."""
        totals = self.counts.sum(axis=(0, 1))
        return {name: float(v) for name, v in zip(PATTERNS, totals / max(totals.sum(), 1))}

    def to_frame(self) -> Any:
        """One row per head: ``layer``, ``head`` (0-indexed), modal ``label``, its ``share``, ``stable``, the
        ``runner_up`` label and its ``runner_up_share``, ``mixed`` (see :attr:`mixed`), ``inputs`` and the share
        of every class (``share_<label>``)."""
        import pandas as pd

        layers, heads = np.indices(self.counts.shape[:2])
        columns: dict[str, Any] = {"layer": layers.ravel(), "head": heads.ravel(), "label": self.labels.ravel(),
                                   "share": self.share.ravel(), "stable": self.stable.ravel(),
                                   "runner_up": self.runner_up.ravel(), "runner_up_share": self.runner_up_share.ravel(),
                                   "mixed": self.mixed.ravel(),
                                   "inputs": np.full(layers.size, self.n_inputs)}
        shares = self.counts / np.maximum(self.counts.sum(axis=-1, keepdims=True), 1)
        columns.update({f"share_{name}": shares[..., i].ravel() for i, name in enumerate(PATTERNS)})
        return pd.DataFrame(columns)

    def _repr_html_(self) -> str:
        caption = f"{self.model}: dominant pattern per head over {self.n_inputs} inputs (0-indexed)"
        return str(self.to_frame().style.set_caption(caption).format(precision=2).hide(axis="index").to_html())

    @classmethod
    def add(cls, so_far: CorpusPatterns | None, item: HeadPatterns) -> CorpusPatterns:
        """``so_far`` with one more input's patterns counted (``None``: start from nothing)."""
        one_hot = np.eye(len(PATTERNS), dtype=np.int64)[label_codes(item.labels)]  # [layer, head, class]
        sums = dict(so_far._evidence_sums) if so_far else {}
        seen = dict(so_far._evidence_counts) if so_far else {}
        for name, value in item.evidence.items():
            sums[name] = sums.get(name, 0.0) + np.nan_to_num(value)
            seen[name] = seen.get(name, 0) + ~np.isnan(value)
        counts = one_hot if so_far is None else so_far.counts + one_hot
        mean_evidence = {name: np.divide(total, seen[name], out=np.full(np.shape(total), np.nan),
                                         where=seen[name] > 0) for name, total in sums.items()}
        return cls(counts, mean_evidence, item.model, sums, seen)

    @classmethod
    def from_rows(cls, rows: Any, model: str = "") -> CorpusPatterns:
        """Count the patterns of head rows (``layer``, ``head``, ``label``, ``ev_*``; one row per input,
        layer and head, in any order), as :meth:`add` counts them one input at a time."""
        if not len(rows):
            raise AttnscopeError("no inputs to aggregate")
        shape = (int(rows["layer"].max()) + 1, int(rows["head"].max()) + 1)
        cell = rows["layer"].to_numpy(dtype=np.int64) * shape[1] + rows["head"].to_numpy(dtype=np.int64)  # [row]
        codes = label_codes(rows["label"].to_numpy())
        counts = np.bincount(cell * len(PATTERNS) + codes, minlength=shape[0] * shape[1] * len(PATTERNS))
        sums, seen = {}, {}
        for column in [name for name in rows.columns if name.startswith("ev_")]:
            values = rows[column].to_numpy(dtype=float)
            sums[column[3:]] = np.bincount(cell, np.nan_to_num(values), minlength=cell.max() + 1).reshape(shape)
            seen[column[3:]] = np.bincount(cell, ~np.isnan(values), minlength=cell.max() + 1).reshape(shape)
        mean_evidence = {name: np.divide(total, seen[name], out=np.full(shape, np.nan), where=seen[name] > 0)
                         for name, total in sums.items()}
        return cls(counts.reshape(*shape, len(PATTERNS)), mean_evidence, model, sums, seen)

    @classmethod
    def from_heads(cls, items: Iterable[HeadPatterns]) -> CorpusPatterns:
        """Count the patterns of many inputs (every ``HeadPatterns`` of the same model)."""
        result: CorpusPatterns | None = None
        for item in items:
            result = cls.add(result, item)
        if result is None:
            raise AttnscopeError("no inputs to aggregate")
        return result
