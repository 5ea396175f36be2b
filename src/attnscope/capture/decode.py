"""The step debugger: decode an encoder-decoder one token at a time and keep, at every step, the
prefix, the top-k next tokens with their logits and probabilities, and the cross-attention of the
newest decoder position over the source (every layer and head).

Each step is one full teacher-forced forward pass of the prefix (no key/value cache), so what is
shown is exactly the model's forward on that prefix; greedy decoding this way gives the same
tokens as ``model.generate(num_beams=1)``. Works on any Hugging Face encoder-decoder that
attnscope can load (the toy translator, a local MarianMT folder, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import AttnscopeError
from ..models.adapters import AttentionSite
from ..models.loading import LoadedModel
from ..records.decoding import DecodeTrace, Step
from ..records.generation import Candidate
from .attention import capture
from .recorders import AttentionCall, Recorder
from .tokens import ids_within


def _source_ids(loaded: LoadedModel, source: str) -> torch.Tensor:
    if not loaded.is_encoder_decoder:
        raise AttnscopeError(f"model {loaded.name!r} is not an encoder-decoder; the step debugger needs one")
    if not source.strip():
        raise AttnscopeError("source text is empty")
    ids = ids_within(loaded.tokenizer, [source], loaded.max_length, "source text")[0]
    return torch.tensor([ids], device=loaded.input_device)


@dataclass
class NewestCrossRows(Recorder):
    """A capture's recorder that keeps, per cross-attention layer, the newest decoder position's
    row: ``rows[layer]`` ``[head, source_pos]`` (a batch of one).

    It asks for every site, so every site runs eagerly as the step debugger always has: PyTorch's
    fused kernel would move the logits by float32 rounding (about 1e-6), enough to flip a near-tie
    and change the toy translator's published figures."""

    rows: dict[int, torch.Tensor] = field(default_factory=dict)

    def keep(self, site: AttentionSite, call: AttentionCall) -> None:
        if site.kind == "cross":
            self.rows[site.layer] = call.probs[0, :, -1, :]


def step_forward(loaded: LoadedModel, source_ids: torch.Tensor, prefix_ids: list[int]) -> tuple[torch.Tensor, np.ndarray]:
    """Logits of the next token ``[vocab]`` and the newest position's cross-attention ``[layer, head, source_pos]``."""
    newest = NewestCrossRows()
    with torch.inference_mode(), capture(loaded.sites, recorder=newest):
        logits = loaded.model(input_ids=source_ids, decoder_input_ids=torch.tensor([prefix_ids], device=source_ids.device),
                              use_cache=False).logits
    rows = [newest.rows[layer].to(source_ids.device) for layer in sorted(newest.rows)]
    cross = torch.stack(rows).cpu()  # [layer, head, source_pos], one copy to the CPU
    return logits[0, -1].float().cpu(), cross.numpy()


def _candidates(loaded: LoadedModel, logits: torch.Tensor, top_k: int) -> tuple[Candidate, ...]:
    probabilities = torch.softmax(logits, dim=-1)
    top = torch.topk(logits, top_k)
    return tuple(
        Candidate(loaded.tokenizer.convert_ids_to_tokens(int(i)), int(i), float(probabilities[i]), logit=float(v))
        for v, i in zip(top.values, top.indices)
    )


def decode_steps(loaded: LoadedModel, source: str, *, beams: int = 1, top_k: int = 5,
                 max_steps: int | None = None) -> DecodeTrace:
    """Decode ``source`` step by step, greedily (``beams=1``) or with beam search.

    Beam search keeps the ``beams`` best hypotheses by summed log-probability; a hypothesis that
    emits the end token is finished, and decoding stops when the best live hypothesis scores below
    the best finished one (or at ``max_steps``). The steps follow the final best hypothesis.
    """
    source_ids = _source_ids(loaded, source)
    config = loaded.config
    if not (1 <= top_k <= config.vocab_size and 1 <= beams <= config.vocab_size):
        raise AttnscopeError(f"top_k and beams must be between 1 and the vocabulary size, {config.vocab_size}")
    start, eos = loaded.decoder_start_id, config.eos_token_id
    limit = max_steps or min(64, 2 * source_ids.shape[1] + 10)
    live: list[tuple[list[int], float, list[Step]]] = [([start], 0.0, [])]
    finished: list[tuple[list[int], float, list[Step]]] = []
    for index in range(limit):
        expanded = []
        for prefix, score, steps in live:
            logits, cross = step_forward(loaded, source_ids, prefix)
            log_probs = torch.log_softmax(logits, dim=-1)
            candidates = _candidates(loaded, logits, max(top_k, beams))
            for candidate in candidates[:beams]:
                step = Step(index, tuple(loaded.tokenizer.convert_ids_to_tokens(prefix)), candidates[:top_k],
                            candidate.token, cross)
                expanded.append((prefix + [candidate.token_id], score + float(log_probs[candidate.token_id]),
                                 steps + [step]))
        expanded.sort(key=lambda item: item[1], reverse=True)
        live = []
        for hypothesis in expanded[:beams]:
            (finished if hypothesis[0][-1] == eos else live).append(hypothesis)
        if beams > 1 and live:
            summary = tuple((_text(loaded, p), round(s, 4)) for p, s, _ in live)
            prefix, score, steps = live[0]
            live[0] = (prefix, score, steps[:-1] + [_with_beams(steps[-1], summary)])
        if not live or (finished and max(f[1] for f in finished) >= live[0][1]):
            break
    best = max(finished + live, key=lambda item: item[1])
    return DecodeTrace(source, tuple(loaded.tokenizer.convert_ids_to_tokens(source_ids[0].tolist())),
                       tuple(best[2]), _text(loaded, best[0]), "greedy" if beams == 1 else f"beam search ({beams})",
                       loaded.name)


def _with_beams(step: Step, beams: tuple[tuple[str, float], ...]) -> Step:
    return Step(step.index, step.prefix, step.candidates, step.chosen, step.cross_attention, beams)


def _text(loaded: LoadedModel, ids: list[int]) -> str:
    return str(loaded.tokenizer.decode(ids, skip_special_tokens=True))
