"""Each generated token's information-flow route, from the generation's own forward passes.

:class:`StepRoutes` is a :class:`~attnscope.capture.generate.GenerationRecorder`:
``attnscope.generate(model, prompt, recorders=[StepRoutes()])`` (``attnscope generate --routes``). Step s chose token
``n_prompt + s`` at position ``t = n_prompt - 1 + s``. Every pass (the prompt's, then one per token on the key/value
cache) hands the attention function its new queries and the keys and values it added; kept in order, with each
block's input residual at the pass's positions, they are what :mod:`attnscope.attribution.routes` keeps of one
forward pass of the final text, so no pass is added. Keys a sliding-window cache later drops stay known, and the
band of keys each query saw is read from its own call's mask (shifted to absolute positions). Once the text is final,
each step's route is walked top-down from ``t`` and only its kept edges are stored. Layers and heads are 0-indexed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from ..capture.generate import GenerationRecorder, RecordAdditions
from ..capture.hooks import local_hooks
from ..capture.recorders import CallInputs
from ..errors import AttnscopeError
from ..models.adapters import AttentionSite
from ..models.loading import LoadedModel
from ..records import attribution as names
from ..records.generation import GenerationRecord
from .routes import TAU, Edge, LayerInputs, Node, Routes, RouteTensors, check_route_model, check_tau, key_band, walk
from .terms import _first, _output_norms, blocks_by_layer, unembedding


class StepRoutes(GenerationRecorder):
    """Every step's route above ``tau`` (see the module docstring); adds ``route_edges``, ``route_importance`` and
    ``route_heads`` to the record (:class:`~attnscope.records.GenerationRecord`)."""

    wants_inputs = True

    def __init__(self, tau: float = TAU) -> None:
        self.tau = check_tau(tau)
        self.calls: dict[int, list[tuple[CallInputs, int]]] = {}  # per layer: each pass's inputs, keys seen before
        self.sites: dict[int, AttentionSite] = {}
        self.residuals: dict[int, list[torch.Tensor]] = {}

    def wants(self, site: AttentionSite) -> bool:
        return site.kind == "self"

    def rows_not_wanted(self, site: AttentionSite, n_queries: int) -> int:
        return n_queries

    def keep_inputs(self, site: AttentionSite, inputs: CallInputs) -> None:
        if inputs.position_bias is not None or (inputs.sinks is not None and inputs.sinks.dim() == 4):
            raise AttnscopeError(f"{site.name} adds a position bias or per-query sinks; routes do not support them")
        calls = self.calls.setdefault(site.layer, [])
        seen = sum(call.query.shape[1] for call, _ in calls)  # one key per query ([head, q_pos, d_head]) of each pass
        calls.append((CallInputs(inputs.query[0].detach().float(), inputs.key[0].detach().float(),
                                 inputs.value[0].detach().float(), inputs.attention_mask, inputs.scaling, inputs.causal,
                                 inputs.softcap, None if inputs.sinks is None else inputs.sinks.detach().float()), seen))
        self.sites[site.layer] = site

    @contextmanager
    def recording(self, loaded: LoadedModel) -> Iterator[None]:
        check_route_model(loaded)
        self.calls, self.sites, self.residuals = {}, {}, {}
        blocks = blocks_by_layer(loaded)

        def block_input(layer: int) -> Any:
            def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
                hidden = args[0] if args else kwargs["hidden_states"]
                self.residuals.setdefault(layer, []).append(hidden[0].detach().float())
            return hook

        def last_output(module: nn.Module, inputs: Any, output: Any) -> None:
            self.residuals.setdefault(len(blocks), []).append(_first(output)[0].detach().float())

        with ExitStack() as stack:
            for layer, block in enumerate(blocks):
                stack.enter_context(local_hooks([block], block_input(layer), pre=True))
            stack.enter_context(local_hooks([blocks[-1]], last_output))
            yield

    def tensors(self, loaded: LoadedModel) -> RouteTensors:
        """What the passes kept, joined as one forward pass of the whole text (:class:`RouteTensors`)."""
        inputs = {layer: _joined(calls) for layer, calls in self.calls.items()}
        residuals = [torch.cat(self.residuals[layer]) for layer in range(len(self.residuals))]
        norms = _output_norms(loaded, unembedding(loaded).attention_norm)
        return RouteTensors(inputs, residuals, self.sites, norms, position=-1)

    def finish(self, loaded: LoadedModel, sequence: list[int], n_prompt: int) -> RecordAdditions:
        """Walk each step's route (outside the hooks: the walk runs the post-attention norms)."""
        tensors = self.tensors(loaded)
        rows, importance, heads = [], [], []
        n_heads = tensors.inputs[0].query.shape[0]
        for step, position in enumerate(range(n_prompt - 1, len(sequence) - 1)):
            for edge in walk(tensors, position, self.tau):
                rows.append([step, *_coded(edge.source), *_coded(edge.target), names.ROUTE_VIAS.index(edge.via)])
                importance.append(edge.importance)
                heads.append(edge.heads or (0.0,) * n_heads)
        arrays: dict[str, np.ndarray]  # declared: arrays of several dtypes would join to object
        arrays = {names.ROUTE_EDGES: np.array(rows, dtype=np.int64).reshape(-1, 8),
                  names.ROUTE_IMPORTANCE: np.array(importance, dtype=np.float32),
                  names.ROUTE_HEADS: np.array(heads, dtype=np.float32).reshape(-1, n_heads)}
        return RecordAdditions(arrays)


def _joined(calls: list[tuple[CallInputs, int]]) -> LayerInputs:
    """One layer's passes as the inputs of one pass over the whole text: the queries of every pass, the keys and
    values each pass added, and each query's band of keys in absolute positions."""
    queries, keys, values, firsts, lasts = [], [], [], [], []
    for call, seen in calls:
        n_new, n_keys = call.query.shape[1], call.key.shape[1]
        first, last = key_band(call.attention_mask, call.causal, n_new, n_keys)
        start = seen + n_new - n_keys  # absolute position of the call's key 0 (a window's cache holds the last ones)
        queries.append(call.query)
        keys.append(call.key[:, n_keys - n_new :])
        values.append(call.value[:, n_keys - n_new :])
        firsts.append(first + start)
        lasts.append(last + start)
    last_call = calls[-1][0]
    return LayerInputs(torch.cat(queries, dim=1), torch.cat(keys, dim=1), torch.cat(values, dim=1), last_call.scaling,
                       torch.cat(firsts), torch.cat(lasts), last_call.softcap, last_call.sinks)


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

