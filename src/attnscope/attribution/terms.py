"""What direct logit attribution and the logit lens need from one forward pass, and their linear algebra.

A causal LM's logit of token y at position t is ``u_y · N(x_t) + b_y``: ``x_t`` is the last
residual stream, ``N`` the final norm, ``u_y`` the LM head's row. ``x_t`` is a sum: the
embeddings, then each layer's attention output and feed-forward (MLP) output (through a norm of
their own first in Gemma 2/3 and OLMo 2). Each norm is linear in its input once its scale
(``1 / rms``) is fixed, and here the scale is the one of the actual run (the usual practice), so
the logit splits exactly into one term per component. Attention's output is ``Σ_h o_h W_O^h +
b_O``, and head h's output at query t is ``Σ_j α_tj v_j``, so its term splits further over the
source tokens j.

One forward pass gives every term: :class:`PositionRows` (a
:class:`~attnscope.capture.recorders.Recorder`) keeps each layer's probability row of query t and
the values, and :func:`residual_parts` (thread-local forward hooks) keeps the embeddings, every
sublayer's output, every block's output and the final norm's input at the chosen positions (or at
each pass's last position: a generation's steps, :mod:`attnscope.attribution.steps`).
:func:`decompose` turns them into the terms for any direction ``u`` (a target token's row, or the
difference of two rows for a contrast). Layers and heads are 0-indexed.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, cast
from weakref import WeakKeyDictionary

import numpy as np
import torch
from torch import nn

from ..capture.hooks import local_hooks
from ..capture.recorders import AttentionCall, Recorder, per_head_out_proj
from ..errors import AttnscopeError
from ..memory import trim_heap
from ..models.adapters import AttentionSite, ModuleRule, Unembedding, find_modules
from ..models.loading import DTYPES, LoadedModel

# The reconstructed last residual stream must equal the model's to this share of its largest value,
# else the architecture is not the one the adapter describes (a sublayer the sum misses); a model in
# bfloat16 or float16 is allowed its own rounding on top (see rounding_bound).
RESIDUAL_TOLERANCE = 1e-3


def unit_roundoff(dtype: torch.dtype) -> float:
    """The largest relative error of one rounding to ``dtype`` (round to nearest): half its machine epsilon,
    2^-8 for bfloat16, 2^-11 for float16, 2^-24 for float32."""
    return float(torch.finfo(dtype).eps) / 2 if dtype.is_floating_point else 0.0


@dataclass
class PositionRows(Recorder):
    """Keeps, of every self-attention call, the probability rows of query ``positions`` and the values they mix.

    ``rows[layer]``: ``[position, head, source_pos]`` float32 (sources ``0..max(positions)``; a row is 0
    past its own position); ``values[layer]``: ``[head, source_pos, d_head]`` float32, expanded to the
    query heads (grouped key/value heads repeated, as everywhere in capture). A call's query rows
    before the first position run on the fused kernel (:meth:`rows_not_wanted`). Batch of one, no cache.
    """

    positions: tuple[int, ...]
    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    sites: dict[int, AttentionSite] = field(default_factory=dict)

    def wants(self, site: AttentionSite) -> bool:
        return site.kind == "self"

    def rows_not_wanted(self, site: AttentionSite, n_queries: int) -> int:
        return min(self.positions)

    def keep(self, site: AttentionSite, call: AttentionCall) -> None:
        index = torch.tensor(self.positions, device=call.probs.device) - call.first_query
        sources = max(self.positions) + 1
        self.rows[site.layer] = call.probs[0][:, index, :sources].transpose(0, 1).detach().float()
        self.values[site.layer] = call.values[0, :, :sources].detach().float()
        self.sites[site.layer] = site


@dataclass
class ResidualParts:
    """Residual-stream pieces (batch row 0), each ``[position, d_model]`` float32: ``embeddings`` (the first block's
    input), ``attention[layer]`` (the output projection's output), ``ffn[layer]`` (the feed-forward module's
    output), ``blocks[layer]`` (each block's output) and ``final`` (the final norm's input). ``positions``: the
    positions kept of one forward pass, or None: the last position of each pass, one row per pass in the order
    they ran (a generation's prompt, then its steps). Filled when :func:`residual_parts` exits."""

    positions: torch.Tensor | None
    embeddings: torch.Tensor | None = None
    attention: dict[int, torch.Tensor] = field(default_factory=dict)
    ffn: dict[int, torch.Tensor] = field(default_factory=dict)
    blocks: dict[int, torch.Tensor] = field(default_factory=dict)
    final: torch.Tensor | None = None
    # what the hooks keep as they run, ``(part, layer)`` -> one ``[position, d_model]`` piece per pass: a generation's
    # recorder reads (and lets go of) each pass's pieces while the next pass runs
    pieces: dict[tuple[str, int], list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))

    def fill(self, pieces: dict[tuple[str, int], list[torch.Tensor]]) -> None:
        """Join what the hooks kept (``(part, layer)`` -> one ``[position, d_model]`` piece per pass)."""
        joined = {key: torch.cat(rows) for key, rows in pieces.items()}
        self.embeddings, self.final = joined.get(("embeddings", 0)), joined.get(("final", 0))
        for name in ("attention", "ffn", "blocks"):
            getattr(self, name).update({layer: rows for (part, layer), rows in joined.items() if part == name})


def unembedding(loaded: LoadedModel) -> Unembedding:
    """The adapter's unembedding facts, or one line saying this model has none."""
    if loaded.is_encoder_decoder or not loaded.causal:
        raise AttnscopeError(f"model {loaded.name!r} is not a decoder-only language model; direct logit attribution, "
                             "the logit lens and activation patching need one (e.g. --model smollm2)")
    facts = loaded.adapter.unembedding
    if facts is None:
        raise AttnscopeError(f"attnscope does not know how {loaded.config.model_type!r} models reach their logits "
                             "(no unembedding in the adapters table)")
    return facts


# per model: each pattern's module, found once (a generation's attribution asks for the final norm at every step, and
# walking every module's name with a regular expression cost a tenth of a step's attribution in SmolLM2)
_NAMED_MODULES: WeakKeyDictionary[nn.Module, dict[str, nn.Module]] = WeakKeyDictionary()


def named_module(loaded: LoadedModel, pattern: str) -> nn.Module:
    """The first module whose qualified name matches ``pattern``."""
    found = _NAMED_MODULES.setdefault(loaded.model, {})
    if pattern not in found:
        found[pattern] = _first_named(loaded, pattern)
    return found[pattern]


def _first_named(loaded: LoadedModel, pattern: str) -> nn.Module:
    for name, module in loaded.model.named_modules():
        if re.search(pattern, name):
            return cast(nn.Module, module)
    raise AttnscopeError(f"no module matching {pattern!r} in {loaded.name}")


def lm_head(loaded: LoadedModel) -> nn.Module:
    head = loaded.model.get_output_embeddings()
    if head is None:
        raise AttnscopeError(f"model {loaded.name!r} has no LM head")
    return cast(nn.Module, head)


def logit_direction(loaded: LoadedModel, token: int) -> tuple[torch.Tensor, float]:
    """The LM head's row of ``token`` ``[d_model]`` (float64) and its bias (0 without one): the final
    norm's output dotted with the row, plus the bias, is the token's logit."""
    head = lm_head(loaded)
    bias = cast(torch.Tensor | None, getattr(head, "bias", None))
    row = cast(torch.Tensor, head.weight).detach()[token].double()
    return row, 0.0 if bias is None else float(bias[token])


def blocks_by_layer(loaded: LoadedModel) -> list[nn.Module]:
    """The decoder's blocks, ordered by layer."""
    found = find_modules(loaded.model, loaded.adapter.blocks)
    return [found[key] for key in sorted(k for k in found if k[0] == "self")]


def _first(value: Any) -> torch.Tensor:
    return cast(torch.Tensor, value[0] if isinstance(value, tuple) else value)


@contextmanager
def residual_parts(loaded: LoadedModel, positions: Sequence[int] | None, *, sublayers: bool = True,
                   blocks: bool = False) -> Iterator[ResidualParts]:
    """Keep the residual-stream pieces of the forward passes inside the block (thread-local hooks): at ``positions``
    of one pass, or (None) at the last position of every pass (see :class:`ResidualParts`, filled on exit).

    ``sublayers``: the embeddings, attention and feed-forward outputs and the final norm's input
    (what :func:`decompose` needs); ``blocks``: each block's output (what the logit lens needs).
    """
    facts = unembedding(loaded)
    index = None if positions is None else torch.as_tensor(list(positions), dtype=torch.long,
                                                            device=loaded.input_device)
    parts = ResidualParts(index)
    pieces = parts.pieces
    layer_blocks = blocks_by_layer(loaded)

    def keep(key: tuple[str, int], tensor: torch.Tensor) -> None:
        # the last position copied: a view would hold the pass's whole [position, d_model] output (a long prompt's)
        rows = tensor[0, -1:].clone() if index is None else tensor[0, index.to(tensor.device)]
        pieces[key].append(rows.detach().float())

    def keeper(part: str, layer: int) -> Any:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            keep((part, layer), _first(output))
        return hook

    def first_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        keep(("embeddings", 0), args[0] if args else kwargs["hidden_states"])

    def final_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        keep(("final", 0), args[0] if args else next(iter(kwargs.values())))

    with ExitStack() as stack:
        if sublayers:
            stack.enter_context(local_hooks([layer_blocks[0]], first_input, pre=True))
            stack.enter_context(local_hooks([named_module(loaded, facts.final_norm)], final_input, pre=True))
            for site in loaded.sites.values():
                if site.kind == "self" and site.out_proj is not None:
                    stack.enter_context(local_hooks([site.out_proj], keeper("attention", site.layer)))
            for (kind, layer), module in find_modules(loaded.model, loaded.adapter.ffn).items():
                if kind == "self":
                    stack.enter_context(local_hooks([module], keeper("ffn", layer)))
        if blocks:
            for layer, block in enumerate(layer_blocks):
                stack.enter_context(local_hooks([block], keeper("blocks", layer)))
        yield parts
    parts.fill(pieces)


@dataclass(frozen=True)
class FrozenNorm:
    """A norm with its scale fixed at one input's: ``N(c) = gain ⊙ (c − mean(c) if centred else c)``
    for any ``c``, plus ``bias`` once (``[d_model]`` float64 each; ``bias`` None when the norm has none).
    ``scale``: the run's ``1 / rms`` (``1 / std`` for a LayerNorm), a factor of ``gain``."""

    gain: torch.Tensor
    centred: bool
    bias: torch.Tensor | None
    scale: float

    def pull_back(self, direction: torch.Tensor) -> torch.Tensor:
        """The direction ``w`` with ``w · c = direction · N(c)`` for every component ``c``, ``[d_model]``; a
        read-out ``[d_model, d_out]`` is pulled back column by column."""
        w = self.gain.reshape(-1, *[1] * (direction.dim() - 1)) * direction
        return w - w.mean(0) if self.centred else w

    def unit(self) -> FrozenNorm:
        """The same norm at scale 1 (``gain / scale``): the part every position shares, so that
        ``N_p(c) = scale_p · unit(c)`` plus the bias."""
        return FrozenNorm(self.gain / self.scale, self.centred, self.bias, 1.0)

    def bias_term(self, direction: torch.Tensor) -> float:
        return 0.0 if self.bias is None else float(self.bias @ direction)


def _eps(norm: nn.Module) -> float:
    for name in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(norm, name, None)
        if isinstance(value, float | int):
            return float(value)
    raise AttnscopeError(f"cannot tell the epsilon of norm {type(norm).__name__}")


def freeze_norm(norm: nn.Module, x: torch.Tensor) -> FrozenNorm:
    """``norm`` at input ``x`` (``[d_model]``) as a :class:`FrozenNorm`: LayerNorm (centred, with bias) or any
    RMS norm ``g ⊙ x / rms(x)`` (Llama's weight, Gemma's 1 + weight: ``g`` is read as ``N(1) · sqrt(1 + eps)``).
    Checked against ``norm(x)``: a norm of another form is refused, not approximated."""
    x64 = x.double()
    weight = cast(torch.Tensor | None, getattr(norm, "weight", None))
    with torch.no_grad():
        if isinstance(norm, nn.LayerNorm):
            centred = x64 - x64.mean()
            scale = torch.rsqrt(centred.pow(2).mean() + norm.eps)
            gain = scale * (torch.ones_like(x64) if weight is None else weight.double())
            bias = None if norm.bias is None else norm.bias.double()
            frozen = FrozenNorm(gain, True, bias, float(scale))
        else:
            eps = _eps(norm)
            # the gain read in float32 at least: a bfloat16 norm's output of ones would round it (2^-8)
            ones = torch.ones((1, x.shape[-1]), dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
            g = norm(ones)[0].double() * (1.0 + eps) ** 0.5
            scale = torch.rsqrt(x64.pow(2).mean() + eps)
            frozen = FrozenNorm(g * scale, False, None, float(scale))
        expected = norm(x[None])[0].double()
    got = frozen.gain * (x64 - x64.mean() if frozen.centred else x64) + (0 if frozen.bias is None else frozen.bias)
    if not _norm_matches(got, expected, x.dtype):
        raise AttnscopeError(f"norm {type(norm).__name__} is neither a LayerNorm nor an RMS norm; direct logit "
                             "attribution cannot fix its scale")
    return frozen


def _norm_matches(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> bool:
    """The frozen form ``got`` equals the norm's own output ``expected`` (same shape) to 1e-4 of its largest value,
    plus, in a half-precision ``dtype``, the norm's own roundings: its normalised input and its output are each
    rounded to ``dtype`` (Llama's RMS norm), so each value is off by at most ``2u`` of itself (``u``: the unit
    roundoff), to first order."""
    allowed = 1e-4 * max(1.0, float(expected.abs().max())) + 2 * unit_roundoff(dtype) * expected.abs()
    return bool(((got - expected).abs() <= allowed).all())


def freeze_norm_rows(norm: nn.Module, x: torch.Tensor) -> tuple[FrozenNorm, torch.Tensor]:
    """``norm`` at each row of ``x`` (``[position, d]``) frozen: its scale-1 form (:meth:`FrozenNorm.unit`, the
    same at every position) and each position's scale ``[position]`` float64, so that
    ``norm(x_p) = scale_p · unit(x_p) + bias``. Checked against ``norm(x)`` like :func:`freeze_norm`."""
    unit = freeze_norm(norm, x[0]).unit()
    x64 = x.double()
    centred = x64 - x64.mean(-1, keepdim=True) if unit.centred else x64
    scales = torch.rsqrt(centred.pow(2).mean(-1) + _eps(norm))
    with torch.no_grad():
        expected = norm(x).double()
    got = scales[:, None] * unit.gain * centred + (0 if unit.bias is None else unit.bias)
    if not _norm_matches(got, expected, x.dtype):
        raise AttnscopeError(f"norm {type(norm).__name__} is neither a LayerNorm nor an RMS norm; its scale cannot "
                             "be frozen")
    return unit, scales


@dataclass(frozen=True)
class Components:
    """A layer's input (the residual stream) at some positions, split into the pieces that add up to it, each read
    through one linear read-out: ``values`` ``[component, position, d_out]`` float64 (``c_p @ readout``);
    ``names``: ``"embedding"``, ``"L3H2 (head)"`` (a head's output through its slice of ``W_O`` and any
    post-attention norm), ``"L3 attention bias"`` (the output projection's bias and the norm's, where there is
    one), ``"L5 MLP"``. Layers and heads 0-indexed."""

    names: tuple[str, ...]
    values: torch.Tensor


def _through_norm(norm: nn.Module | None, outputs: torch.Tensor,
                  readout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sublayer's output (``[position, d_model]``) joins the residual through ``norm`` (or as it is): the read-out
    pulled back through the norm's scale-1 form ``[d_model, d_out]``, each position's scale ``[position]`` and the
    norm's bias read out ``[d_out]``."""
    if norm is None:
        return (readout, torch.ones(len(outputs), dtype=readout.dtype, device=readout.device),
                torch.zeros(readout.shape[1], dtype=readout.dtype, device=readout.device))
    unit, scales = freeze_norm_rows(norm, outputs)
    bias = torch.zeros_like(readout[0]) if unit.bias is None else unit.bias @ readout
    return unit.pull_back(readout), scales, bias


def _through_norm_each(norm: nn.Module, outputs: torch.Tensor,
                       directions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_through_norm` with each position's own direction (``directions`` ``[position, d_model]``, float64):
    each pulled back through ``norm`` frozen at that position's output ``[position, d_model]``, the norm's bias read
    out along it ``[position]``, and the position's scale ``[position]``."""
    read, scales, bias = _through_norm(norm, outputs, directions.T)  # every direction at every position's scale 1
    return read.T * scales[:, None], bias, scales


@torch.inference_mode()
def layer_input_components(loaded: LoadedModel, parts: ResidualParts, head_outputs: dict[int, torch.Tensor],
                           layer: int, readout: torch.Tensor, actual: torch.Tensor) -> Components:
    """The input of ``layer`` at ``parts``' positions, split into :class:`Components` read through ``readout``
    (``[d_model, d_out]``; the identity gives the vectors themselves). ``head_outputs[l]``: layer ``l``'s per-head
    output before ``W_O`` at the same positions, ``[position, head, d_head]``, for every ``l < layer``;
    ``actual``: the layer's input as the model had it, ``[position, d_model]``: the components must add up to it
    (read out), else the model is refused. Call it outside :func:`residual_parts`."""
    facts = unembedding(loaded)
    if parts.embeddings is None:
        raise AttnscopeError(f"model {loaded.name!r} ran without the hooks the residual stream's split needs")
    readout = readout.double()
    sites = {site.layer: site for site in loaded.sites.values() if site.kind == "self"}
    attention_norms, ffn_norms = _output_norms(loaded, facts.attention_norm), _output_norms(loaded, facts.ffn_norm)
    names, values = ["embedding"], [parts.embeddings.double() @ readout]
    for l in range(layer):
        heads = head_outputs[l].double()  # [position, head, d_head]
        n_heads = heads.shape[1]
        read, scales, norm_bias = _through_norm(attention_norms.get(l), parts.attention[l], readout)
        per_head = per_head_out_proj(sites[l], n_heads).double() @ read  # [head, d_head, d_out]
        values.extend(torch.einsum("phd,hde->hpe", heads, per_head) * scales[None, :, None])
        names.extend(f"L{l}H{h} (head)" for h in range(n_heads))
        bias = getattr(sites[l].out_proj, "bias", None)
        if bias is not None or attention_norms.get(l) is not None and norm_bias.any():
            out_bias = 0.0 if bias is None else scales[:, None] * (bias.double() @ read)
            values.append(out_bias + norm_bias.expand(len(scales), -1))
            names.append(f"L{l} attention bias")
        read, scales, norm_bias = _through_norm(ffn_norms.get(l), parts.ffn[l], readout)
        values.append(scales[:, None] * (parts.ffn[l].double() @ read) + norm_bias)
        names.append(f"L{l} MLP")
    stacked = torch.stack(values)
    _check_rebuilt(loaded, stacked.sum(0), actual.double() @ readout, f"the input of layer {layer}",
                   "QK attribution")
    return Components(tuple(names), stacked)


@dataclass
class Terms:
    """The logit's terms at one position for one direction (float64 tensors).

    ``heads`` ``[layer, head]``, ``head_sources`` ``[layer, head, source_pos]`` (sum over sources =
    ``heads``; empty when :func:`decompose` did not split them), ``mlps`` ``[layer]``, ``attention_bias``
    ``[layer]`` (the output projection's bias, through the post-attention norm where there is one),
    ``embeddings`` and ``final_bias`` (final norm's bias and LM head's bias), ``final_scale`` (the final norm's
    1 / rms, or 1 / std). By layer, for :meth:`sources_of`: ``out_weights`` (per-head ``W_O``, ``[head, d_head,
    d_model]`` float32) and ``directions`` (``[d_model]``: the direction as the layer's attention output meets it,
    through its post-attention norm where it has one)."""

    heads: torch.Tensor
    head_sources: torch.Tensor
    mlps: torch.Tensor
    attention_bias: torch.Tensor
    embeddings: float
    final_bias: float
    final_scale: float
    out_weights: dict[int, torch.Tensor]
    directions: dict[int, torch.Tensor]

    def total(self) -> float:
        return float(self.heads.sum() + self.mlps.sum() + self.attention_bias.sum()) + self.embeddings + self.final_bias

    def sources_of(self, rows: PositionRows, heads: Sequence[tuple[int, int]], index: int = 0) -> torch.Tensor:
        """The terms of ``heads`` (``(layer, head)`` pairs) split over the sources ``0..t``, ``[pair, source_pos]``
        float64, from the ``rows`` :func:`decompose` read (as its ``split`` would, for these heads alone)."""
        t = rows.positions[index]
        split = []
        for layer, head in heads:
            values = rows.values[layer]  # [kv_head, source_pos, d_head]
            kv = head // (rows.rows[layer].shape[1] // values.shape[0])
            per_source = values[kv, : t + 1].double() @ head_readouts(self.out_weights[layer][head],
                                                                      self.directions[layer])
            split.append(rows.rows[layer][index, head, : t + 1].double() * per_source)
        return torch.stack(split)


# per model: each pattern's norms by layer, found once (a generation's attribution asks for them at every step)
_OUTPUT_NORMS: WeakKeyDictionary[nn.Module, dict[str, dict[int, nn.Module]]] = WeakKeyDictionary()


def _output_norms(loaded: LoadedModel, pattern: str) -> dict[int, nn.Module]:
    """The modules matching ``pattern`` (a post-sublayer norm), by layer; none for an empty pattern."""
    if not pattern:
        return {}
    found = _OUTPUT_NORMS.setdefault(loaded.model, {})
    if pattern not in found:
        found[pattern] = {layer: module for (_, layer), module
                          in find_modules(loaded.model, (ModuleRule("self", pattern),)).items()}
    return found[pattern]


@torch.inference_mode()
def decompose(loaded: LoadedModel, rows: PositionRows, parts: ResidualParts, direction: torch.Tensor,
              head_bias: float = 0.0, index: int = 0, weights: dict[int, torch.Tensor] | None = None, *,
              split: bool = True) -> Terms:
    """The terms of ``direction · N(x_t) + head_bias`` (``direction``: ``[d_model]``, an LM head row or a
    difference of two) at ``t = rows.positions[index]`` (``parts`` kept the same positions): one position of
    :func:`decompose_positions`."""
    return decompose_positions(loaded, rows, parts, direction[None], [head_bias], [index], weights, split=split)[0]


@torch.inference_mode()
def decompose_positions(loaded: LoadedModel, rows: PositionRows, parts: ResidualParts, directions: torch.Tensor,
                        head_biases: Sequence[float], indices: Sequence[int],
                        weights: dict[int, torch.Tensor] | None = None, *, split: bool = True) -> list[Terms]:
    """The terms at ``rows.positions[i]`` for each ``i`` of ``indices``, each of its own direction (``directions``
    ``[index, d_model]``; ``head_biases`` beside them): a generation's steps, a few at a time.
    ``weights``: a cache of each layer's per-head ``W_O`` across calls (filled on first use). ``split``: every
    head's term split over the sources (``Terms.head_sources``); without it, each head's term is its output (the row
    times the values, float32) read out in float64, every position's at once per layer (each value and each W_O read
    once for them all, not once per step), and :meth:`Terms.sources_of` splits the heads wanted.
    Call it outside :func:`residual_parts`: it runs the norms, whose hooks would keep its inputs."""
    facts = unembedding(loaded)
    if parts.final is None or parts.embeddings is None:
        raise AttnscopeError(f"model {loaded.name!r} ran without the hooks direct logit attribution needs")
    weights = {} if weights is None else weights
    at = torch.tensor(list(indices), dtype=torch.long, device=parts.final.device)
    u = directions.double().to(parts.final.device)  # [index, d_model]
    w, final_biases, final_scales = _through_norm_each(named_module(loaded, facts.final_norm), parts.final[at], u)
    layers = sorted(rows.rows)
    n_heads = rows.rows[layers[0]].shape[1]
    for layer in layers:
        if layer not in weights:
            weights[layer] = per_head_out_proj(rows.sites[layer], n_heads)
    # each sublayer's output as the residual stream receives it, and the direction pulled back through its norm
    w_attention, attention_added, attention_norm_bias = _joined(
        _output_norms(loaded, facts.attention_norm), layers, [parts.attention[layer][at] for layer in layers], w)
    w_mlp, mlp_added, mlp_norm_bias = _joined(
        _output_norms(loaded, facts.ffn_norm), layers, [parts.ffn[layer][at] for layer in layers], w)
    if split:
        sources = [torch.stack([rows.rows[layer][i, :, : rows.positions[i] + 1].double() * per_source_terms(
            rows.values[layer], head_readouts(weights[layer], w_attention[l, k]), rows.positions[i] + 1)
            for l, layer in enumerate(layers)]) for k, i in enumerate(indices)]  # per index [layer, head, source_pos]
        heads = torch.stack([split_terms.sum(-1) for split_terms in sources])
    else:
        heads = torch.stack([_read_heads(rows.rows[layer][at], rows.values[layer], weights[layer], w_attention[l])
                             for l, layer in enumerate(layers)], 1)  # [index, layer, head]
    out_biases = _out_proj_biases([rows.sites[layer] for layer in layers], w.shape[-1])  # [layer, d_model]
    biases = (out_biases[:, None] * w_attention).sum(-1) + attention_norm_bias  # [layer, index]
    mlps = (torch.stack([parts.ffn[layer][at] for layer in layers]).double() * w_mlp).sum(-1) + mlp_norm_bias
    _check_streams(loaded, parts.embeddings[at], attention_added, mlp_added, parts.final[at])
    embeddings = (parts.embeddings[at].double() * w).sum(-1)
    return [Terms(heads=heads[k], head_sources=sources[k] if split else torch.zeros(0, dtype=torch.float64),
                  mlps=mlps[:, k], attention_bias=biases[:, k], embeddings=float(embeddings[k]),
                  final_bias=float(final_biases[k]) + head_biases[k], final_scale=float(final_scales[k]), out_weights=weights,
                  directions=dict(zip(layers, w_attention[:, k], strict=True))) for k in range(len(indices))]


def _read_heads(rows: torch.Tensor, values: torch.Tensor, out_weights: torch.Tensor,
                directions: torch.Tensor) -> torch.Tensor:
    """One layer's head terms at several positions, ``[position, head]`` float64: each position's rows ``rows``
    ``[position, head, source_pos]`` mixing ``values`` ``[kv_head, source_pos.., d_head]`` (grouped), read out along
    its direction (``directions`` ``[position, d_model]``) through ``out_weights`` (``[head, d_head, d_model]``)."""
    n_positions, n_heads, n_sources = rows.shape
    n_kv = values.shape[0]
    grouped = rows.float().reshape(n_positions, n_kv, -1, n_sources).transpose(0, 1).reshape(n_kv, -1, n_sources)
    outputs = torch.bmm(grouped, values[:, :n_sources].float())  # [kv_head, position x group, d_head]
    outputs = outputs.view(n_kv, n_positions, -1, outputs.shape[-1]).transpose(0, 1).reshape(n_positions, n_heads, -1)
    readouts = out_weights @ directions.T.float()  # [head, d_head, position]
    return torch.einsum("phd,hdp->ph", outputs.double(), readouts.double())


def _check_streams(loaded: LoadedModel, embeddings: torch.Tensor, attention_added: torch.Tensor,
                   mlp_added: torch.Tensor, final: torch.Tensor) -> None:
    """Each position's last residual stream summed from its parts in the model's order (embeddings ``[position,
    d_model]``, then each layer's ``attention_added`` and ``mlp_added`` ``[layer, position, d_model]``) against the
    model's (``final``), within the model's own rounding of its running sums."""
    added = torch.stack((attention_added, mlp_added), 1).flatten(0, 1)  # [2 x layer, position, d_model]: a0, m0, ..
    streams = embeddings.double() + added.cumsum(0)
    rounding = rounding_bound(streams.abs().sum(0), DTYPES[loaded.dtype])  # [position, d_model]
    for k in range(len(final)):
        _check_rebuilt(loaded, streams[-1, k], final[k].double(), rounding=rounding[k])


def _joined(norms: dict[int, nn.Module], layers: list[int], outputs: list[torch.Tensor],
            w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each layer's sublayer ``outputs`` (``[position, d_model]`` each) as they join the residual stream, through the
    layer's norm where it has one (Gemma 2/3's post-sublayer norms) or as they are, for each position's direction
    ``w`` ``[position, d_model]``: the direction pulled back through the norm and the joined outputs ``[layer,
    position, d_model]``, and the norm's bias read out ``[layer, position]``, float64."""
    raw = torch.stack(outputs).double()
    if not norms:
        return w.expand(len(layers), -1, -1), raw, torch.zeros(raw.shape[:2], dtype=torch.float64)
    pulled, joined = w.repeat(len(layers), 1, 1), raw.clone()
    bias = torch.zeros(raw.shape[:2], dtype=torch.float64)
    for i, layer in enumerate(layers):
        if layer in norms:
            pulled[i], bias[i], _ = _through_norm_each(norms[layer], outputs[i], w)
            joined[i] = norms[layer](outputs[i]).double()
    return pulled, joined, bias


def _out_proj_biases(sites: list[AttentionSite], d_model: int) -> torch.Tensor:
    """Each site's output projection's bias, ``[site, d_model]`` float64 (0 where it has none)."""
    biases = [cast(torch.Tensor | None, getattr(site.out_proj, "bias", None)) for site in sites]
    return torch.stack([torch.zeros(d_model, dtype=torch.float64) if bias is None else bias.detach().double()
                        for bias in biases])


def head_readouts(out_weights: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """What one unit of each head's output adds along ``direction`` (``[d_model]``): ``out_weights`` (per-head
    ``W_O``, ``[head, d_head, d_model]`` float32, or one head's ``[d_head, d_model]``) times it, ``[head, d_head]``
    (``[d_head]``) float64, formed in float32 (copying W_O to float64 cost more than the pass)."""
    return (out_weights @ direction.float()).double()


def per_source_terms(values: torch.Tensor, r: torch.Tensor, n_sources: int) -> torch.Tensor:
    """``values`` of sources ``0..n_sources-1`` dotted with ``r`` (``[head, d_head]``, what one unit of each head's
    output adds to the logit): ``[head, source_pos]`` float64. ``values``: ``[head, source, d_head]``, or grouped,
    ``[kv_head, source, d_head]`` (query head h reads kv head h // group): the heads of a group then share one product,
    so the values are neither copied once per query head nor, where they are float64 already, converted (a
    generation's steps did both, for every layer and step)."""
    n_heads, n_kv_heads = r.shape[0], values.shape[0]
    group = n_heads // n_kv_heads
    readout = r.double().view(n_kv_heads, group, -1).transpose(1, 2)  # [kv_head, d_head, group]
    terms = torch.matmul(values[:, :n_sources].double(), readout)  # [kv_head, source_pos, group]
    return terms.permute(0, 2, 1).reshape(n_heads, n_sources)


LENS_LOGITS_BYTES = 64 * 2**20  # the lens's logits formed at once: rows of [row, vocab] float32
LENS_SOFTMAX_ROWS = 32  # rows whose softmax and top-k run at once, while their logits are still in the cache


def lens_top(loaded: LoadedModel, blocks: dict[int, torch.Tensor], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The logit lens: ``[position, layer, k]`` top token ids (int64) and probabilities (float32) of each
    block's output (``blocks[layer]``: ``[position, d_model]``) through the final norm and the LM head (and
    any final logit softcapping). Every layer's rows go through the LM head together, ``LENS_LOGITS_BYTES`` of
    logits at a time (a few rows at a time read the head's weight once per few rows: a generation's lens cost a
    third of its plain speed at 64 rows a layer), and each ``LENS_SOFTMAX_ROWS`` of them through the softmax while
    they are in the cache (about a fifth less time than the softmax of all of them). Call it outside
    :func:`residual_parts`."""
    norm, head = named_module(loaded, unembedding(loaded).final_norm), lm_head(loaded)
    weight = cast(torch.Tensor, head.weight)
    softcap = getattr(loaded.config, "final_logit_softcapping", None)
    layers = sorted(blocks)
    n_positions, d_model = blocks[layers[0]].shape
    rows = torch.stack([blocks[layer] for layer in layers], 1).reshape(-1, d_model)  # [position x layer, d_model]
    k = min(k, weight.shape[0])
    ids, probs = torch.empty((len(rows), k), dtype=torch.long), torch.empty((len(rows), k))
    step = max(LENS_SOFTMAX_ROWS, LENS_LOGITS_BYTES // (weight.shape[0] * 4))
    for start in range(0, len(rows), step):
        logits = head(norm(rows[start : start + step].to(weight.dtype))).float()  # [row, vocab]
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        for sub in range(0, len(logits), LENS_SOFTMAX_ROWS):
            top = torch.softmax(logits[sub : sub + LENS_SOFTMAX_ROWS], dim=-1).topk(k, dim=-1)
            done = slice(start + sub, start + sub + len(top.indices))
            ids[done], probs[done] = top.indices.cpu(), top.values.cpu()
        del logits
    trim_heap()  # the freed logits would otherwise stay with the process (see trim_heap)
    return (ids.view(n_positions, len(layers), k).numpy(), probs.view(n_positions, len(layers), k).numpy())


def rounding_bound(partial_sums: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """How far a residual stream the model summed in ``dtype`` may be from the exact sum of the same parts, per
    value: each addition ``h_k = round(h_(k-1) + part_k)`` is off by at most ``u |h_k|`` (``u``: the unit
    roundoff), and the errors add up, so ``u * sum_k |h_k|`` (``partial_sums``), to first order; the factor 1.5
    covers the second-order terms and ``h_k`` read as the exact partial sums. 2^-8 per addition in bfloat16:
    after SmolLM2's 60, several units where the stream's largest values are in the hundreds."""
    return 1.5 * unit_roundoff(dtype) * partial_sums


def _check_rebuilt(loaded: LoadedModel, rebuilt: torch.Tensor, actual: torch.Tensor,
                   what: str = "its last residual stream", use: str = "direct logit attribution",
                   rounding: torch.Tensor | float = 0.0) -> None:
    """Refuse a model whose residual stream (``what``) is not the sum of the parts the adapter names, beyond
    :data:`RESIDUAL_TOLERANCE` and the model's own ``rounding`` (per value, :func:`rounding_bound`)."""
    off = (rebuilt - actual).abs()
    error = float(off.max())
    if bool((off > RESIDUAL_TOLERANCE * max(1.0, float(actual.abs().max())) + rounding).any()):
        raise AttnscopeError(f"the embeddings and sublayer outputs of {loaded.name!r} do not add up to {what} (off "
                             f"by {error:.3g}): its layers are not the pre-norm form the adapter for "
                             f"{loaded.config.model_type!r} describes, so {use} would be wrong")
