"""Each generated token's information-flow route, from the generation's own forward passes.

:class:`StepRoutes` is a :class:`~attnscope.capture.generate.GenerationRecorder`:
``attnscope.generate(model, prompt, recorders=[StepRoutes()])`` (``attnscope generate --routes``). Step s chose token
``n_prompt + s`` at position ``t = n_prompt - 1 + s``. Every pass (the prompt's, then one per token on the key/value
cache) hands the attention function its new queries and the keys and values it added; appended in order to one
buffer per layer (:class:`~attnscope.capture.generate.GrowingTensor`), with each block's input residual at the pass's
positions, they are what :mod:`attnscope.attribution.routes` keeps of one forward pass of the text up to ``t``, so no
pass is added. Keys a sliding-window cache later drops stay known, and the band of keys each query saw is read from
its own call's mask (shifted to absolute positions). Each step's route is walked top-down from ``t`` as soon as its
pass is over (when the next pass begins), so the walks run while the text is generated (the progress bar counts
them) and only the kept edges are stored; nothing is walked or re-run at the end. A row's edges depend on that row
alone, so each (layer, position) a walk reaches is computed once and its kept edges serve every later step's walk
(:class:`~attnscope.attribution.routes.KeptRows`; coded once as rows of the record's arrays, :class:`CodedRow`, so
a step's edges are joined arrays, not a few thousand Python objects): a step computes the rows of its own position
and of the few earlier ones no walk reached before, not its whole route again. Its own position's rows, which its
walk reaches at nearly every layer, are computed before the walk for every layer together, as one batch
(:meth:`~attnscope.attribution.routes.RouteTensors.importance_across`), and so are the peaks of the values the pass
added. Layers and heads are 0-indexed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from ..capture.generate import (
    GenerationPasses,
    GenerationRecorder,
    GenerationShape,
    GrowingTensor,
    LayerBuffers,
    RecordAdditions,
)
from ..capture.hooks import hooks_paused, local_hooks
from ..capture.plan import MemoryEstimate
from ..capture.recorders import CallInputs
from ..errors import AttnscopeError
from ..models.adapters import AttentionSite
from ..models.loading import LoadedModel
from ..records import attribution as names
from ..records.generation import GenerationRecord
from .route_parts import PEAK_KEYS, OutWeights
from .routes import (
    PARTS_BUDGET,
    TAU,
    Edge,
    KeptRow,
    KeptRows,
    LayerInputs,
    Node,
    Routes,
    RouteTensors,
    check_route_model,
    check_tau,
    joined_stack,
    key_band,
    walk_rows,
)
from .terms import _first, _output_norms, blocks_by_layer, unembedding

WALK_BLOCKS = 10  # blocks of PARTS_BUDGET elements a block of rows' walk holds at once (route_parts)
ACROSS_BLOCKS = 8  # [layer, head, key] blocks a step's rows at every layer hold at once (bounds, terms, shares)
CODED_ROW_BYTES = 800  # a CodedRow's fixed cost in Python: its tuple, three small arrays and a list
EDGES_PER_STEP = 2048  # a step's kept edges assumed by the memory estimate (SmolLM2 at tau 0.04: a few hundred)


class StepRoutes(GenerationRecorder):
    """Every step's route above ``tau`` (see the module docstring); adds ``route_edges``, ``route_importance`` and
    ``route_heads`` to the record (:class:`~attnscope.records.GenerationRecord`)."""

    wants_inputs = True

    def __init__(self, tau: float = TAU) -> None:
        self.tau = check_tau(tau)
        self.norms: dict[int, nn.Module] = {}
        self._start()

    def _start(self, n_layers: int = 0) -> None:
        """Nothing kept yet (a recorder may serve several generations, one after the other)."""
        self.queries: dict[int, GrowingTensor] = {}  # per layer: [head, pos, d_head]
        self.keys = LayerBuffers(n_layers, axis=1)  # [layer, kv_head, pos, d_head]: a step reads every layer's
        self.values = LayerBuffers(n_layers, axis=1)
        self.peaks = GrowingTensor(axis=2)  # [layer, head, pos]: route_parts.value_peaks of each value, found by
        # peaks_up_to for every layer together before a walk
        self.weights: dict[int, OutWeights] = {}  # per layer: W_O by head, made once
        self.stacked: dict[tuple[int, ...], torch.Tensor] = {}  # every layer's joined W_O, stacked once
        self.bands: dict[int, tuple[GrowingTensor, GrowingTensor]] = {}  # per layer: first and last key [pos]
        # per layer: its calls' scaling, softcap and learned sinks (the same at every call)
        self.calls: dict[int, tuple[float, float | None, torch.Tensor | None]] = {}
        self.sites: dict[int, AttentionSite] = {}
        self.residuals: dict[int, GrowingTensor] = {}  # block inputs [pos, d_model], then the last block's output
        self.passes = GenerationPasses(self.walk_step)
        self.known = KeptRows(self.tau)  # each (layer, position)'s kept edges, once a walk has reached it
        self.coded: dict[tuple[int, int], CodedRow] = {}  # each walked row's edges as record arrays, made once
        self.last_band: tuple[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] | None = None  # (call, band)
        self.steps: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # per walked step: codes, importance, heads

    option = "leave out the routes (recorders=[StepRoutes()], --routes)"
    label = "routes"

    def memory(self, shape: GenerationShape) -> MemoryEstimate:
        """Kept: each step's edges (``EDGES_PER_STEP`` assumed: their number depends on the text and ``tau``).
        Working: every position's queries, keys, values, the values' peaks, key bands and residual streams (in
        buffers up to half again as large), one layer's walk (``WALK_BLOCKS`` blocks of
        :data:`~attnscope.attribution.routes.PARTS_BUDGET` elements, and the peaks of a pass's new values, found
        :data:`~attnscope.attribution.route_parts.PEAK_KEYS` at a time), a step's own rows at every layer at once
        (``ACROSS_BLOCKS`` ``[layer, head, key]`` blocks), the old keys and values while their buffers grow (every
        layer's at once: :class:`~attnscope.capture.generate.LayerBuffers`), every
        layer's ``W_O`` once more (stacked), and the edges of every row a walk reached, twice: as the walk keeps them
        and as record arrays (:meth:`~attnscope.attribution.routes.KeptRows.bound`, :meth:`CodedRow.bound`: every row
        of every layer, at most)."""
        positions = shape.n_positions
        per_position = (shape.n_layers * ((shape.n_heads + 2 * shape.n_kv_heads) * shape.d_head * 4 + 16
                                          + shape.n_heads * 4)
                        + (shape.n_layers + 1) * shape.d_model * 4)
        walk = shape.n_heads * PEAK_KEYS * shape.d_model * 4 + WALK_BLOCKS * PARTS_BUDGET * 4
        across = shape.n_layers * positions * 4 * (2 * shape.n_kv_heads * shape.d_head + ACROSS_BLOCKS * shape.n_heads)
        walk += across + shape.n_layers * shape.n_heads * shape.d_head * shape.d_model * 4
        kept = shape.max_new_tokens * EDGES_PER_STEP * (8 * 8 + 4 + 4 * shape.n_heads)
        rows = (KeptRows.bound(shape.n_layers, positions, shape.n_heads, self.tau)
                + CodedRow.bound(shape.n_layers, positions, shape.n_heads, self.tau))
        return MemoryEstimate(kept=kept, working=int(1.5 * positions * per_position + walk) + rows)

    def wants(self, site: AttentionSite) -> bool:
        return site.kind == "self"

    def rows_not_wanted(self, site: AttentionSite, n_queries: int) -> int:
        return n_queries

    def keep_inputs(self, site: AttentionSite, inputs: CallInputs) -> None:
        """Append the call's new queries, keys, values and key bands; the first layer's call begins a pass, so the
        passes before it are over and their routes are walked first."""
        if inputs.position_bias is not None or (inputs.sinks is not None and inputs.sinks.dim() == 4):
            raise AttnscopeError(f"{site.name} adds a position bias or per-query sinks; routes do not support them")
        query, key, value = inputs.query[0], inputs.key[0], inputs.value[0]  # [head, q_pos, d_head], [kv_head, k, d]
        n_new, n_keys = query.shape[1], key.shape[1]
        self.passes.heard(site.layer, n_new)
        seen = self.queries[site.layer].length if site.layer in self.queries else 0
        first, last = self.band(inputs, n_new, n_keys)
        start = seen + n_new - n_keys  # absolute position of the call's key 0 (a window's cache holds the last ones)
        self.queries.setdefault(site.layer, GrowingTensor(axis=1)).append(query)
        self.keys.append(site.layer, key[:, n_keys - n_new :])
        self.values.append(site.layer, value[:, n_keys - n_new :])
        if site.layer not in self.weights:
            self.weights[site.layer] = OutWeights.of_site(site, query.shape[0], key.shape[0])
        firsts, lasts = self.bands.setdefault(site.layer, (GrowingTensor(dtype=torch.long),
                                                           GrowingTensor(dtype=torch.long)))
        firsts.append(first + start)
        lasts.append(last + start)
        self.calls[site.layer] = (inputs.scaling, inputs.softcap,
                                  None if inputs.sinks is None else inputs.sinks.detach().float())
        self.sites[site.layer] = site

    def band(self, inputs: CallInputs, n_new: int, n_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~attnscope.attribution.routes.key_band` of the call; a pass hands every layer of one kind the same
        mask tensor, so the last one's band is kept (with the mask, so that its identity cannot be reused) and
        served again."""
        known = (inputs.attention_mask, inputs.causal, n_new, n_keys)
        if self.last_band is not None and self.last_band[0][0] is known[0] and self.last_band[0][1:] == known[1:]:
            return self.last_band[1]
        band = key_band(inputs.attention_mask, inputs.causal, n_new, n_keys)
        self.last_band = (known, (band[0], band[1]))
        return self.last_band[1]

    @contextmanager
    def recording(self, loaded: LoadedModel) -> Iterator[None]:
        check_route_model(loaded)
        blocks = blocks_by_layer(loaded)
        self._start(len(blocks))
        self.norms = _output_norms(loaded, unembedding(loaded).attention_norm)

        def block_input(layer: int) -> Any:
            def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                hidden = args[0] if args else kwargs["hidden_states"]
                self.residuals.setdefault(layer, GrowingTensor()).append(hidden[0])
            return hook

        def last_output(module: nn.Module, inputs: Any, output: Any) -> None:
            self.residuals.setdefault(len(blocks), GrowingTensor()).append(_first(output)[0])

        with ExitStack() as stack:
            for layer, block in enumerate(blocks):
                stack.enter_context(local_hooks([block], block_input(layer), pre=True))
            stack.enter_context(local_hooks([blocks[-1]], last_output))
            yield

    def peaks_up_to(self, n: int) -> torch.Tensor:
        """The values' peaks ``[layer, head, pos]`` of positions ``0..n-1`` (:func:`~.route_parts.value_peaks`), those
        not found yet found now for every layer together, ``PEAK_KEYS`` parts of a head at a time: one batch a step
        where a call each cost a millisecond a step of SmolLM2's 30 layers."""
        n_layers = self.values.n_layers  # a decoder's every block attends to itself: layers 0..n_layers-1
        joined, group = joined_stack(self.weights, self.stacked, list(range(n_layers))), self.weights[0].group
        step, every = max(1, PEAK_KEYS // n_layers), self.values.stacked(n)
        for start in range(self.peaks.length, n, step):
            values = every[:, :, start : min(n, start + step)]  # [layer, kv_head, pos, d_head]
            outputs = torch.matmul(values, joined)  # [layer, kv_head, pos, group x d_model]
            peaks = outputs.view(*outputs.shape[:3], group, -1).abs_().amax(-1)  # [layer, kv_head, pos, group]
            self.peaks.append(peaks.permute(0, 1, 3, 2).reshape(n_layers, -1, values.shape[2]))
        return self.peaks.view(n)

    def tensors(self, t: int) -> RouteTensors:
        """What the passes up to position ``t`` kept, as one forward pass of the text ``0..t`` (views, no copy)."""
        n = t + 1
        peaks = self.peaks_up_to(n)
        inputs = {}
        for layer, (scaling, softcap, sinks) in self.calls.items():
            firsts, lasts = self.bands[layer]
            inputs[layer] = LayerInputs(self.queries[layer].view(n), self.keys.view(layer, n),
                                        self.values.view(layer, n), scaling, firsts.view(n), lasts.view(n), softcap,
                                        sinks, peaks[layer])
        residuals = [self.residuals[layer].view(n) for layer in range(len(self.residuals))]
        stacks = {"key": self.keys.stacked(n), "value": self.values.stacked(n)}
        return RouteTensors(inputs, residuals, self.sites, self.norms, position=-1, weights=self.weights,
                            stacked=self.stacked, layer_stacks=stacks)

    def walk_step(self, index: int) -> None:
        """Step ``index``'s route (its pass ended at position ``t``), kept as arrays of its edges; the rows earlier
        steps' walks reached are not computed again (:class:`~attnscope.attribution.routes.KeptRows`)."""
        t = self.passes.ends[index]
        tensors = self.tensors(t)
        n_heads = self.queries[0].view().shape[0]
        reached: list[CodedRow] = []

        def visit(layer: int, i: int, row: KeptRow) -> list[int]:
            if (layer, i) not in self.coded:
                self.coded[layer, i] = CodedRow.of(row, layer, i, self.tau, n_heads)
            reached.append(self.coded[layer, i])
            return self.coded[layer, i].below

        with hooks_paused():  # the walk runs the post-attention norms: no hook may keep their inputs
            self.known.compute_across(tensors, t)  # the step's own row at every layer, in one batch
            walk_rows(tensors, t, self.tau, self.known, visit)
        rows = reached or [CodedRow.none(n_heads)]
        codes = np.concatenate([row.codes for row in rows]).astype(np.int64)
        self.steps.append((np.concatenate([np.full((len(codes), 1), index, dtype=np.int64), codes], axis=1),
                           np.concatenate([row.importance for row in rows]),
                           np.concatenate([row.heads for row in rows])))

    def finish(self, loaded: LoadedModel, sequence: list[int], n_prompt: int) -> RecordAdditions:
        """The steps' edges as arrays (a step whose pass was never followed by another is walked here)."""
        n_steps = len(sequence) - n_prompt
        self.passes.finish(n_steps)
        kept = self.steps[:n_steps]
        arrays: dict[str, np.ndarray]  # declared: arrays of several dtypes would join to object
        arrays = {names.ROUTE_EDGES: np.concatenate([step[0] for step in kept]),
                  names.ROUTE_IMPORTANCE: np.concatenate([step[1] for step in kept]),
                  names.ROUTE_HEADS: np.concatenate([step[2] for step in kept])}
        self._start()
        return RecordAdditions(arrays)


class CodedRow(NamedTuple):
    """One walked row's kept edges (:meth:`~attnscope.attribution.routes.KeptRow.walked`, in its order) as rows of the
    record's arrays, made once and shared by every step whose walk reaches the row: ``codes`` int32 ``[edge, 7]``
    (source layer, position, kind; target layer, position, kind; via: ``route_edges`` without its step),
    ``importance`` float32 ``[edge]``, ``heads`` float32 ``[edge, head]`` (0 for an edge not through the heads),
    the record's dtypes but for the codes (int64 there), and ``below``: the positions the edges reach in the stream
    entering the row's layer."""

    codes: np.ndarray
    importance: np.ndarray
    heads: np.ndarray
    below: list[int]

    @classmethod
    def of(cls, row: KeptRow, layer: int, i: int, tau: float, n_heads: int) -> CodedRow:
        """Row ``(layer, i)``'s edges as :meth:`KeptRow.walked` gives them, coded (once per row, not per step)."""
        edges, below = row.walked(layer, i, tau)
        if not edges:
            return cls.none(n_heads)
        codes = [[*_coded(edge.source), *_coded(edge.target), names.ROUTE_VIAS.index(edge.via)] for edge in edges]
        return cls(np.array(codes, dtype=np.int32), np.array([edge.importance for edge in edges], dtype=np.float32),
                   np.array([edge.heads or (0.0,) * n_heads for edge in edges], dtype=np.float32), below)

    @classmethod
    def none(cls, n_heads: int) -> CodedRow:
        """A row with no kept edge."""
        return cls(np.empty((0, 7), dtype=np.int32), np.empty(0, dtype=np.float32),
                   np.empty((0, n_heads), dtype=np.float32), [])

    @staticmethod
    def bound(n_layers: int, n_positions: int, n_heads: int, tau: float) -> int:
        """Bytes of every row of a text of ``n_positions`` coded: fewer than ``1 / tau`` attention edges a row (at
        most one per position) and 4 others, each 4 bytes per code, importance and head and 8 per position below, and
        ``CODED_ROW_BYTES``."""
        per_row = min(n_positions, int(1 / tau) if tau > 0 else n_positions) + 4
        return n_layers * n_positions * (CODED_ROW_BYTES + per_row * (4 * (7 + 1 + n_heads) + 8))


def _coded(node: Node) -> list[int]:
    return [node.layer, node.position, names.ROUTE_NODE_KINDS.index(node.kind)]


def step_routes(record: GenerationRecord, step: int, tau: float = TAU) -> Routes:
    """The route of ``step`` (0-indexed) of a generation made with :class:`StepRoutes` (``--routes``); ``tau``: the
    threshold it was made with (the record keeps the edges, not the threshold)."""
    if names.ROUTE_EDGES not in record.arrays:
        raise AttnscopeError("this record has no routes: generate with recorders=[StepRoutes()] (--routes)")
    if not 0 <= step < record.n_steps:
        raise AttnscopeError(f"step {step} is outside the generation's {record.n_steps} steps (0-indexed)")
    codes = record.arrays[names.ROUTE_EDGES]
    kept = np.flatnonzero(codes[:, 0] == step)
    kinds = names.ROUTE_NODE_KINDS
    edges = []
    for index in kept:
        _, sl, sp, sk, tl, tp, tk, via = (int(v) for v in codes[index])
        split = tuple(float(v) for v in record.arrays[names.ROUTE_HEADS][index])
        edges.append(Edge(Node(sl, sp, kinds[sk]), Node(tl, tp, kinds[tk]),
                          float(record.arrays[names.ROUTE_IMPORTANCE][index]), names.ROUTE_VIAS[via],
                          split if names.ROUTE_VIAS[via] == "attention" else ()))
    position = record.prompt_length - 1 + step
    return Routes(record.model.name, tuple(record.tokens), position, record.tokens[position + 1], tau,
                  record.n_layers, record.n_heads, tuple(edges))

