"""Each generated token's direct logit attribution and logit lens, from the generation's own forward passes.

:class:`StepAttribution` is a :class:`~attnscope.capture.generate.GenerationRecorder`:
``attnscope.generate(model, prompt, recorders=[StepAttribution()])`` (``attnscope generate --attribute``).
Step s chose token ``n_prompt + s`` at position ``t = n_prompt - 1 + s``, the last position of the generation's
s-th forward pass (the prompt's pass, then one per step on the key/value cache). So each pass gives what
:func:`~attnscope.attribution.terms.decompose` needs at ``t``, and no pass is added: of every self-attention call,
its last query row and the values of the keys it added (each key's value once, so they grow with the text, and
a sliding-window layer's evicted keys stay known), and, by hooks, the residual-stream pieces at the pass's last
position. Once the text is final, each chosen token's logit is split into its terms. Interventions active
around the generation apply, as they did to the tokens chosen. Layers and heads are 0-indexed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from ..capture.generate import GenerationRecorder, RecordAdditions
from ..capture.recorders import AttentionCall, expand_kv_heads
from ..capture.tokens import readable_tokens
from ..models.adapters import AttentionSite
from ..models.loading import LoadedModel
from ..records import attribution as names
from .terms import PositionRows, ResidualParts, decompose, lens_top, logit_direction, residual_parts

ATTRIBUTION_TOP_HEADS = 10  # heads per step whose terms are kept split over the source tokens
LENS_TOP = 3  # tokens per layer and step of the logit lens kept


class StepAttribution(GenerationRecorder):
    """Direct logit attribution and the logit lens of every step's chosen token (see the module docstring).

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
    * ``lens_ids`` int64 / ``lens_probs`` float32 ``[step, layer, k]``: the logit lens at the step's position
      (the top ``lens_top`` tokens of each layer's residual stream through the final norm and the LM head; the
      last layer's is the model's own next-token distribution), with their text in ``lens_tokens``.
    """

    def __init__(self, top_heads: int = ATTRIBUTION_TOP_HEADS, lens_top: int = LENS_TOP) -> None:
        self.top_heads, self.lens_top = top_heads, lens_top
        self.rows: dict[int, list[torch.Tensor]] = {}  # per layer: each pass's last row [head, k_pos]
        self.values: dict[int, list[torch.Tensor]] = {}  # per layer: the values of the keys each pass added
        self.sites: dict[int, AttentionSite] = {}
        self.parts: ResidualParts | None = None

    def wants(self, site: AttentionSite) -> bool:
        return site.kind == "self"

    def rows_not_wanted(self, site: AttentionSite, n_queries: int) -> int:
        return n_queries - 1

    def keep(self, site: AttentionSite, call: AttentionCall) -> None:
        """The call's last row and the values of the keys it added (grouped, ``[kv_head, new key, d_head]``)."""
        added = call.first_query + call.query.shape[2]  # one key per query of the pass
        self.rows.setdefault(site.layer, []).append(call.probs[0, :, -1].detach().float())
        self.values.setdefault(site.layer, []).append(call.value[0, :, call.value.shape[2] - added :].detach().float())
        self.sites[site.layer] = site

    @contextmanager
    def recording(self, loaded: LoadedModel) -> Iterator[None]:
        self.rows, self.values, self.sites = {}, {}, {}
        with residual_parts(loaded, None, blocks=True) as parts:
            self.parts = parts
            yield

    def position_rows(self, positions: tuple[int, ...], n_sources: int) -> PositionRows:
        """What was kept as :class:`~attnscope.attribution.terms.PositionRows` of ``positions`` (a row's keys are
        the last ``k`` positions up to its own: a sliding-window layer's hold fewer; the others are 0)."""
        rows = PositionRows(positions)
        for layer, pieces in self.rows.items():
            n_heads = pieces[0].shape[0]
            table = torch.zeros((len(positions), n_heads, n_sources), dtype=torch.float32, device=pieces[0].device)
            for index, (t, row) in enumerate(zip(positions, pieces)):
                table[index, :, t + 1 - row.shape[-1] : t + 1] = row
            values = torch.cat(self.values[layer], dim=1)[None, :, :n_sources]  # [1, kv_head, source_pos, d_head]
            rows.rows[layer], rows.values[layer] = table, expand_kv_heads(values, n_heads)[0]
            rows.sites[layer] = self.sites[layer]
        return rows

    def finish(self, loaded: LoadedModel, sequence: list[int], n_prompt: int) -> RecordAdditions:
        """Split each step's chosen logit into its terms (outside the hooks: the decomposition runs the norms)."""
        assert self.parts is not None, "StepAttribution.finish before a generation was recorded"
        positions = tuple(range(n_prompt - 1, len(sequence) - 1))  # the passes' last positions, the extra one dropped
        n_sources = len(sequence) - 1
        rows = self.position_rows(positions, n_sources)
        heads, logits, tops, sources = [], [], [], []
        cache: dict[int, torch.Tensor] = {}  # each layer's per-head W_O, viewed once
        for index, position in enumerate(positions):
            terms = decompose(loaded, rows, self.parts, *logit_direction(loaded, sequence[position + 1]), index, cache)
            step_heads = terms.heads.float().cpu().numpy()  # [layer, head]
            top = np.stack(np.unravel_index(np.argsort(-np.abs(step_heads), axis=None, kind="stable")
                                            [: self.top_heads], step_heads.shape), axis=-1)  # [rank, 2]
            split = np.zeros((len(top), n_sources), dtype=np.float32)
            layers, heads_of = torch.as_tensor(top[:, 0]), torch.as_tensor(top[:, 1])
            split[:, : position + 1] = terms.head_sources[layers, heads_of].float().cpu().numpy()
            heads.append(step_heads)
            logits.append(terms.total())
            tops.append(top)
            sources.append(split)
        blocks = {layer: kept[: len(positions)] for layer, kept in self.parts.blocks.items()}
        lens_ids, lens_probs = lens_top(loaded, blocks, self.lens_top)
        arrays: dict[str, np.ndarray]  # declared: arrays of several dtypes would join to object
        arrays = {names.ATTRIBUTION_HEADS: np.stack(heads).astype(np.float32),
                  names.ATTRIBUTION_LOGITS: np.array(logits, dtype=np.float32),
                  names.ATTRIBUTION_TOP: np.stack(tops).astype(np.int64),
                  names.ATTRIBUTION_SOURCES: np.stack(sources), names.LENS_IDS: lens_ids, names.LENS_PROBS: lens_probs}
        lens_tokens = tuple(tuple(readable_tokens(loaded.tokenizer, layer.tolist()) for layer in step)
                            for step in lens_ids)
        return RecordAdditions(arrays, lens_tokens)
