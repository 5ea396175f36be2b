"""Random ordinary tokens said several times: the task of the induction, echo, duplicate- and previous-token head
scores (:mod:`attnscope.experiments.head_functions`) and of the repeated-half loss their masking check measures
(:class:`attnscope.experiments.metrics.RepeatedHalfLoss`). Its own module because the metrics import it and the
prompt tasks (:mod:`attnscope.experiments.tasks`) import the metrics through patching.
"""

from __future__ import annotations

import random

from ..errors import AttnscopeError
from ..models.loading import LoadedModel


def random_token_ids(loaded: LoadedModel, n: int, rng: random.Random) -> list[int]:
    """``n`` distinct token ids drawn by ``rng`` from the model's vocabulary (ids both the tokenizer and the
    embedding have), leaving out special and added tokens (``<|im_start|>``, BOS, pad)."""
    tokenizer = loaded.tokenizer
    vocabulary = min(len(tokenizer), loaded.model.get_input_embeddings().num_embeddings)
    excluded = set(getattr(tokenizer, "all_special_ids", ()) or ()) | set(getattr(tokenizer, "added_tokens_decoder",
                                                                                 {}) or {})
    candidates = [i for i in range(vocabulary) if i not in excluded]
    if n > len(candidates):
        raise AttnscopeError(f"{n} distinct random tokens asked for, but {loaded.name} has only {len(candidates)} "
                             "ordinary ones")
    return rng.sample(candidates, n)


def repeated_random_tokens(loaded: LoadedModel, period: int, *, repeats: int = 2, sequences: int = 1,
                           seed: int = 0) -> list[list[int]]:
    """``sequences`` id sequences, each the tokenizer's BOS (if it has one) then ``period`` distinct random
    tokens (:func:`random_token_ids`) repeated ``repeats`` times: the task of induction, echo, duplicate- and
    previous-token scores (:mod:`attnscope.analysis.head_functions`). Seeded: the same sequences every run."""
    if period < 2 or repeats < 2 or sequences < 1:
        raise AttnscopeError(f"repeated random tokens need a period >= 2, repeats >= 2 and sequences >= 1; got "
                             f"{period}, {repeats} and {sequences}")
    bos = loaded.tokenizer.bos_token_id
    prefix = [] if bos is None else [int(bos)]
    loaded.check_length(len(prefix) + period * repeats, f"a sequence of {repeats} x {period} random tokens")
    rng = random.Random(seed)
    return [prefix + random_token_ids(loaded, period, rng) * repeats for _ in range(sequences)]
