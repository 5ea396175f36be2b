"""Which heads, reading which earlier tokens, made the model choose a token: direct logit attribution
and the logit lens, for decoder-only language models (Llama family, SmolLM2, Gemma 2/3, GPT-2).

:func:`direct_logit_attribution` splits one logit (or the difference of two) at one position into
the embeddings, every head (and, per head, every source token it read), every MLP and the biases,
from one forward pass with capture; the terms sum to the logit (the final norm's scale is the
run's; see :mod:`attnscope.attribution.terms`). :func:`logit_lens` unembeds the residual stream
after each layer through the final norm and the LM head.

>>> dla = direct_logit_attribution("smollm2", "The capital of France is")   # doctest: +SKIP
>>> dla.top_heads(5)                       # [(layer, head, signed term), ...]   # doctest: +SKIP
>>> dla.head_sources[dla.top_heads(1)[0][:2]]   # [source_pos]: which tokens that head pushed through  # doctest: +SKIP

Layers, heads and positions are 0-indexed.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from ..capture.attention import capture
from ..capture.extract import as_loaded
from ..capture.generate import prompt_ids
from ..capture.tokens import readable_tokens
from ..errors import AttnscopeError
from ..models.loading import LoadedModel
from ..records.generation import GenerationRecord
from .terms import (
    PositionRows,
    decompose,
    lens_top,
    lm_head,
    logit_direction,
    named_module,
    residual_parts,
    unembedding,
)

RUNNER_UP = "runner-up"  # contrast: the model's best next token other than the target


@dataclass(frozen=True, eq=False)
class Attribution:
    """The terms of one logit (or logit difference) at one position; they sum to :attr:`logit`.

    ``heads`` ``[layer, head]``: each head's term; ``head_sources`` ``[layer, head, source_pos]``
    (sources ``0..position``): that term split over the tokens the head read (``α_tj · v_j W_O^h``
    through the norms); ``mlps`` ``[layer]``; ``attention_bias`` ``[layer]`` (the attention output
    projection's bias, 0 where there is none); ``embeddings``; ``final_bias`` (final norm's and LM
    head's biases). ``logit``: the model's own ``logit(target)``, minus ``logit(contrast)`` when a
    contrast is given (before any final logit softcapping). ``final_scale``: the final norm's
    ``1 / rms`` at this position in this run, which every term shares.
    """

    model: str
    tokens: tuple[str, ...]
    position: int
    target_id: int
    target_token: str
    contrast_id: int | None
    contrast_token: str | None
    logit: float
    heads: np.ndarray
    head_sources: np.ndarray
    mlps: np.ndarray
    attention_bias: np.ndarray
    embeddings: float
    final_bias: float
    final_scale: float

    def total(self) -> float:
        """The sum of every term (equals :attr:`logit` to float round-off)."""
        return float(self.heads.sum() + self.mlps.sum() + self.attention_bias.sum() + self.embeddings
                     + self.final_bias)

    def layers(self) -> np.ndarray:
        """``[layer]``: each layer's attention term (its heads and its output bias)."""
        return cast(np.ndarray, self.heads.sum(-1) + self.attention_bias)

    def top_heads(self, k: int = 10) -> list[tuple[int, int, float]]:
        """The ``k`` heads with the largest terms by size, signed: ``[(layer, head, term), ...]``."""
        order = np.argsort(-np.abs(self.heads), axis=None)[:k]
        return [(int(layer), int(head), float(self.heads[layer, head]))
                for layer, head in zip(*np.unravel_index(order, self.heads.shape))]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, arrays as nested lists."""
        plain = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return {name: value.round(7).tolist() if isinstance(value, np.ndarray) else
                list(value) if isinstance(value, tuple) else value for name, value in plain.items()}


def token_id(loaded: LoadedModel, token: int | str, what: str = "target") -> int:
    """A token id from an id or a text that the tokenizer encodes as exactly one token (``" Paris"``)."""
    vocabulary = int(cast(torch.Tensor, lm_head(loaded).weight).shape[0])
    if isinstance(token, int):
        if not 0 <= token < vocabulary:
            raise AttnscopeError(f"{what} token id {token} is outside the vocabulary (0..{vocabulary - 1})")
        return token
    if not token:
        raise AttnscopeError(f"the {what} token is empty")
    ids = list(loaded.tokenizer(token, add_special_tokens=False)["input_ids"])
    if len(ids) != 1:
        pieces = readable_tokens(loaded.tokenizer, ids)
        raise AttnscopeError(f"{what} {token!r} is {len(ids)} tokens for {loaded.name} ({' | '.join(pieces)}), not one; "
                             "give a single token (mind the leading space: ' Paris')")
    return int(ids[0])


def _resolve_position(position: int, n_tokens: int) -> int:
    resolved = position + n_tokens if position < 0 else position
    if not 0 <= resolved < n_tokens:
        raise AttnscopeError(f"position {position} is outside the prompt's {n_tokens} tokens (0-indexed; -1 = last)")
    return resolved


def last_logits_only(loaded: LoadedModel, keep: int = 1) -> dict[str, int]:
    """The forward pass's keyword that runs the LM head on the last ``keep`` positions only, where the model has it."""
    return {"logits_to_keep": keep} if "logits_to_keep" in inspect.signature(loaded.model.forward).parameters else {}


def logits_at(loaded: LoadedModel, input_ids: torch.Tensor, position: int) -> torch.Tensor:
    """Run the model on ``input_ids`` ``[1, pos]``; the logits at ``position``, ``[vocab]`` float32
    (the LM head runs on the positions from ``position`` on only, where the model allows it)."""
    keep = input_ids.shape[1] - position
    logits = loaded.model(input_ids=input_ids, use_cache=False, **last_logits_only(loaded, keep)).logits[0]
    return cast(torch.Tensor, logits[-keep].float())


def direct_logit_attribution(model: LoadedModel | str, prompt: str | Sequence[int], target: int | str | None = None,
                             position: int = -1, contrast: int | str | None = None) -> Attribution:
    """Split the logit of ``target`` at ``position`` of ``prompt`` into the terms of :class:`Attribution`.

    ``prompt``: a text, or token ids. ``target``: a token id or a one-token text (``" Paris"``); None = the model's top next token at
    ``position``. ``position``: 0-indexed, negative counts from the end (default: the last).
    ``contrast``: a token (id or text) whose logit is subtracted, or :data:`RUNNER_UP` for the best
    token other than the target. One forward pass: each layer's probability row of ``position``
    and its values are captured (the earlier rows run fused), the sublayer outputs are hooked.
    """
    loaded = as_loaded(model)
    unembedding(loaded)
    ids = _ids_of(loaded, prompt)
    t = _resolve_position(position, len(ids))
    wanted = None if target is None else token_id(loaded, target)
    wanted_contrast = None if contrast is None or contrast == RUNNER_UP else token_id(loaded, contrast, "contrast")
    rows = PositionRows((t,))
    input_ids = torch.tensor([ids], device=loaded.input_device)
    with torch.inference_mode(), capture(loaded.sites, recorder=rows), residual_parts(loaded, [t]) as parts:
        logits = logits_at(loaded, input_ids, t)  # capture() refuses a pass that never called attnscope's function
    target_id = int(logits.argmax()) if wanted is None else wanted
    contrast_id = _runner_up(logits, target_id) if contrast == RUNNER_UP else wanted_contrast
    direction, head_bias = logit_direction(loaded, target_id)
    logit = _uncapped(loaded, parts.final, target_id)
    if contrast_id is not None:
        contrast_direction, contrast_bias = logit_direction(loaded, contrast_id)
        direction, head_bias = direction - contrast_direction, head_bias - contrast_bias
        logit -= _uncapped(loaded, parts.final, contrast_id)
    with torch.inference_mode():
        terms = decompose(loaded, rows, parts, direction, head_bias)
    tokens = readable_tokens(loaded.tokenizer, ids)
    name = lambda token: readable_tokens(loaded.tokenizer, [token])[0]
    return Attribution(
        model=loaded.name, tokens=tokens, position=t, target_id=target_id, target_token=name(target_id),
        contrast_id=contrast_id, contrast_token=None if contrast_id is None else name(contrast_id), logit=logit,
        heads=terms.heads.numpy(), head_sources=terms.head_sources.numpy(), mlps=terms.mlps.numpy(),
        attention_bias=terms.attention_bias.numpy(), embeddings=terms.embeddings, final_bias=terms.final_bias,
        final_scale=terms.final_scale)


def _ids_of(loaded: LoadedModel, prompt: str | Sequence[int]) -> list[int]:
    """A prompt's token ids: a text as the tokenizer encodes it, or the ids given; refused past the model's limit
    (every analysis built on one forward pass: DLA, the lens, routes, QK attribution)."""
    ids = prompt_ids(loaded, prompt, chat=False) if isinstance(prompt, str) else [int(i) for i in prompt]
    if not ids:
        raise AttnscopeError("the prompt is empty")
    loaded.check_length(len(ids), "the text" if isinstance(prompt, str) else "the prompt")
    return ids


def _runner_up(logits: torch.Tensor, target_id: int) -> int:
    """The best token at these logits other than ``target_id``."""
    top = logits.topk(2).indices.tolist()
    return int(top[1] if top[0] == target_id else top[0])


def _uncapped(loaded: LoadedModel, final: torch.Tensor | None, token: int) -> float:
    """The model's logit of ``token`` before any softcapping: LM head of the final norm of its last residual."""
    assert final is not None
    norm = named_module(loaded, unembedding(loaded).final_norm)
    head = lm_head(loaded)
    with torch.inference_mode():
        normed = norm(final[:1].to(cast(torch.Tensor, head.weight).dtype))
        return float(head(normed)[0, token])


# ---- the logit lens --------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class LogitLens:
    """The top-k next tokens read off the residual stream after each layer, through the final norm and LM head.

    ``positions`` ``[position]`` (0-indexed, in ``tokens``); ``top_ids``/``top_probs``
    ``[position, layer, k]`` (probabilities of the softmax over the whole vocabulary);
    ``top_tokens[position][layer]``: the k tokens as text. The last layer's row is the model's own
    next-token distribution.
    """

    model: str
    tokens: tuple[str, ...]
    positions: np.ndarray
    top_ids: np.ndarray
    top_probs: np.ndarray
    top_tokens: tuple[tuple[tuple[str, ...], ...], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "tokens": list(self.tokens), "positions": self.positions.tolist(),
                "top_ids": self.top_ids.tolist(), "top_probs": self.top_probs.round(6).tolist(),
                "top_tokens": [[list(layer) for layer in position] for position in self.top_tokens]}


def logit_lens(model: LoadedModel | str, prompt: str | Sequence[int], positions: Sequence[int] | None = None,
               k: int = 5) -> LogitLens:
    """The logit lens of ``prompt`` (a text, or token ids) at ``positions`` (0-indexed, negative from the
    end; default: the last), from one forward pass."""
    loaded = as_loaded(model)
    unembedding(loaded)
    ids = _ids_of(loaded, prompt)
    chosen = [_resolve_position(p, len(ids)) for p in (positions if positions is not None else [-1])]
    if k < 1:
        raise AttnscopeError("k must be at least 1")
    with (torch.inference_mode(), residual_parts(loaded, chosen, sublayers=False, blocks=True) as parts):
        loaded.model(input_ids=torch.tensor([ids], device=loaded.input_device), use_cache=False,
                     **last_logits_only(loaded))
    with torch.inference_mode():  # outside the hooks
        top_ids, top_probs = lens_top(loaded, parts.blocks, k)
    tokenizer = loaded.tokenizer
    texts = tuple(tuple(readable_tokens(tokenizer, layer.tolist()) for layer in position) for position in top_ids)
    return LogitLens(loaded.name, readable_tokens(tokenizer, ids), np.array(chosen), top_ids, top_probs, texts)


def generation_lens(model: LoadedModel | str, record: GenerationRecord, k: int = 5) -> LogitLens:
    """The logit lens of every step of a saved generation: one teacher-forced pass of the record's text,
    read at each position that chose a generated token (``positions[step] = prompt_length - 1 + step``), with
    any ``k``. A generation made with ``StepAttribution(lens=True)`` (``--lens``) holds its top ``lens_top``
    already (``lens_ids``/``lens_probs``), from its own passes."""
    steps = range(record.prompt_length - 1, len(record.tokens) - 1)
    return logit_lens(model, record.token_ids.tolist(), list(steps), k)
