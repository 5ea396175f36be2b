"""The retrieval score of attention heads (Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context
Factuality"), computed from the decode-step rows a generation records.

The rule, per needle-in-a-haystack trial (layers and heads 0-indexed, per query head):

* at decoding step ``s`` the model generates the token at position ``n_prompt + s``; the row that chose it is the
  one of position ``n_prompt + s - 1`` (:meth:`~attnscope.records.GenerationRecord.step_attention`);
* head ``(layer, head)`` *retrieves* at that step when its most-attended key (the argmax of the row; ties go to the
  earliest key, as ``numpy.argmax`` does) lies inside the needle's token span and holds the same token id as the
  one being generated (ids compared exactly: a needle token that the answer spells with other tokens, e.g. a
  digit that carries a space in one and not the other, is not retrieved);
* the head's score for the trial is the share of the needle's tokens it retrieved at some step: the number of
  distinct needle positions it copied from, over the needle's length (the set ``g_h ∩ k`` over ``|k|`` of the
  paper's definition). Wu et al.'s released code adds ``1 / |k|`` per step instead, so a head that copies one
  needle token twice counts it twice; with distinct positions the score stays within 0..1.

Over trials, a head's score is the mean of its per-trial scores over the trials that count (those the model
answered: :mod:`attnscope.experiments.needles` states its rule). A learned sink is not a key (rows without it);
a sliding-window layer's rows hold 0 outside its window, so such a head cannot retrieve a needle outside it.
Scores are per query head; a KV group's max or mean is taken from them. Registered as the head function
``retrieval`` (task ``needles``), so :func:`attnscope.head_scores` computes it beside the other head scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import AttnscopeError
from ..records.generation import GenerationRecord
from .head_functions import Columns, HeadFunction, register_head_function

RETRIEVAL_THRESHOLD = 0.1  # Wu et al.'s threshold for calling a head a retrieval head


def step_top_keys(gen: GenerationRecord) -> np.ndarray:
    """Each decoding step's most-attended key per head, ``[step, layer, head]`` (absolute key positions, int64):
    the argmax of the row that chose each generated token."""
    return np.stack([gen.step_attention(step).argmax(axis=-1) for step in range(gen.n_steps)])


def top_keys_of_rows(rows: Sequence[np.ndarray]) -> np.ndarray:
    """The argmax key of each of ``rows`` (one ``[layer, head, k_pos]`` row per step), ``[step, layer, head]``."""
    return np.stack([row.argmax(axis=-1) for row in rows])


def retrieval_hits(top_keys: np.ndarray, token_ids: Sequence[int] | np.ndarray, n_prompt: int,
                   needle: tuple[int, int]) -> np.ndarray:
    """Which needle tokens each head copied: ``[layer, head, needle_token]`` booleans.

    ``top_keys``: ``[step, layer, head]`` (:func:`step_top_keys`); ``token_ids``: the whole sequence, prompt then
    the generated tokens (step ``s`` generated ``token_ids[n_prompt + s]``); ``needle``: its token span
    ``[start, end)`` in the prompt.
    """
    start, end = needle
    ids = np.asarray(token_ids)
    n_steps, n_layers, n_heads = top_keys.shape
    if not 0 <= start < end <= n_prompt or n_prompt + n_steps > len(ids):
        raise AttnscopeError(f"needle span {start}..{end} and {n_steps} steps do not fit a prompt of {n_prompt} "
                             f"tokens in a sequence of {len(ids)}")
    generated = ids[n_prompt : n_prompt + n_steps][:, None, None]  # [step, 1, 1]
    inside = (top_keys >= start) & (top_keys < end)
    copies = inside & (ids[np.clip(top_keys, 0, len(ids) - 1)] == generated)  # [step, layer, head]
    hits = np.zeros((n_layers, n_heads, end - start), dtype=bool)
    steps, layers, heads = np.nonzero(copies)
    hits[layers, heads, top_keys[steps, layers, heads] - start] = True
    return hits


def retrieval_score(top_keys: np.ndarray, token_ids: Sequence[int] | np.ndarray, n_prompt: int,
                    needle: tuple[int, int]) -> np.ndarray:
    """One trial's retrieval score per head, ``[layer, head]`` in 0..1: the share of the needle's tokens the head
    copied (arguments as :func:`retrieval_hits`)."""
    return retrieval_hits(top_keys, token_ids, n_prompt, needle).mean(axis=-1)


def mean_retrieval_score(trial_scores: Sequence[np.ndarray], counted: Sequence[bool]) -> np.ndarray:
    """The retrieval score over trials, ``[layer, head]``: the mean of the per-trial scores (``[layer, head]`` each)
    of the trials that count; NaN everywhere when none does."""
    if len(trial_scores) != len(counted) or not trial_scores:
        raise AttnscopeError(f"{len(trial_scores)} trial scores for {len(counted)} counted flags")
    kept = [scores for scores, count in zip(trial_scores, counted) if count]
    if not kept:
        return np.full(trial_scores[0].shape, np.nan)
    return np.mean(kept, axis=0)


def retrieval_scores(trials: Any) -> Columns:
    """The registered score: ``trials`` (:class:`~attnscope.experiments.needles.NeedleTrials`, what the ``needles``
    task builds) -> ``{"retrieval": [layer, head]}``, the mean over the trials that counted."""
    found = trials.trials
    return {"retrieval": mean_retrieval_score([trial.scores for trial in found], [trial.counted for trial in found])}


register_head_function(HeadFunction(
    "retrieval", "Retrieval", "needles", "share of the needle's tokens the head copied (its top key inside the needle "
    "holding the token generated), mean over the needle trials the model answered", "Wu et al. 2024",
    retrieval_scores))
