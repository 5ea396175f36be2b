"""Context-mixing measures on a model: capture what they read, run value zeroing, one entry point.

:func:`capture_layers` runs the input side once under a capture session (attention and values
from the one attention function) with hooks that keep each layer's input (the residual) and the
layer norms' inputs, and turns them into :class:`~attnscope.analysis.mixing.LayerTensors`.
:func:`value_zeroing_distances` re-runs each block alone on its recorded input, as a batch of T
copies where copy j zeroes token j's value (a :class:`ValueZeroing` intervention): one batched
block call per layer, not one model call per token. The measures themselves are computed in
``attnscope.analysis.mixing``.

>>> mix = mixing("minilm", "The cat sat on the mat.", method="alti")   # doctest: +SKIP
>>> mix.layers.shape                                                  # [layer, q_pos, k_pos]
(6, 9, 9)
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from ..analysis.mixing import (
    METHODS,
    LayerTensors,
    Mixing,
    NormFacts,
    get_measure,
    method_name,
    mixing_from_record,
    mixing_from_tensors,
)
from ..capture.attention import capture, intervene
from ..capture.extract import as_loaded
from ..capture.hooks import local_hooks
from ..capture.recorders import SiteCapture, main_kind, per_head_out_proj, transformed_values
from ..capture.tokens import Side, encode_side
from ..errors import AttnscopeError
from ..models.adapters import AttentionSite, find_modules
from ..models.loading import LoadedModel
from ..records.attention import AttentionRecord
from .interventions import ValueZeroing
from .sweeps import block_inputs, run_blocks_from

ZEROING_COPIES = 64  # most zeroed copies of one input run side by side (bounds memory on long inputs)

Kept = list[tuple[tuple[Any, ...], dict[str, Any]]]
Modules = tuple[list[nn.Module], list[nn.Module] | None, list[nn.Module] | None]


@dataclass(frozen=True, eq=False)
class Captured:
    """One input's pass through the input side: ``layers`` (one :class:`LayerTensors` per layer,
    0-indexed), the ``blocks`` that computed them with their recorded arguments ``kept`` and outputs
    ``outputs`` (``[layer]`` of ``[pos, d_model]``), and the input's ``side`` (tokens, ids)."""

    side: Side
    kind: str
    causal: bool
    layers: list[LayerTensors]
    blocks: list[nn.Module]
    kept: Kept
    outputs: list[torch.Tensor]

    @property
    def tokens(self) -> tuple[str, ...]:
        return self.side.tokens


def _ordered(found: Mapping[tuple[str, int], nn.Module], kind: str, what: str, n_layers: int) -> list[nn.Module]:
    """The modules of ``kind`` by layer; a clear error when the adapter table does not find all of them."""
    modules = [found.get((kind, layer)) for layer in range(n_layers)]
    if any(module is None for module in modules):
        raise AttnscopeError(f"the adapter table does not locate every layer's {what} for this model; "
                             "context mixing needs it (see attnscope.models.adapters)")
    return cast(list[nn.Module], modules)


def input_side(loaded: LoadedModel) -> nn.Module:
    """The module that runs the input side alone: the encoder of an encoder-decoder, else the base model."""
    return loaded.model.get_encoder() if loaded.is_encoder_decoder else loaded.model.base_model


def encode_text(loaded: LoadedModel, text: str, max_length: int | None = None) -> tuple[Side, dict[str, Any]]:
    """The tokenized input (cut to ``max_length`` tokens, at most the model's limit) and its model
    inputs (batch of one, on the model's input device)."""
    if not text or not text.strip():
        raise AttnscopeError("the text is empty; give a sentence to measure context mixing on")
    limit = min(max_length or loaded.max_length, loaded.max_length)
    side = encode_side(loaded.tokenizer, text, None, limit, 0, loaded.max_length)
    ids = torch.tensor([side.input_ids], device=loaded.input_device)
    inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if loaded.causal:
        inputs["use_cache"] = False  # a cache would keep keys across calls
    return side, inputs


class _Inputs:
    """A forward hook that keeps each module's first input and its output (detached)."""

    def __init__(self) -> None:
        self.seen: dict[nn.Module, tuple[torch.Tensor | None, torch.Tensor]] = {}

    def __call__(self, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output
        self.seen[module] = (inputs[0].detach() if inputs else None, out.detach())


def _norm_facts(module: nn.Module, seen: _Inputs) -> NormFacts:
    """A LayerNorm's weight and bias, and the scale of the input it got in the recorded pass."""
    if not isinstance(module, nn.LayerNorm) or module.weight is None or module.bias is None:
        raise AttnscopeError(f"context mixing decomposes LayerNorm with weight and bias; got {type(module).__name__}")
    normed = seen.seen[module][0]
    assert normed is not None, "a LayerNorm is called with its input as a positional argument"
    normed = normed[0].double()  # [pos, d_model]
    scale = torch.sqrt(normed.var(-1, unbiased=False) + module.eps)
    weight, bias = (parameter.detach().double().cpu().numpy() for parameter in (module.weight, module.bias))
    return NormFacts(weight, bias, scale.cpu().numpy())


_MODULES: weakref.WeakKeyDictionary[nn.Module, Modules] = weakref.WeakKeyDictionary()


def _layer_modules(loaded: LoadedModel, kind: str, n_layers: int) -> Modules:
    """Each layer's block, first and second layer norm (None where the adapter names none), by layer;
    looked up once per model (walking the module tree costs more than a short sentence's measures)."""
    if loaded.model not in _MODULES:
        norms = loaded.adapter.norms
        assert norms is not None

        def by_layer(pattern: Any, what: str) -> list[nn.Module]:
            return _ordered(find_modules(loaded.model, pattern), kind, what, n_layers)

        _MODULES[loaded.model] = (by_layer(loaded.adapter.blocks, "block"),
                                  by_layer(norms.after_attention, "first layer norm") if norms.after_attention else None,
                                  by_layer(norms.after_ffn, "second layer norm") if norms.after_ffn else None)
    return _MODULES[loaded.model]


def capture_layers(loaded: LoadedModel, text: str, max_length: int | None = None) -> Captured:
    """Run the input side once and keep what the mixing measures need (see the module docstring);
    ``max_length``: cut the text to that many tokens (as ``extract`` does)."""
    if loaded.adapter.norms is None:
        raise AttnscopeError(f"the adapter for {loaded.config.model_type!r} does not say where its layer norms are; "
                             "context mixing beyond raw attention is unavailable for it")
    side, inputs = encode_text(loaded, text, max_length)
    kind = main_kind(loaded.sites.values())
    sites = sorted((s for s in loaded.sites.values() if s.kind == kind), key=lambda s: s.layer)
    blocks, first, second = _layer_modules(loaded, kind, len(sites))
    seen = _Inputs()
    with (torch.inference_mode(), block_inputs(blocks) as kept, capture(loaded.sites, qkv=True) as session,
          local_hooks([*blocks, *(first or []), *(second or [])], seen)):
        input_side(loaded)(**inputs)
        layers = [_layer_tensors(session.captured[(kind, site.layer)], site, *kept[site.layer],
                                 None if first is None else _norm_facts(first[site.layer], seen),
                                 None if second is None else _norm_facts(second[site.layer], seen))
                  for site in sites]
    outputs = [seen.seen[block][1][0] for block in blocks]
    return Captured(side, kind, loaded.causal, layers, blocks, kept, outputs)


def _layer_tensors(captured: Any, site: AttentionSite, args: tuple[Any, ...], kwargs: dict[str, Any],
                   after_attention: NormFacts | None, after_ffn: NormFacts | None) -> LayerTensors:
    """One layer's :class:`LayerTensors` from its site capture and its block's recorded input."""
    site_capture = cast(SiteCapture, captured)
    assert site_capture.values is not None
    residual = args[0] if args else kwargs["hidden_states"]  # [1, pos, d_model]
    out_proj = site.out_proj
    bias = getattr(out_proj, "bias", None)
    transformed = transformed_values(site_capture.values, site)[0]  # [head, k_pos, d_model]
    gate = site_capture.gate  # [1, head, q_pos, d_head]: the model's output gate (Qwen3-Next), or None
    gated = {} if gate is None else {
        "gate": gate[0].double().cpu().numpy(), "values": site_capture.values[0].double().cpu().numpy(),
        "out_proj": per_head_out_proj(site, transformed.shape[0]).double().cpu().numpy()}
    return LayerTensors(
        attention=site_capture.attention[0].double().cpu().numpy(),
        transformed=transformed.double().cpu().numpy(),
        out_bias=np.zeros(transformed.shape[-1]) if bias is None else bias.detach().double().cpu().numpy(),
        residual=residual[0].detach().double().cpu().numpy(),
        after_attention=after_attention,
        after_ffn=after_ffn,
        **gated,
    )


def value_zeroing_distances(captured: Captured, layers: Iterable[int] | None = None,
                            progress: bool = False) -> np.ndarray:
    """Cosine distance between each layer's output at position i and the same block's output with
    token j's value vector zeroed in every head: ``[layer, q_pos, k_pos]`` (Mohebbi et al. 2023).

    Each block runs alone on its recorded input, batched: up to :data:`ZEROING_COPIES` copies side
    by side, copy j zeroing position j (layers not in ``layers`` are left at 0). In causal models
    the distances to later keys are exactly 0. ``progress``: a bar over layers and groups of copies
    (a long input costs T block runs of T positions per layer).
    """
    from tqdm.auto import tqdm

    n = len(captured.tokens)
    chosen = list(range(len(captured.blocks)) if layers is None else layers)
    distances = np.zeros((len(captured.blocks), n, n))
    groups = range(0, n, ZEROING_COPIES)
    with torch.inference_mode(), tqdm(total=len(chosen) * len(groups), unit="block run", desc="value zeroing",
                                      disable=not progress) as bar:
        for layer in chosen:
            intact = captured.outputs[layer]  # [pos, d_model]
            for start in groups:
                positions = torch.arange(start, min(n, start + ZEROING_COPIES), device=intact.device)
                with intervene(ValueZeroing(layer, positions, captured.kind)):
                    zeroed = run_blocks_from(captured.blocks, captured.kept, layer, 1, len(positions), stop=layer + 1)
                cosine = nn.functional.cosine_similarity(zeroed.double(), intact.double()[None], dim=-1)  # [copy, pos]
                distances[layer, :, start : start + len(positions)] = (1.0 - cosine).T.cpu().numpy()
                bar.update()
    if captured.causal:  # a query never sees later keys: what zeroing them "changes" is rounding noise
        distances = np.tril(distances)
    return distances


def check_one_text(loaded: LoadedModel, pair: str | None) -> None:
    """The measures read the input side alone: an encoder-decoder's ``pair`` is its target, which the
    encoder never sees; any other model's second sentence would make them measure another input."""
    if pair is not None and not loaded.is_encoder_decoder:
        raise AttnscopeError("the context-mixing measures take one text: leave out the second sentence")


def mixing_measures(model: LoadedModel | str, text: str, methods: Sequence[str] = METHODS,
                    progress: bool = False, max_length: int | None = None) -> dict[str, Mixing]:
    """Several measures of one input from one capture pass: ``{method: Mixing}`` (``progress``: a bar
    over value zeroing's block runs; ``max_length``: cut the text to that many tokens)."""
    loaded = as_loaded(model)
    names = [method_name(m) for m in methods]
    captured = capture_layers(loaded, text, max_length)
    intervening = any(get_measure(name).intervention for name in names)  # today: value zeroing
    distances = value_zeroing_distances(captured, progress=progress) if intervening else None
    return {name: mixing_from_tensors(name, captured.layers, captured.tokens, loaded.name, distances, loaded.causal)
            for name in names}


def mixing(model_or_record: LoadedModel | str | AttentionRecord, text: str | None = None,
           method: str = "alti", progress: bool = False) -> Mixing:
    """How much each token draws on each input token, per layer and aggregated by rollout.

    ``method``: ``attention``, ``norm`` (Kobayashi et al. 2020), ``norm_residual`` / ``globenc``
    (Modarressi et al. 2022), ``alti`` (Ferrando et al. 2022) or ``value_zeroing`` (Mohebbi et al.
    2023); see ``attnscope.analysis.mixing``. A record gives ``attention`` only (``text`` unused).

    >>> mix = attnscope.mixing("minilm", "The cat sat on the mat.", method="value_zeroing")  # doctest: +SKIP
    >>> mix.rollout[-1]      # [q_pos, k_pos]: rollout through the last layer, rows sum to 1  # doctest: +SKIP
    """
    if isinstance(model_or_record, AttentionRecord):
        return mixing_from_record(model_or_record, method)
    return mixing_measures(model_or_record, text or "", [method], progress)[method_name(method)]
