"""Information-flow routes (Ferrando & Voita 2024): which earlier tokens, through which heads and layers, reached
one prediction — a graph built top-down from the chosen position, pruned at each step.

The residual stream of a pre-norm decoder at layer ``l`` and position ``i`` is updated twice. The attention block
gives ``y_i = x_i + Σ_j Σ_h z_ijh (+ the output projection's bias)`` with ``z_ijh = α^h_ij v^h_j W_O^h`` (through
the post-attention norm where the model has one); the feed-forward block gives ``x'_i = y_i + ffn(y_i)``. Each part
``z`` of a sum ``y`` gets the paper's proximity ``max(0, ||y||_1 − ||y − z||_1)``, normalised over the parts of
``y``: the attention block's parts are every (source token j, head h) pair and the residual ``x_i``; the
feed-forward block's are its output and the residual ``y_i``; a row whose parts all have proximity 0 has no
importances (0/0), read as 0 (:func:`shares`). An attention edge j -> i carries the sum of its
heads' importances, split per head as the authors' tool does (``llm-transparency-tool``, ``routes/
contributions.py``: parts per token and head, summed over heads for the edge); an edge is kept when its importance
exceeds ``tau`` (default :data:`TAU`, 0.04). The walk starts at the last residual stream of the chosen position and
goes down one layer at a time, following only kept edges (an attention node is expanded only when an edge kept
above it leaves it), so every edge returned lies on a path of kept edges to the prediction, and only the rows a route
reaches are computed.

What one forward pass keeps (hooks; the attention itself runs fused, with SDPA's lazy mask): each block's input
residual ``[pos, d_model]`` and the arguments it was called with, and the last block's output. The walk then needs
each layer's queries, keys and values as the attention function saw them (after rotary embeddings and any query/key
norms; keys and values grouped, query head h reading kv head ``h // group``), with the keys each query may see as a
band (first..last key: causal, or a sliding window's; keys outside get weight 0, so their parts are 0): for one layer
at a time, :class:`RerunInputs` runs that layer's block again on its recorded input, stopped as its attention call
begins (:class:`RouteInputs`, a :class:`~attnscope.capture.recorders.Recorder` that hears each call's inputs), so
no more than one layer's queries, keys and values exist at once (every layer's would be gigabytes at 32,768 tokens).
The walk recomputes the probability rows of the positions it reaches, ``chunk`` rows at a time, and finds every
part's proximity without forming most parts (:mod:`~attnscope.attribution.route_parts`: a linear term, a correction
on the few coordinates a part can overshoot, and in full only the parts of strongly attended keys), in blocks of at
most :data:`PARTS_BUDGET` elements, and it checks the recomputed output
projection's output against the model's at the chosen position (a model that does something else there, e.g. gates
its heads, is refused rather than approximated).

Frozen from the run: the post-attention norm of Gemma 2/3 and OLMo 2 (``sandwich`` norms) is linear in its input
once its scale (``1 / rms``) is fixed at the run's, so each part goes through it as ``gain_i ⊙ z`` (centred first for
a LayerNorm) and its bias, like the output projection's, stays in ``y`` without being a part. The feed-forward
block's output is read as ``x_{l+1} − y`` (its own post-norm included). Learned sinks (gpt-oss) take a share of
each softmax with no value behind it: that share adds nothing to ``y`` (a zero part, importance 0), so the rows are
recomputed with the sink in the denominator and the sink needs no node. Not supported, each refused in one line:
encoders and encoder-decoders (no prediction to route), blocks whose attention and feed-forward read the same
input (GPT-J, NeoX, Falcon, Cohere's parallel blocks: the feed-forward does not read ``y``), position biases
(ALiBi, T5) and batches (one text at a time).

>>> graph = routes("smollm2", "The capital of France is", tau=0.04)     # doctest: +SKIP
>>> graph.to_frame().head()                                              # doctest: +SKIP

Layers, heads and positions are 0-indexed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from ..capture.attention import allowed_keys, capture, grouped_matmul, softmax_with_sinks
from ..capture.extract import as_loaded, n_config_heads
from ..capture.hooks import local_hooks
from ..capture.recorders import CallInputs, CaptureComplete, Recorder
from ..capture.tokens import readable_tokens
from ..errors import AttnscopeError
from ..models.adapters import AttentionSite
from ..models.loading import LoadedModel
from .dla import _ids_of, _resolve_position, last_logits_only
from .route_parts import OutWeights, frozen_gains, layers_part_proximities, proximity, value_peaks
from .terms import FrozenNorm, _first, _output_norms, blocks_by_layer, freeze_norm, unembedding

TAU = 0.04  # the paper's threshold for its Llama 2 graphs
PARTS_BUDGET = 1 << 22  # elements of one block of a walk's work ([head, row, key], [head, key, row, K], ...)
MASK_ROWS = 1024  # mask rows read at once when a mask becomes a band of keys
CHECK_TOLERANCE = 1e-3  # recomputed vs the model's attention output, as a share of its largest value
ROW_BYTES = 600  # a KeptRow's fixed cost in Python: its tuple, three floats, three small arrays
PARALLEL_BLOCKS = ("gptj", "gpt_neox", "falcon", "cohere", "cohere2", "phi", "codegen", "gpt_neox_japanese")
NODE_KINDS = ("residual", "attention", "ffn")


# ---- what one forward pass keeps -----------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class LayerInputs:
    """One layer's attention inputs (batch row 0, float32): ``query`` ``[head, pos, d_head]``, ``key``/``value``
    ``[kv_head, pos, d_head]``; ``first``/``last`` ``[pos]`` (int64): the keys query i may see are
    ``first[i]..last[i]``; ``sinks``: learned sink logits (``[head]`` or ``[1, head, pos, 1]``), or None."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    scaling: float
    first: torch.Tensor
    last: torch.Tensor
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    peaks: torch.Tensor | None = None  # [head, pos]: max_d |v_j W_O^h| (route_parts.value_peaks), found when None


def key_band(mask: torch.Tensor | None, causal: bool | None, n_queries: int, n_keys: int) -> tuple[torch.Tensor, ...]:
    """The keys each query sees, ``first`` and ``last`` ``[q_pos]``, from a call's mask (None: causal, or every
    key); a mask that is not one band of keys per row (padding inside, a sparse selection) is refused."""
    if mask is None:
        if causal is False:
            return torch.zeros(n_queries, dtype=torch.long), torch.full((n_queries,), n_keys - 1, dtype=torch.long)
        return torch.zeros(n_queries, dtype=torch.long), torch.arange(n_keys - n_queries, n_keys)
    firsts, lasts = [], []
    for start in range(0, n_queries, MASK_ROWS):
        seen = allowed_keys(mask[..., start : start + MASK_ROWS, :], min(MASK_ROWS, n_queries - start), n_keys)
        seen = one_heads_keys(seen[0]).to("cpu")  # [rows, k_pos]
        count = seen.sum(-1)
        first = seen.to(torch.uint8).argmax(-1)
        last = n_keys - 1 - seen.flip(-1).to(torch.uint8).argmax(-1)
        if bool((count == 0).any()) or bool((last - first + 1 != count).any()):
            raise AttnscopeError("routes need each query to see one unbroken band of keys (causal or a sliding "
                                 "window); this call's mask leaves gaps (padding, a sparse selection, a sink + window)")
        firsts.append(first)
        lasts.append(last)
    return torch.cat(firsts), torch.cat(lasts)


def one_heads_keys(seen: torch.Tensor) -> torch.Tensor:
    """The keys ``[rows, k_pos]`` that every head of a call sees, from ``seen`` ``[head or 1, rows, k_pos]``; a call
    whose heads see different keys (an intervention's key mask on some heads, e.g. ``SinkWindow``) is refused: the
    walk gives one band of keys per row to every head."""
    if seen.shape[0] > 1 and not bool((seen == seen[:1]).all()):
        raise AttnscopeError("routes need every head of a layer to see the same keys; an intervention restricts some "
                             "heads' keys (a sink + window on some heads): restrict every head of the layer, or none")
    return seen[0]


class _Discard:
    """A chunk collector that keeps nothing: a sliding-window layer's call then runs in query chunks that score its
    window only, where the fused kernel would score every key under the mask (at 32,768 tokens of Gemma 3, most of
    the forward pass)."""

    chunk = 1024
    wants_logits = False

    def add(self, start: int, probs: torch.Tensor, logits: torch.Tensor | None = None, *,
            sink_mass: torch.Tensor | None = None, first_key: int = 0) -> None:
        """Nothing to keep."""

    def finish(self, *, n_heads: int, n_kv_heads: int, d_head: int, scaling: float) -> None:
        return None


class RouteInputs(Recorder):
    """Keeps the self-attention calls' :class:`LayerInputs` in ``layers`` (of ``wanted`` layers only, or of every one
    with None) and keeps no row: every call runs fused with SDPA's lazy mask, but a sliding-window layer's, which runs
    in query chunks over its window; with ``stop``, ends the forward pass once every
    wanted layer is in (:class:`~attnscope.capture.recorders.CaptureComplete`, before that call is computed)."""

    wants_inputs = True
    lazy_mask = True  # no [q_pos, k_pos] mask where causality alone masks

    def __init__(self, wanted: Collection[int] | None = None, *, stop: bool = False) -> None:
        self.wanted, self.stop = None if wanted is None else frozenset(wanted), stop
        self.layers: dict[int, LayerInputs] = {}

    def wants(self, site: AttentionSite) -> bool:  # every sliding layer too: its chunks (below) need a recorder
        return site.kind == "self" and (self.wanted is None or site.layer in self.wanted or site.window > 0)

    def rows_not_wanted(self, site: AttentionSite, n_queries: int) -> int:
        return 0 if site.window else n_queries  # a sliding layer runs in query chunks over its window (below)

    def row_collector(self, site: AttentionSite, values: torch.Tensor, *, n_heads: int,
                      n_keys: int) -> _Discard | None:
        return _Discard() if site.window else None

    def keep_rows(self, site: AttentionSite, collected: Any) -> None:
        """Nothing: the chunks only computed the call's output."""

    def keep_inputs(self, site: AttentionSite, inputs: CallInputs) -> None:
        if inputs.position_bias is not None:
            raise AttnscopeError(f"{site.name} adds a position bias to its scores; routes do not support it yet")
        if inputs.query.shape[0] != 1:
            raise AttnscopeError("routes take one text at a time")
        if self.wanted is not None and site.layer not in self.wanted:
            return
        first, last = key_band(inputs.attention_mask, inputs.causal, inputs.query.shape[2], inputs.key.shape[2])
        sinks = None if inputs.sinks is None else inputs.sinks.detach().float()
        self.layers[site.layer] = LayerInputs(inputs.query[0].detach().float(), inputs.key[0].detach().float(),
                                              inputs.value[0].detach().float(), inputs.scaling, first, last,
                                              inputs.softcap, sinks)
        if self.stop and self.wanted is not None and self.wanted <= self.layers.keys():
            raise CaptureComplete


class RerunInputs(Mapping[int, LayerInputs]):
    """Each layer's :class:`LayerInputs`, got when asked by running that layer's block again on the input it had in
    the forward pass (``calls[layer]``: its arguments), stopped as its attention call begins: the walk holds one
    layer's queries, keys and values at a time, never every layer's (at 32,768 tokens of Gemma 3, gigabytes)."""

    def __init__(self, loaded: LoadedModel, calls: dict[int, tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
        self.loaded, self.calls, self.blocks = loaded, calls, blocks_by_layer(loaded)
        self.last: tuple[int, LayerInputs] | None = None

    def __getitem__(self, layer: int) -> LayerInputs:
        if self.last is not None and self.last[0] == layer:
            return self.last[1]
        if layer not in self.calls:
            raise KeyError(layer)
        recorder = RouteInputs((layer,), stop=True)
        args, kwargs = self.calls[layer]
        with torch.inference_mode(), capture(self.loaded.sites, recorder=recorder):
            try:
                self.blocks[layer](*args, **kwargs)
            except CaptureComplete:
                pass
        if layer not in recorder.layers:
            raise AttnscopeError(f"layer {layer} of {self.loaded.name!r} ran without calling attnscope's attention "
                                 "function; routes need one attention and one feed-forward block per layer")
        self.last = (layer, recorder.layers[layer])
        return self.last[1]

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.calls))

    def __len__(self) -> int:
        return len(self.calls)


# ---- contributions of one layer ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerImportance:
    """The importances at one layer's rows ``positions`` (float32; each row of the attention block sums to 1 over
    ``heads`` and ``residual``, the feed-forward block's over ``ffn`` and ``ffn_residual``).

    ``heads`` ``[row, source_pos, head]``: the part of source token j through head h (0 past the row's band of
    keys); ``residual`` ``[row]``: the block's input ``x_i``; ``ffn`` and ``ffn_residual`` ``[row]``: the
    feed-forward output and the residual after attention ``y_i``."""

    positions: tuple[int, ...]
    heads: torch.Tensor
    residual: torch.Tensor
    ffn: torch.Tensor
    ffn_residual: torch.Tensor


def shares(proximities: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """The importances of parts: their ``proximities`` over their sum's ``total`` (broadcast), 0 where the total is 0.

    A total of 0 (every part as far from the sum as the sum is from 0, ``||y − z||_1 >= ||y||_1``: e.g. a feed-forward
    output that cancels most of a large residual) leaves the row's importances undefined (0/0). They are read as 0,
    so no edge of that row is kept and a route that reaches it ends there; the authors' tool instead floors each
    proximity at 1e-5, which splits such a row evenly (docs/routes.md)."""
    return proximities / total.where(total > 0, 1.0)


@dataclass(frozen=True, eq=False)
class RouteTensors:
    """What one forward pass kept for the walk: ``inputs[layer]`` (:class:`LayerInputs`), ``residuals`` ``[layer +
    1]`` of ``[pos, d_model]`` float32 (block inputs, then the last block's output), the attention ``sites`` and any
    post-attention ``norms`` by layer; ``checked``: the output projection's output at ``position`` per layer."""

    inputs: Mapping[int, LayerInputs]
    residuals: list[torch.Tensor]
    sites: dict[int, AttentionSite]
    norms: dict[int, nn.Module]
    position: int
    checked: dict[int, torch.Tensor] = field(default_factory=dict)
    weights: dict[int, OutWeights] = field(default_factory=dict)  # each layer's W_O by head, made once
    stacked: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)  # joined W_O of several layers, kept
    # every layer's keys and values as one tensor each, [layer, kv_head, pos, d_head], where they are kept that way
    layer_stacks: Mapping[str, torch.Tensor] = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return len(self.inputs)

    @torch.inference_mode()
    def importance(self, layer: int, positions: Sequence[int]) -> LayerImportance:
        """The importances of ``layer``'s parts at rows ``positions``, computed in chunks of rows."""
        data = self.inputs[layer]
        order = [int(p) for p in positions]
        index = torch.tensor(order, dtype=torch.long)
        lo, hi = int(data.first[index].min()), int(data.last[index].max()) + 1
        step = max(1, PARTS_BUDGET // max(1, (hi - lo) * data.query.shape[0]))  # rows whose [head, row, key] fit
        peaks = self._peaks([layer], lo, hi)
        pieces = [self._block([layer], order[s : s + step], lo, hi, peaks) for s in range(0, len(order), step)]
        heads = torch.zeros((len(order), self.residuals[0].shape[0], data.query.shape[0]))
        heads[:, lo:hi] = torch.cat([p[0][0] for p in pieces])
        return LayerImportance(tuple(order), heads, *(torch.cat([p[i][0] for p in pieces]) for i in (1, 2, 3)))

    @torch.inference_mode()
    def importance_across(self, layers: Sequence[int], position: int) -> list[LayerImportance]:
        """The importances of row ``position`` at each of ``layers``, computed together: a generation's step needs
        its own position's row at nearly every layer, and one batch of a few dozen torch ops serves them all where
        a row at a time paid each op's dispatch once per layer. Layers whose rows cannot share a batch (per-query
        sinks, post-attention norms of different kinds) are computed one at a time."""
        layers = list(layers)
        if not self._batchable(layers):
            return [self.importance(layer, [position]) for layer in layers]
        datas = [self.inputs[layer] for layer in layers]
        lo = min(int(d.first[position]) for d in datas)
        hi = max(int(d.last[position]) for d in datas) + 1
        found = self._block(layers, [position], lo, hi, self._peaks(layers, lo, hi))
        heads = torch.zeros((len(layers), 1, self.residuals[0].shape[0], datas[0].query.shape[0]))
        heads[..., lo:hi, :] = found[0]
        return [LayerImportance((position,), heads[b], *(part[b] for part in found[1:])) for b in range(len(layers))]

    def _batchable(self, layers: list[int]) -> bool:
        """Whether ``layers``' rows can share one batch: sinks at most one per head, norms (or none) of one kind."""
        sinks = [self.inputs[layer].sinks for layer in layers]
        per_query = any(s is not None and s.dim() == 4 for s in sinks)
        norms = {(layer in self.norms, isinstance(self.norms.get(layer), nn.LayerNorm)) for layer in layers}
        return not per_query and len(norms) == 1

    def out_weights(self, layer: int) -> OutWeights:
        """``layer``'s output projection by head (:class:`~attnscope.attribution.route_parts.OutWeights`), kept."""
        if layer not in self.weights:
            data = self.inputs[layer]
            self.weights[layer] = OutWeights.of_site(self.sites[layer], data.query.shape[0], data.key.shape[0])
        return self.weights[layer]

    def joined(self, layers: list[int]) -> torch.Tensor:
        """``layers``' :attr:`OutWeights.joined` stacked, ``[layer, kv_head, d_head, group x d_model]``: a view for one
        layer; for several, stacked once and kept, each layer's own then a view of the stack (not a second copy)."""
        if len(layers) == 1:
            return self.out_weights(layers[0]).joined[None]
        for layer in layers:
            self.out_weights(layer)
        return joined_stack(self.weights, self.stacked, layers)

    def _peaks(self, layers: list[int], lo: int, hi: int) -> torch.Tensor:
        """The values' peaks ``[layer, head, key]`` over keys ``lo..hi-1`` (:func:`~.route_parts.value_peaks`):
        kept ones where the generation kept them, else found here."""
        device = self.out_weights(layers[0]).per_head.device
        kept = [self.inputs[layer].peaks for layer in layers]
        return _stacked([value_peaks(self.inputs[layer].value[:, lo:hi].to(device), self.out_weights(layer))
                         if peaks is None else peaks[:, lo:hi] for layer, peaks in zip(layers, kept)])

    def _block(self, layers: list[int], rows: list[int], lo: int, hi: int,
               peaks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows ``rows`` of each of ``layers`` over keys ``lo..hi-1`` (``peaks``: :meth:`_peaks`): heads ``[layer,
        row, key, head]``, residual, ffn and ffn_residual ``[layer, row]`` (normalised); see
        :mod:`~attnscope.attribution.route_parts`."""
        datas = [self.inputs[layer] for layer in layers]
        index = torch.tensor(rows, dtype=torch.long)
        values = self._of_layers("value", layers, lo, hi).to(self.out_weights(layers[0]).per_head.device)
        probs = _probs(datas, self._of_layers("key", layers, lo, hi), index, lo)  # [layer, head, row, key]
        mixed = grouped_matmul(probs, values)  # [layer, head, row, d_head]: each head's output
        projected = torch.stack([self._projected(layer, mixed[b], rows) for b, layer in enumerate(layers)])
        frozen = [self._frozen(layer, projected[b]) for b, layer in enumerate(layers)]
        attention = torch.stack([o if not f else torch.stack([_through(n, v) for n, v in zip(f, o)])
                                 for f, o in zip(frozen, projected)])  # [layer, row, d_model]
        per_layer = [frozen_gains(f, o) for f, o in zip(frozen, projected)]  # [row, d_model] gains, centred
        gains = torch.stack([g for g, _ in per_layer])
        x = torch.stack([self.residuals[layer][index] for layer in layers])
        after = torch.stack([self.residuals[layer + 1][index] for layer in layers])
        y = x + attention
        centred = any(c for _, c in per_layer)
        parts = layers_part_proximities(probs, values, self.joined(layers), peaks, y, gains, centred, PARTS_BUDGET)
        residual = proximity(x, y)
        total = parts.sum((2, 3)) + residual
        ffn, kept = proximity(after - y, after), proximity(y, after)
        ffn_total = ffn + kept
        return (shares(parts, total[..., None, None]), shares(residual, total), shares(ffn, ffn_total),
                shares(kept, ffn_total))

    def _of_layers(self, name: str, layers: list[int], lo: int, hi: int) -> torch.Tensor:
        """``layers``' keys or values (``name``) over keys ``lo..hi-1``, ``[layer, kv_head, key, d_head]``: a view
        where every layer's are kept as one tensor, else stacked here."""
        whole = self.layer_stacks.get(name)
        if whole is not None and layers == list(range(whole.shape[0])):
            return whole[:, :, lo:hi]
        return _stacked([getattr(self.inputs[layer], name)[:, lo:hi] for layer in layers])

    def _projected(self, layer: int, mixed: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """The output projection's output ``[row, d_model]`` from each head's output ``mixed`` ``[head, row,
        d_head]``, checked against the model's where it was kept."""
        per_head = self.out_weights(layer).per_head
        heads, d_head, d_model = per_head.shape
        # [row, head x d_head] @ [head x d_head, d_model] (a view of W_O's transpose)
        projected = mixed.transpose(0, 1).reshape(len(rows), heads * d_head) @ per_head.reshape(-1, d_model)
        bias = getattr(self.sites[layer].out_proj, "bias", None)
        if bias is not None:
            projected = projected + bias.detach().float()
        self._check(layer, rows, projected)
        return projected

    def _frozen(self, layer: int, projected: torch.Tensor) -> list[FrozenNorm]:
        """The post-attention norm of each row frozen at its input (none without one)."""
        norm = self.norms.get(layer)
        return [] if norm is None else [freeze_norm(norm, row) for row in projected]

    def _check(self, layer: int, rows: list[int], projected: torch.Tensor) -> None:
        """Refuse a layer whose recomputed output projection differs from the model's at the checked position."""
        if self.position not in rows or layer not in self.checked:
            return
        actual = self.checked[layer].float()
        error = float((projected[rows.index(self.position)] - actual).abs().max())
        if error > CHECK_TOLERANCE * max(1.0, float(actual.abs().max())):
            raise AttnscopeError(f"layer {layer}'s attention output recomputed from its queries, keys and values is "
                                 f"off by {error:.3g} from the model's: routes cannot split it into parts "
                                 "(an output gate, or an attention the adapter does not describe)")


def joined_stack(weights: dict[int, OutWeights], stacked: dict[tuple[int, ...], torch.Tensor],
                 layers: list[int]) -> torch.Tensor:
    """``layers``' :attr:`OutWeights.joined` of ``weights`` stacked, ``[layer, kv_head, d_head, group x d_model]``,
    once: kept in ``stacked``, and each layer's own in ``weights`` then a view of the stack (not a second copy)."""
    key = tuple(layers)
    if key not in stacked:
        stack = torch.stack([weights[layer].joined for layer in layers])
        for b, layer in enumerate(layers):
            weights[layer] = replace(weights[layer], joined=stack[b])
        stacked[key] = stack
    return stacked[key]


def _through(frozen: FrozenNorm, vector: torch.Tensor) -> torch.Tensor:
    """A frozen norm applied to ``vector`` ``[d_model]``, bias included."""
    gain = frozen.gain.float()
    centred = vector - vector.mean() if frozen.centred else vector
    return gain * centred + (0.0 if frozen.bias is None else frozen.bias.float())


# ---- the forward pass ------------------------------------------------------------------------------------------
def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` stacked on a new first axis (a view for one)."""
    return tensors[0][None] if len(tensors) == 1 else torch.stack(tensors)


def _probs(datas: list[LayerInputs], keys: torch.Tensor, rows: torch.Tensor, lo: int) -> torch.Tensor:
    """The attention rows of queries ``rows`` at each layer of ``datas`` over its ``keys`` ``[layer, kv_head, key,
    d_head]``, keys ``lo..``: ``[layer, head, row, key]`` (0 outside each row's band of keys)."""
    query = _stacked([d.query[:, rows] for d in datas])
    scores = grouped_matmul(query, keys.transpose(2, 3))
    scores = scores * torch.tensor([d.scaling for d in datas], dtype=scores.dtype)[:, None, None, None]
    for b, d in enumerate(datas):
        if d.softcap is not None:
            scores[b] = torch.tanh(scores[b] / d.softcap) * d.softcap
    positions = torch.arange(lo, lo + keys.shape[2])
    first = torch.stack([d.first[rows] for d in datas])[..., None]  # [layer, row, 1]
    last = torch.stack([d.last[rows] for d in datas])[..., None]
    seen = (positions >= first) & (positions <= last)  # [layer, row, key]
    scores = scores.masked_fill(~seen[:, None], torch.finfo(scores.dtype).min)
    return softmax_with_sinks(scores, _sinks(datas, rows))[0]


def _sinks(datas: list[LayerInputs], rows: torch.Tensor) -> torch.Tensor | None:
    """The layers' learned sink logits as ``softmax_with_sinks`` takes them, ``[head]`` for one layer or ``[layer,
    head, 1, 1]`` (minus infinity for a layer without: no mass), or per query ``[1, head, row, 1]`` (one layer)."""
    sinks = [d.sinks for d in datas]
    if all(s is None for s in sinks):
        return None
    if len(datas) == 1:
        only = sinks[0]
        return only[:, :, rows] if only is not None and only.dim() == 4 else only
    n_heads = datas[0].query.shape[0]
    return torch.stack([torch.full((n_heads,), float("-inf")) if s is None else s.float().reshape(n_heads)
                        for s in sinks])[:, :, None, None]


def check_route_model(loaded: LoadedModel) -> None:
    """Refuse, in one line, a model whose prediction routes cannot follow (before any text runs)."""
    if loaded.is_encoder_decoder or not loaded.causal:
        raise AttnscopeError(f"model {loaded.name!r} is not a decoder-only language model; routes follow one "
                             "prediction of one (e.g. --model smollm2)")
    config = loaded.config
    parallel = getattr(config, "parallel_attn", False) or getattr(config, "use_parallel_residual", False)
    if config.model_type in PARALLEL_BLOCKS or parallel:
        raise AttnscopeError(f"{config.model_type!r} blocks run attention and the feed-forward side by side on the "
                             "same input; routes need them one after the other (pre-norm decoders: Llama, Gemma, "
                             "Qwen, GPT-2, ...)")
    unembedding(loaded)


def route_tensors(loaded: LoadedModel, ids: Sequence[int], position: int) -> tuple[RouteTensors, int]:
    """Run ``ids`` once, keeping what the walk needs (:class:`RouteTensors`: each block's input and arguments, whose
    attention inputs :class:`RerunInputs` recomputes layer by layer); also the model's top next token at
    ``position``."""
    blocks = blocks_by_layer(loaded)
    residuals: dict[int, torch.Tensor] = {}
    calls: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
    checked: dict[int, torch.Tensor] = {}

    def block_input(layer: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            residuals[layer] = (args[0] if args else kwargs["hidden_states"])[0].detach().float()
            calls[layer] = (args, dict(kwargs))
        return hook

    def last_output(module: nn.Module, inputs: Any, output: Any) -> None:
        residuals[len(blocks)] = _first(output)[0].detach().float()

    def projection(layer: int) -> Any:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            checked[layer] = _first(output)[0, position].detach().float()
        return hook

    input_ids = torch.tensor([list(ids)], device=loaded.input_device)
    with ExitStack() as stack:
        stack.enter_context(torch.inference_mode())
        stack.enter_context(capture(loaded.sites, recorder=RouteInputs(())))  # nothing kept: SDPA's lazy mask
        for layer, block in enumerate(blocks):
            stack.enter_context(local_hooks([block], block_input(layer), pre=True))
        stack.enter_context(local_hooks([blocks[-1]], last_output))
        for site in loaded.sites.values():
            if site.kind == "self" and site.out_proj is not None:
                stack.enter_context(local_hooks([site.out_proj], projection(site.layer)))
        keep = len(ids) - position
        logits = loaded.model(input_ids=input_ids, use_cache=False, **last_logits_only(loaded, keep)).logits[0]
        predicted = int(logits[-keep].argmax())
    sites = {site.layer: site for site in loaded.sites.values() if site.kind == "self"}
    if sorted(sites) != list(range(len(blocks))) or len(residuals) != len(blocks) + 1:
        raise AttnscopeError(f"model {loaded.name!r} has layers without self-attention (or several per block); "
                             "routes need one attention and one feed-forward block per layer")
    norms = _output_norms(loaded, unembedding(loaded).attention_norm)
    tensors = RouteTensors(RerunInputs(loaded, calls), [residuals[i] for i in range(len(blocks) + 1)], sites, norms,
                           position, checked)
    return tensors, predicted


# ---- the graph -------------------------------------------------------------------------------------------------
class Node(NamedTuple):
    """A node of the graph: ``residual`` is the stream entering ``layer`` at ``position`` (``layer = n_layers``:
    the last one), ``attention`` the stream after ``layer``'s attention block, ``ffn`` that layer's feed-forward
    block."""

    layer: int
    position: int
    kind: str


@dataclass(frozen=True)
class Edge:
    """One kept edge: ``via`` is ``attention`` (source token -> query through the heads; ``heads``: each head's
    share, summing to ``importance``), ``residual`` (the stream carried on) or ``ffn``."""

    source: Node
    target: Node
    importance: float
    via: str
    heads: tuple[float, ...] = ()


def walk(tensors: RouteTensors, position: int, tau: float, known: KeptRows | None = None) -> list[Edge]:
    """The edges kept top-down from the last residual stream at ``position``, following kept edges only: at each
    layer, the rows whose stream entering ``layer + 1`` is reached, their feed-forward block's edges that exceed
    ``tau``, and, where one of those is kept (the attention node is then reached), the attention block's edges that
    exceed ``tau``. So every edge returned lies on a path of kept edges to the output node.

    A row's edges depend on that row alone (its query, the keys and values up to it, its residual streams), so
    ``known`` (:class:`KeptRows` at the same ``tau``), when given, keeps each row's edges once computed: walks of
    several positions of one text (a generation's steps) compute only the rows no walk has reached before."""
    edges: list[Edge] = []

    def visit(layer: int, i: int, row: KeptRow) -> list[int]:
        row_edges, sources = row.walked(layer, i, tau)
        edges.extend(row_edges)
        return sources

    walk_rows(tensors, position, tau, known, visit)
    return edges


def walk_rows(tensors: RouteTensors, position: int, tau: float, known: KeptRows | None,
              visit: Callable[[int, int, KeptRow], list[int]]) -> None:
    """:func:`walk`'s order of rows: ``visit(layer, i, row)`` is called on each reached row (its :class:`KeptRow`,
    computed where ``known`` lacks it), top layer first, positions ascending, and returns the positions its kept
    edges reach in the stream entering ``layer``."""
    known = KeptRows(tau) if known is None else known
    if known.tau != tau:
        raise ValueError(f"rows kept at tau {known.tau} cannot serve a walk at tau {tau}")
    reached = [position]
    for layer in reversed(range(tensors.n_layers)):
        known.compute(tensors, layer, reached)
        below: set[int] = set()
        for i in reached:
            below.update(visit(layer, i, known.rows[layer, i]))
        reached = sorted(below)
        if not reached:
            break


class KeptRow(NamedTuple):
    """What one row ``(layer, i)`` gives the walk at one ``tau``: its feed-forward block's shares (``ffn``,
    ``ffn_residual``), its attention block's residual share, and the attention edges above ``tau``: their source
    positions ``[edge]`` (int64, ascending), importances ``[edge]`` and per-head shares ``[edge, head]`` (float64:
    the walk's own numbers, so a kept row gives back the very edges it was made from)."""

    ffn: float
    ffn_residual: float
    residual: float
    sources_above: np.ndarray
    importance: np.ndarray
    heads: np.ndarray

    @classmethod
    def of(cls, rows: LayerImportance, r: int, tau: float) -> KeptRow:
        """Row ``r`` of ``rows`` (its attention edges kept only where an edge leads up from it: else none is)."""
        ffn, ffn_residual, residual = float(rows.ffn[r]), float(rows.ffn_residual[r]), float(rows.residual[r])
        per_head = rows.heads[r]  # [source_pos, head]
        sources = (per_head.sum(-1) > tau).nonzero()[:, 0].tolist() if ffn > tau or ffn_residual > tau else []
        importance = [float(per_head[j].sum()) for j in sources]
        heads = [[round(float(v), 7) for v in per_head[j]] for j in sources]
        return cls(ffn, ffn_residual, residual, np.array(sources, dtype=np.int64), np.array(importance),
                   np.array(heads, dtype=np.float64).reshape(len(sources), per_head.shape[-1]))

    def walked(self, layer: int, i: int, tau: float) -> tuple[list[Edge], list[int]]:
        """The row's kept edges, in the walk's order (the feed-forward block's, then, where one of them is kept, the
        residual edge into the attention node and the attention edges), and the positions whose stream entering
        ``layer`` they reach."""
        upward = _ffn_edges(layer, i, self.ffn, self.ffn_residual, tau)
        if not upward:  # nothing kept leads up from this attention node (tau >= 0.5, or a 0/0 row: shares())
            return [], []
        attention, below = Node(layer, i, "attention"), self.sources_above.tolist()
        edges = upward
        if self.residual > tau:
            edges.append(Edge(Node(layer, i, "residual"), attention, self.residual, "residual"))
            below.append(i)
        for j, importance, split in zip(self.sources_above.tolist(), self.importance.tolist(), self.heads.tolist()):
            edges.append(Edge(Node(layer, j, "residual"), attention, importance, "attention", tuple(split)))
        return edges, below


class KeptRows:
    """Each walked row's :class:`KeptRow` at ``tau``, by ``(layer, position)``: memory grows with the rows walked, at
    most :meth:`bound` bytes."""

    def __init__(self, tau: float) -> None:
        self.tau = tau
        self.rows: dict[tuple[int, int], KeptRow] = {}

    def compute(self, tensors: RouteTensors, layer: int, positions: Sequence[int]) -> None:
        """Compute and keep the rows of ``layer`` at ``positions`` not kept yet."""
        missing = [i for i in positions if (layer, i) not in self.rows]
        if missing:
            rows = tensors.importance(layer, missing)
            for r, i in enumerate(rows.positions):
                self.rows[layer, i] = KeptRow.of(rows, r, self.tau)

    def compute_across(self, tensors: RouteTensors, position: int) -> None:
        """Compute and keep the rows of ``position`` at every layer not kept yet, together
        (:meth:`RouteTensors.importance_across`): a walk from ``position`` reaches it at nearly every layer."""
        missing = [layer for layer in range(tensors.n_layers) if (layer, position) not in self.rows]
        if missing:
            for layer, rows in zip(missing, tensors.importance_across(missing, position)):
                self.rows[layer, position] = KeptRow.of(rows, 0, self.tau)

    @staticmethod
    def bound(n_layers: int, n_positions: int, n_heads: int, tau: float) -> int:
        """Bytes of every row of a text of ``n_positions`` kept: a row's attention edges each hold more than ``tau`` of
        its shares, which sum to 1, so fewer than ``1 / tau`` (and at most one per position); each edge 8 bytes of
        position, 8 of importance and 8 per head; a row's fixed cost ``ROW_BYTES`` (its tuple, floats and arrays)."""
        per_row = min(n_positions, int(1 / tau) if tau > 0 else n_positions)
        return n_layers * n_positions * (ROW_BYTES + per_row * 8 * (2 + n_heads))


def _ffn_edges(layer: int, i: int, ffn: float, kept: float, tau: float) -> list[Edge]:
    """The feed-forward block's kept edges at row ``i`` into the stream entering ``layer + 1`` (each leaves the
    attention node, directly or through the feed-forward node)."""
    attention, ffn_node, out = Node(layer, i, "attention"), Node(layer, i, "ffn"), Node(layer + 1, i, "residual")
    edges = []
    if ffn > tau:
        edges += [Edge(attention, ffn_node, ffn, "ffn"), Edge(ffn_node, out, ffn, "ffn")]
    if kept > tau:
        edges.append(Edge(attention, out, kept, "residual"))
    return edges


@dataclass(frozen=True, eq=False)
class Routes:
    """The information-flow graph of one prediction: the ``edges`` kept above ``tau``, top-down from the last
    residual stream at ``position`` (the model chose ``predicted`` there). Nodes are :class:`Node`; layers, heads
    and positions are 0-indexed; ``n_layers`` blocks of ``n_heads`` heads."""

    model: str
    tokens: tuple[str, ...]
    position: int
    predicted: str
    tau: float
    n_layers: int
    n_heads: int
    edges: tuple[Edge, ...]

    @property
    def output(self) -> Node:
        return Node(self.n_layers, self.position, "residual")

    @property
    def nodes(self) -> tuple[Node, ...]:
        """Every node on a kept edge (the output node included), sorted."""
        found = {self.output} | {e.source for e in self.edges} | {e.target for e in self.edges}
        return tuple(sorted(found))

    def to_frame(self) -> Any:
        """One row per edge: source and target (layer, position, kind), ``via``, ``importance``, ``top_head``
        (-1 off attention edges) and ``heads`` (each head's share, attention edges only)."""
        import pandas as pd

        rows = [{"source_layer": e.source.layer, "source_position": e.source.position, "source_kind": e.source.kind,
                 "target_layer": e.target.layer, "target_position": e.target.position, "target_kind": e.target.kind,
                 "via": e.via, "importance": e.importance,
                 "top_head": int(np.argmax(e.heads)) if e.heads else -1, "heads": list(e.heads)} for e in self.edges]
        columns = ["source_layer", "source_position", "source_kind", "target_layer", "target_position", "target_kind",
                   "via", "importance", "top_head", "heads"]
        return pd.DataFrame(rows, columns=columns)

    def to_networkx(self) -> Any:
        """A ``networkx.MultiDiGraph`` (an attention edge and a residual edge may join the same two nodes): nodes
        are :class:`Node` tuples with ``token``; edges carry ``importance``, ``via`` and ``heads``."""
        import networkx as nx

        graph = nx.MultiDiGraph(model=self.model, position=self.position, tau=self.tau)
        for node in self.nodes:
            graph.add_node(node, layer=node.layer, position=node.position, kind=node.kind,
                           token=self.tokens[node.position])
        for edge in self.edges:
            graph.add_edge(edge.source, edge.target, importance=edge.importance, via=edge.via, heads=edge.heads)
        return graph

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the fields, nodes as ``[layer, position, kind]``; importances and head shares to 7 decimals
        (a generation record keeps them as float32: their full decimal forms would double a page's routes)."""
        return {"model": self.model, "tokens": list(self.tokens), "position": self.position,
                "predicted": self.predicted, "tau": self.tau, "n_layers": self.n_layers, "n_heads": self.n_heads,
                "edges": [{"source": list(e.source), "target": list(e.target), "importance": round(e.importance, 7),
                           "via": e.via, "heads": [round(h, 7) for h in e.heads]} for e in self.edges]}

    def save(self, path: str | Path) -> Path:
        """Write :meth:`to_dict` as JSON to ``path``."""
        from ..files import written

        path = Path(path)
        with written(path) as temporary:
            Path(temporary).write_text(json.dumps(self.to_dict()), encoding="utf-8")
        return path

    def plot(self, path: str | Path | None = None) -> Any:
        """A matplotlib figure: tokens on x, layers on y (each layer's residual stream, then its attention block's
        output a third of a layer up, its feed-forward block beside that); edge width = importance, attention
        edges coloured by their top head. Saved to ``path`` when given."""
        return route_figure(self, path)

    def _repr_html_(self) -> str:
        return str(self.to_frame().to_html(index=False, float_format=lambda v: f"{v:.3g}"))

    def __repr__(self) -> str:
        return (f"Routes({self.model}, position {self.position} {self.tokens[self.position]!r} -> "
                f"{self.predicted!r}, tau {self.tau}: {len(self.edges)} edges, {len(self.nodes)} nodes)")


LEVEL = {"residual": 0.0, "attention": 1 / 3, "ffn": 2 / 3}  # height of each node kind within its layer
FFN_SHIFT = 0.3  # the feed-forward node sits beside its position's column


def _place(node: Node) -> tuple[float, float]:
    """A node's (x, y) in the figure: x = position (feed-forward blocks shifted right), y = layer + its level."""
    return node.position + (FFN_SHIFT if node.kind == "ffn" else 0.0), node.layer + LEVEL[node.kind]


def route_figure(graph: Routes, path: str | Path | None = None, width: float = 6.0) -> Any:
    """:meth:`Routes.plot`'s figure (``matplotlib.figure.Figure``, no pyplot state); saved to ``path`` when given
    (the format from its suffix)."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    figure = Figure(figsize=(max(6.0, 0.45 * len(graph.tokens)), max(4.0, 0.35 * (graph.n_layers + 1))))
    axes = figure.add_subplot()
    colours = colormaps["tab10"]
    for edge in graph.edges:
        (x0, y0), (x1, y1) = _place(edge.source), _place(edge.target)
        colour = colours(int(np.argmax(edge.heads)) % 10) if edge.heads else "0.45"
        axes.plot([x0, x1], [y0, y1], color=colour, linewidth=0.3 + width * edge.importance, alpha=0.8,
                  solid_capstyle="round")
    nodes = graph.nodes
    axes.scatter([_place(n)[0] for n in nodes], [_place(n)[1] for n in nodes], s=8, color="black", zorder=3)
    axes.set_xticks(range(len(graph.tokens)), list(graph.tokens), rotation=90, fontsize=7)
    axes.set_yticks(range(graph.n_layers + 1), [str(layer) for layer in range(graph.n_layers)] + ["out"], fontsize=7)
    axes.set_xlim(-0.7, len(graph.tokens) - 0.3)
    axes.set_ylabel("layer (0-indexed; the residual stream entering it)")
    axes.set_title(f"{graph.model}: route of position {graph.position} ({graph.tokens[graph.position]!r} -> "
                   f"{graph.predicted!r}), tau {graph.tau}; colour = top head", fontsize=8)
    figure.tight_layout()
    if path is not None:
        from ..files import written

        target = Path(path)
        with written(target) as temporary:
            figure.savefig(temporary, format=target.suffix.lstrip(".").lower() or "png", dpi=130)
    return figure


def check_tau(tau: float) -> float:
    """``tau`` if it is a threshold the walk can use (0 <= tau < 1), else one error line."""
    if not 0.0 <= tau < 1.0:
        raise AttnscopeError(f"tau must be at least 0 and below 1 (an importance share), not {tau}")
    return float(tau)


def routes(model: LoadedModel | str, text: str | Sequence[int], position: int = -1, tau: float = TAU) -> Routes:
    """The information-flow routes of the prediction at ``position`` of ``text`` (a text, or token ids):
    one forward pass, then the top-down walk (see the module docstring). ``position``: 0-indexed, negative from the
    end (default: the last); ``tau``: the importance an edge must exceed to be kept."""
    return routes_and_tensors(model, text, position, tau)[0]


def routes_and_tensors(model: LoadedModel | str, text: str | Sequence[int], position: int = -1,
                       tau: float = TAU) -> tuple[Routes, RouteTensors]:
    """:func:`routes`, and the :class:`RouteTensors` it walked (for scores over the unpruned graph:
    :mod:`.route_scores`)."""
    tau = check_tau(tau)
    loaded = as_loaded(model)
    check_route_model(loaded)
    ids = _ids_of(loaded, text)
    t = _resolve_position(position, len(ids))
    tensors, predicted = route_tensors(loaded, ids, t)
    edges = walk(tensors, t, tau)
    n_heads = n_config_heads(loaded)
    name = lambda token: readable_tokens(loaded.tokenizer, [token])[0]
    graph = Routes(loaded.name, readable_tokens(loaded.tokenizer, list(ids)), t, name(predicted), tau,
                   tensors.n_layers, n_heads, tuple(edges))
    return graph, tensors

