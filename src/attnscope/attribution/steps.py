"""Each generated token's direct logit attribution, and with ``lens=True`` its logit lens, from the generation's own
forward passes.

:class:`StepAttribution` is a :class:`~attnscope.capture.generate.GenerationRecorder`:
``attnscope.generate(model, prompt, recorders=[StepAttribution()])`` (``attnscope generate --attribute``;
``StepAttribution(lens=True)``, ``--lens``, adds the lens). The lens is its own choice because it is another question
(what each layer would predict, not which heads wrote the chosen token: :func:`~attnscope.attribution.dla` and
:func:`~attnscope.attribution.logit_lens` are apart for a prompt too) at another price: the LM head once per layer and
step, 30 products of ``[d_model, vocab]`` a token for SmolLM2, more than the terms cost (``lens_over_plain`` against
``attribute_over_plain`` in ``benchmarks/generate_long.py``).
Step s chose token ``n_prompt + s`` at position ``t = n_prompt - 1 + s``, the last position of the generation's
s-th forward pass (the prompt's pass, then one per step on the key/value cache). So each pass gives what
:func:`~attnscope.attribution.terms.decompose` needs at ``t``, and no pass is added: of every self-attention call,
its last query row and the values of the keys it added (each key's value once, so they grow with the text, and
a sliding-window layer's evicted keys stay known), and, by hooks, the residual-stream pieces at the pass's last
position. Each step's chosen token's logit is split into its terms once its pass is over (when the next pass begins,
whose input is that token), ``SPLIT_STEPS`` steps together (each value and each layer's W_O read once for them all),
and only the terms are kept: the passes' rows and pieces are let go, so memory grows with the record, not with the
steps' rows (1,024 steps after 512 tokens of SmolLM2 held 1.7 GB of them).
Interventions active around the generation apply, as they did to the tokens chosen. Layers and heads are 0-indexed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import torch

from ..capture.generate import GenerationPasses, GenerationRecorder, GenerationShape, GrowingTensor, RecordAdditions
from ..capture.hooks import hooks_paused, local_hooks
from ..capture.plan import MemoryEstimate
from ..capture.recorders import AttentionCall
from ..capture.tokens import readable_tokens
from ..models.adapters import AttentionSite
from ..models.loading import LoadedModel
from ..records import attribution as names
from .terms import (
    LENS_LOGITS_BYTES,
    LENS_SOFTMAX_ROWS,
    PositionRows,
    ResidualParts,
    decompose_positions,
    lens_top,
    logit_direction,
    residual_parts,
)

ATTRIBUTION_TOP_HEADS = 10  # heads per step whose terms are kept split over the source tokens
LENS_TOP = 3  # tokens per layer and step of the logit lens kept
LENS_STEPS = 64  # steps whose logit lens runs at once ([step, vocab] logits per layer)
SPLIT_STEPS = 16  # steps whose terms are split at once (their rows held until then)


class StepAttribution(GenerationRecorder):
    """Direct logit attribution of every step's chosen token, and its logit lens with ``lens`` (see the module
    docstring).

    What it adds to the record (:meth:`finish`):

    * ``attribution_heads`` float32 ``[step, layer, head]``: each head's signed term of the chosen token's
      logit; ``attribution_logits`` float32 ``[step]``: that logit (the sum of every term: heads, MLPs,
      embeddings and biases; see :mod:`attnscope.attribution.terms`);
    * ``attribution_top`` int64 ``[step, rank, 2]``: (layer, head) of the ``top_heads`` heads with the largest
      ``|term|``, largest first, and ``attribution_sources`` float32 ``[step, rank, source_pos]``: their terms
      split over the source tokens they read (sources ``0..len(sequence) - 2``; 0 past the step's position).
      Only the top heads: every head's split would be ``[step, layer, head, source]``, which grows with the
      text squared (SmolLM2, 256 tokens after a 1,000-token prompt: 270 heads x 1,256 sources x 256 steps,
      347 MB) while a view shows a few heads per step (10 heads: 13 MB);
    * with ``lens``: ``lens_ids`` int64 / ``lens_probs`` float32 ``[step, layer, k]``: the logit lens at the step's
      position (the top ``lens_top`` tokens of each layer's residual stream through the final norm and the LM head;
      the last layer's is the model's own next-token distribution), with their text in ``lens_tokens``.
    """

    def __init__(self, top_heads: int = ATTRIBUTION_TOP_HEADS, lens_top: int = LENS_TOP, lens: bool = False) -> None:
        self.top_heads, self.lens_top, self.with_lens = top_heads, lens_top, lens
        if lens:
            self.option = "leave out the logit lens (StepAttribution(lens=False), --lens) or the attribution"
        self.loaded: LoadedModel | None = None
        self.parts: ResidualParts | None = None
        self._start()

    def _start(self) -> None:
        """Nothing kept yet (a recorder may serve several generations, one after the other)."""
        self.rows: dict[int, dict[int, torch.Tensor]] = {}  # per pass not yet split: per layer its last row [head, k]
        self.pending: list[int] = []  # passes over, split together once SPLIT_STEPS of them are (or at the end)
        # per layer: every key's value so far [kv_head, pos, d_head], float32: each step reads them all once, for
        # its heads' outputs (Terms.sources_of converts only the top heads' to float64)
        self.values: dict[int, GrowingTensor] = {}
        self.sites: dict[int, AttentionSite] = {}
        self.passes = GenerationPasses(self.split)
        self.fed: list[int] = []  # the token each pass after the prompt's was fed: the one the pass before chose
        self.steps: list[tuple[np.ndarray, float, np.ndarray, np.ndarray]] = []  # per step: heads, logit, top, split
        self.weights: dict[int, torch.Tensor] = {}  # each layer's per-head W_O, viewed once

    option = "leave out the attribution (recorders=[StepAttribution()], --attribute)"
    label = "attribution"

    def memory(self, shape: GenerationShape) -> MemoryEstimate:
        """Kept: each step's terms and its top heads' split over every source (and the lens's tokens). Working: every
        key's value (in a buffer up to half again as large), ``SPLIT_STEPS`` steps' rows for every layer (and their
        padded tables), one step's top heads' splits; with the lens, each pass's block outputs and the lens's logits
        (:data:`~attnscope.attribution.terms.LENS_LOGITS_BYTES`, and the softmax of
        :data:`~attnscope.attribution.terms.LENS_SOFTMAX_ROWS` rows) beside ``LENS_STEPS`` steps' block outputs
        stacked."""
        steps, positions = shape.max_new_tokens, shape.n_positions
        lens_top = self.lens_top if self.with_lens else 0
        kept = steps * (shape.n_layers * shape.n_heads * 4 + self.top_heads * (positions * 4 + 16)
                        + shape.n_layers * lens_top * 12)
        values = 1.5 * shape.n_layers * shape.n_kv_heads * positions * shape.d_head * 4
        split_batch = (SPLIT_STEPS * shape.n_layers * shape.n_heads * positions * 4 * 2
                       + self.top_heads * positions * (shape.d_head + 2) * 8)
        lens = 0 if not self.with_lens else (
            steps * shape.n_layers * shape.d_model * 4 + LENS_LOGITS_BYTES + LENS_SOFTMAX_ROWS * shape.vocab * 4 * 2
            + LENS_STEPS * shape.n_layers * (shape.d_model * 4 + lens_top * 16))
        return MemoryEstimate(kept=int(kept), working=int(values + split_batch + lens))

    def wants(self, site: AttentionSite) -> bool:
        return site.kind == "self"

    def rows_not_wanted(self, site: AttentionSite, n_queries: int) -> int:
        return n_queries - 1

    def keep(self, site: AttentionSite, call: AttentionCall) -> None:
        """The call's last row and the values of the keys it added (grouped, ``[kv_head, new key, d_head]``); the
        first layer's call begins a pass, so the passes before it are over and are split first."""
        added = call.first_query + call.query.shape[2]  # one key per query of the pass
        self.passes.heard(site.layer, added)
        # a copy: the last row alone (a view would hold the call's whole [head, q, k] block until the step is split)
        self.rows.setdefault(self.passes.current, {})[site.layer] = call.probs[0, :, -1].detach().float().clone()
        self.values.setdefault(site.layer, GrowingTensor(axis=1)).append(
            call.value[0, :, call.value.shape[2] - added :])
        self.sites[site.layer] = site

    @contextmanager
    def recording(self, loaded: LoadedModel) -> Iterator[None]:
        self.loaded = loaded
        self._start()

        def fed(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            ids = args[0] if args else kwargs["input"]  # [1, new]
            if self.passes.ends:  # a pass after the prompt's: a step's token
                self.fed.append(int(ids[0, 0]))

        with ExitStack() as stack:
            self.parts = stack.enter_context(residual_parts(loaded, None, blocks=self.with_lens))
            stack.enter_context(local_hooks([loaded.model.get_input_embeddings()], fed, pre=True))
            yield

    def split(self, index: int) -> None:
        """Pass ``index`` is over: its step is split with the next ones, ``SPLIT_STEPS`` at a time (each value and each
        layer's W_O read once for them all: read at every step, they took most of a step's attribution)."""
        self.pending.append(index)
        if len(self.pending) == SPLIT_STEPS:
            self.split_pending()

    def split_pending(self) -> None:
        """The pending steps' terms (step ``index``'s pass ended at position ``t`` and chose the token fed to the next
        pass), kept as arrays; then their rows and residual pieces are let go."""
        assert self.loaded is not None and self.parts is not None, "StepAttribution used outside recording()"
        if not self.pending:
            return
        indices, self.pending = self.pending, []
        rows = self.position_rows(indices)
        pieces = self.parts.pieces
        joined = {key: torch.cat([kept[index] for index in indices]) for key, kept in pieces.items()
                  if key[0] != "blocks"}  # [step, d_model] each
        parts = ResidualParts(None, embeddings=joined["embeddings", 0], final=joined["final", 0],
                              attention={layer: joined["attention", layer] for layer in rows.rows},
                              ffn={layer: joined["ffn", layer] for layer in rows.rows})
        directions = [logit_direction(self.loaded, self.fed[index]) for index in indices]
        with hooks_paused():  # the terms run the norms, whose hooks would keep their inputs as a pass's
            terms = decompose_positions(self.loaded, rows, parts, torch.stack([d for d, _ in directions]),
                                        [bias for _, bias in directions], range(len(indices)), self.weights,
                                        split=False)
        for k, step_terms in enumerate(terms):
            step_heads = step_terms.heads.float().cpu().numpy()  # [layer, head]
            top = np.stack(np.unravel_index(np.argsort(-np.abs(step_heads), axis=None, kind="stable")
                                            [: self.top_heads], step_heads.shape), axis=-1)  # [rank, 2]
            split = step_terms.sources_of(rows, top.tolist(), k).float().cpu().numpy()  # [rank, t + 1]
            self.steps.append((step_heads, step_terms.total(), top, split))
        for key, kept in pieces.items():
            if key[0] != "blocks":  # the lens reads every step's block outputs at the end
                for index in indices:
                    kept[index] = kept[index][:0].clone()
        for index in indices:
            del self.rows[index]

    def position_rows(self, indices: list[int]) -> PositionRows:
        """Passes ``indices``' last rows (at positions ``t``) as :class:`~attnscope.attribution.terms.PositionRows`
        (a row's keys are the last ``k`` positions up to its own: a sliding-window layer's hold fewer; the others are
        0), with the values of keys ``0..max(t)``, grouped (``[kv_head, source_pos, d_head]`` float32)."""
        ends = [self.passes.ends[index] for index in indices]
        rows = PositionRows(tuple(ends))
        for layer, first in self.rows[indices[0]].items():
            table = torch.zeros((len(indices), first.shape[0], max(ends) + 1), dtype=torch.float32, device=first.device)
            for k, (index, t) in enumerate(zip(indices, ends, strict=True)):
                row = self.rows[index][layer]
                table[k, :, t + 1 - row.shape[-1] : t + 1] = row
            rows.rows[layer], rows.values[layer] = table, self.values[layer].view(max(ends) + 1)
            rows.sites[layer] = self.sites[layer]
        return rows

    def finish(self, loaded: LoadedModel, sequence: list[int], n_prompt: int) -> RecordAdditions:
        """The steps' terms as arrays (a step whose pass was never followed by another is split here), and with the
        lens the logit lens of every step (outside the hooks: the lens runs the final norm)."""
        assert self.parts is not None, "StepAttribution.finish before a generation was recorded"
        n_steps, n_sources = len(sequence) - n_prompt, len(sequence) - 1
        self.fed += sequence[n_prompt + len(self.fed) : n_prompt + n_steps]  # the chosen tokens no pass was fed
        self.passes.finish(n_steps)
        self.split_pending()
        sources = np.zeros((n_steps, min(self.top_heads, self.steps[0][0].size), n_sources), dtype=np.float32)
        for index, (_, _, _, split) in enumerate(self.steps[:n_steps]):
            sources[index, :, : split.shape[-1]] = split
        arrays: dict[str, np.ndarray]  # declared: arrays of several dtypes would join to object
        arrays = {names.ATTRIBUTION_HEADS: np.stack([s[0] for s in self.steps[:n_steps]]).astype(np.float32),
                  names.ATTRIBUTION_LOGITS: np.array([s[1] for s in self.steps[:n_steps]], dtype=np.float32),
                  names.ATTRIBUTION_TOP: np.stack([s[2] for s in self.steps[:n_steps]]).astype(np.int64),
                  names.ATTRIBUTION_SOURCES: sources}
        lens_tokens: tuple[tuple[tuple[str, ...], ...], ...] = ()
        if self.with_lens:
            arrays[names.LENS_IDS], arrays[names.LENS_PROBS] = self.lens(loaded, n_steps)
            lens_tokens = tuple(tuple(readable_tokens(loaded.tokenizer, layer.tolist()) for layer in step)
                                for step in arrays[names.LENS_IDS])
        self._start()
        return RecordAdditions(arrays, lens_tokens)

    def lens(self, loaded: LoadedModel, n_steps: int) -> tuple[np.ndarray, np.ndarray]:
        """The logit lens of the first ``n_steps`` passes, ``LENS_STEPS`` at a time (every step's logits of one
        layer at once would be ``[step, vocab]``: 200 MB at 1,024 steps of SmolLM2)."""
        assert self.parts is not None
        ids, probs = [], []
        for start in range(0, n_steps, LENS_STEPS):
            stop = min(n_steps, start + LENS_STEPS)
            chunk = {layer: kept[start:stop] for layer, kept in self.parts.blocks.items()}
            chunk_ids, chunk_probs = lens_top(loaded, chunk, self.lens_top)
            ids.append(chunk_ids)
            probs.append(chunk_probs)
        return np.concatenate(ids), np.concatenate(probs)
