"""Per-architecture facts as data, the table's machinery: which modules compute attention, of what kind,
and where their output projection lives.

One :class:`Adapter` (a row) per group of Hugging Face model types; the rows live with their families in
:mod:`attnscope.models.architectures`, which collects them. A :class:`SiteRule` matches the
qualified name of an attention module (``re.search``; group 1 is the layer index) and says:

* ``kind``: ``self`` (encoder-only / decoder-only), ``encoder``, ``decoder`` or ``cross``;
* ``out_proj``: the output projection's path relative to that module; each leading ``../``
  climbs one level (BERT keeps it in a sibling: ``../output.dense``); ``a|b`` tries each in turn;
* ``causal``: whether queries see only earlier keys, for a module that does not say so itself: the
  module's own ``is_causal`` (what transformers' SDPA path reads) always wins; None means the module
  must say, and a model whose attention modules do not is refused;
* ``conv1d``: GPT-2's ``Conv1D`` stores its weight as ``[in, out]`` instead of ``[out, in]``;
* ``classes``: where not empty, only modules of these class names match: hybrids (RecurrentGemma,
  Nemotron-H) put an attention layer or a recurrent one at the same place;
* ``layer_attribute``: where set, the record's layer is this attribute of the module rather than group 1
  (LongCat-Flash runs two attention modules per block, its ``layer_idx`` numbering them in order);
* ``window``: the attention module's attribute that holds its sliding window (each query sees
  itself and the ``window - 1`` keys before it; None on a layer that sees every key),
  e.g. Gemma 3 slides on 5 of every 6 layers. A module without that attribute slides by its config's
  (Mistral, Mixtral, Phi-3, Starcoder2, MiniMax, PhiMoE, Doge: their calls pass ``config.sliding_window``, or
  their masks slide by it on every layer), and a layer its config names ``chunked_attention`` sees the keys of
  its own chunk of ``attention_chunk_size`` (Llama 4). transformers builds the window into the mask the
  attention function receives; the site only carries the fact, for records and views (:func:`layer_window`).

A model type in no row is read from the model itself (:mod:`attnscope.models.architectures.generic`);
whatever cannot be read with certainty is refused (:func:`find_sites`).
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..errors import AttnscopeError

HOW_TO_ADD = "see docs/ARCHITECTURE.md, 'To add… An architecture'"


@dataclass(frozen=True)
class SiteRule:
    kind: str
    pattern: str
    out_proj: str
    causal: bool | None = False
    conv1d: bool = False
    window: str = ""
    classes: tuple[str, ...] = ()  # where not empty: only modules of these classes (a hybrid's attention layers)
    layer_attribute: str = ""  # where set: the module's attribute that holds its layer (several modules per block)


@dataclass(frozen=True)
class ModuleRule:
    """A module of each layer other than attention: ``pattern`` (group 1 = layer) of ``kind``."""

    kind: str
    pattern: str


@dataclass(frozen=True)
class LayerNorms:
    """Where a layer's normalisations sit around its residual stream, for the measures that
    decompose a whole layer (GlobEnc, ALTI; see ``attnscope.analysis.mixing``).

    Post-LN layers (BERT, BART): ``after_attention`` is the LayerNorm applied to residual +
    attention output, ``after_ffn`` the one applied to that + the feed-forward output. Pre-LN
    layers (Llama, GPT-2) normalise each token before its sublayer, so both are empty: the
    attention block's output is the plain sum residual + attention.
    """

    after_attention: tuple[ModuleRule, ...] = ()
    after_ffn: tuple[ModuleRule, ...] = ()


PRE_LN = LayerNorms()


@dataclass(frozen=True)
class HeadProjections:
    """Where one attention module keeps its per-head weights, for physical head pruning.

    ``query``/``key``/``value``: ``nn.Linear`` paths relative to the attention module (rows are
    ``[head * d_head]``, head-major); the output projection is the site's ``out_proj`` (columns
    ``[head * d_head]``). The attribute tuples name counters on the attention module that must
    follow the new head count (each is updated when the module has it).
    """

    query: str
    key: str
    value: str
    head_count: tuple[str, ...] = ()  # number of query heads
    kv_head_count: tuple[str, ...] = ()  # number of key/value heads
    group_size: tuple[str, ...] = ()  # query heads per key/value head
    width: tuple[str, ...] = ()  # query heads * d_head


@dataclass(frozen=True)
class Unembedding:
    """How a causal LM's sublayers reach its logits, for direct logit attribution and the logit lens.

    ``final_norm``: the pattern (``re.search``) of the norm applied to the last residual stream
    before the LM head. ``attention_norm``/``ffn_norm``: patterns (group 1 = layer) of norms applied
    to a sublayer's *output* before it joins the residual stream (Gemma 2 and 3, OLMo 2); empty when
    the output joins as it is (Llama, GPT-2). The LM head is the model's output embeddings.
    """

    final_norm: str
    attention_norm: str = ""
    ffn_norm: str = ""


@dataclass(frozen=True)
class Adapter:
    """``rules``: attention sites. ``blocks``: whole layers (for running from a layer onwards).
    ``ffn``: the module whose output is the feed-forward sublayer's contribution (zero it to skip
    the sublayer; for post-LN BERT that is the sum before the LayerNorm).
    ``final``: patterns (``re.search`` on module names) of the modules the model applies, in this
    order, to the last block's output to give its main output (``last_hidden_state`` or
    ``logits``); a pattern that matches nothing is skipped (a base model has no LM head). ``None``
    means unknown: experiments then never run the model from a middle layer onwards.
    ``projections``: per-head weights for physical pruning (``None``: not supported).
    ``norms``: where the layer norms sit around the residual (``None``: unknown; the measures
    that decompose whole layers are then unavailable). ``unembedding``: how sublayers reach the
    logits (``None``: unknown; direct logit attribution and the logit lens are then refused).
    ``not_tokens``: class names of modules that call the attention function over something other than
    the input's tokens (Inkling 2 mixes each layer's input from earlier blocks' outputs by attention over
    depth): their calls are computed and never recorded, where any other call from a module that is no
    site is refused.
    ``loaded_eager``: the model picks its attention class by the implementation's name (Falcon, GPT-Neo), so it
    cannot be built with ``"attnscope"``: it is built with ``"eager"`` and its attention modules are bridged."""

    family: str
    model_types: tuple[str, ...]
    rules: tuple[SiteRule, ...]
    blocks: tuple[ModuleRule, ...] = ()
    ffn: tuple[ModuleRule, ...] = ()
    note: str = ""
    final: tuple[str, ...] | None = None
    projections: HeadProjections | None = None
    norms: LayerNorms | None = None
    unembedding: Unembedding | None = None
    not_tokens: tuple[str, ...] = ()  # classes that call the attention function over no tokens: computed, not recorded
    loaded_eager: bool = False  # built with attn_implementation="eager", then bridged

    @property
    def generic(self) -> bool:
        """True for the adapters of model types not in the table (their sites are read from the model)."""
        return not self.model_types


@dataclass(frozen=True, eq=False)
class AttentionSite:
    """One attention module of a loaded model: the place the capture function records from.

    ``out_proj`` is the module whose weight maps the concatenated heads back to the residual
    stream (``[d_model, n_heads * d_head]`` for ``nn.Linear``). ``window``: the sliding window in
    keys (query ``q`` sees keys ``q - window + 1 .. q``), 0 when the layer sees every key; with ``chunked``,
    the window is a chunk instead (query ``q`` sees keys ``(q // window) * window .. q``: Llama 4's chunked layers).
    ``learned_sinks``: the module has a learned sink logit per head in its softmax's denominator (gpt-oss's
    ``sinks``, passed to the attention function as ``s_aux``): its rows over the real keys sum to less than 1.
    ``causal_known``: False for a module that does not say whether it is causal (no ``is_causal``) of a type
    read from the model; ``causal`` is then what its model's class implies (a causal LM's self-attention, a
    decoder's), and the capture refuses any call of it whose causality the mask does not settle.
    """

    kind: str
    layer: int
    name: str
    causal: bool
    out_proj: nn.Module | None = field(repr=False)
    conv1d: bool = False
    window: int = 0
    chunked: bool = False  # the window is a chunk of keys, not a sliding window
    causal_known: bool = True
    learned_sinks: bool = False  # its softmax has one learned sink logit per head (gpt-oss's ``sinks``)


def resolve_relative(model: nn.Module, module_name: str, relative: str) -> nn.Module | None:
    """The module at ``relative`` from ``module_name`` (``../`` climbs), or None if absent."""
    parts = module_name.split(".")
    while relative.startswith("../"):
        parts, relative = parts[:-1], relative[3:]
    try:
        return model.get_submodule(".".join([*parts, relative]))
    except AttributeError:
        return None


def find_sites(model: nn.Module, adapter: Adapter) -> dict[nn.Module, AttentionSite]:
    """Every attention module of ``model`` matched by ``adapter``'s rules, mapped to its site.

    Refuses (:class:`~attnscope.errors.AttnscopeError`) what it cannot read with certainty: two modules
    that would be the same layer of the same kind (a model with several stacks, or one that reuses its
    layers). A module that does not say whether it is causal where the rule does not know gets a site
    with ``causal_known`` False: its calls are refused when their mask does not settle it.
    """
    sites: dict[nn.Module, AttentionSite] = {}
    seen: dict[tuple[str, int], str] = {}
    for name, module in model.named_modules():
        for rule in adapter.rules:
            match = re.search(rule.pattern, name)
            if match and (not rule.classes or type(module).__name__ in rule.classes):
                layer = getattr(module, rule.layer_attribute) if rule.layer_attribute else match.group(1)
                site = _site(model, name, module, rule, int(layer))
                if (site.kind, site.layer) in seen:
                    raise AttnscopeError(
                        f"model type {model_type_of(model)!r}: modules {seen[(site.kind, site.layer)]} and {name} "
                        f"would both be {site.kind} layer {site.layer} (several stacks of layers, or layers used "
                        f"more than once), so attnscope cannot tell its layers apart; it needs an adapter row for "
                        f"this type ({HOW_TO_ADD})")
                seen[(site.kind, site.layer)] = name
                sites[module] = site
                break
    return sites


def model_type_of(model: nn.Module) -> str:
    """The model type a model (or an attention module with its ``config``) names, else its class."""
    return str(getattr(getattr(model, "config", None), "model_type", type(model).__name__))


def attends_over_no_tokens(module: nn.Module) -> bool:
    """Whether ``module`` is of a class its adapter's ``not_tokens`` names (marked by ``load_model``)."""
    return bool(getattr(module, "attnscope_not_tokens", False))


def unlisted_attention(module: nn.Module) -> AttnscopeError:
    """The refusal for an attention call, during a capture, from a module that is no site: the record
    would silently miss that attention."""
    return AttnscopeError(
        f"model type {model_type_of(module)!r}: a {type(module).__name__} module computed attention, but attnscope's "
        f"adapter did not find it among the model's attention modules, so the record would miss it; the type "
        f"needs an adapter row that names it ({HOW_TO_ADD})")


def _site(model: nn.Module, name: str, module: nn.Module, rule: SiteRule, layer: int) -> AttentionSite:
    """The site of ``module`` (matched by ``rule`` as ``layer``): causality from its ``is_causal`` when it has one."""
    own = getattr(module, "is_causal", None)
    causal = own if isinstance(own, bool) else rule.causal
    known = causal is not None
    if causal is None:  # the mask of each call must then settle it (see unknown_causality)
        causal = rule.kind == "decoder" or (rule.kind == "self" and _is_causal_lm(model))
    out_proj = next((found for path in rule.out_proj.split("|")
                     if (found := resolve_relative(model, name, path)) is not None), None)
    window, chunked = layer_window(module, rule.window)
    return AttentionSite(rule.kind, layer, name, causal, out_proj, rule.conv1d, window=window, chunked=chunked,
                         causal_known=known, learned_sinks=_has_sinks(module))


def layer_window(module: nn.Module, attribute: str) -> tuple[int, bool]:
    """``(window, chunked)``: the keys a call of ``module`` sees (0 = every key): its own ``attribute`` where it has
    one (None on a layer that sees every key); else, where ``attribute`` names a window at all, what its config says:
    the chunk of a layer it names ``chunked_attention`` (Llama 4), or the sliding window of every layer (the
    Mistral-like types pass ``config.sliding_window`` to the attention function, PhiMoE and Doge build it into
    every layer's mask: :func:`_slides_every_layer`)."""
    if not attribute:
        return 0, False
    if hasattr(module, attribute):
        return _keys(getattr(module, attribute)), False
    config = getattr(module, "config", None)
    layer_types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    if isinstance(layer_types, list | tuple) and isinstance(index, int) and 0 <= index < len(layer_types) \
            and layer_types[index] == "chunked_attention":
        return _keys(getattr(config, "attention_chunk_size", None)), True
    return (_keys(getattr(config, attribute, None)) if _slides_every_layer(type(module).__module__) else 0), False


@functools.cache
def _slides_every_layer(modeling: str) -> bool:
    """Whether the modeling module ``modeling`` masks every layer by its config's sliding window (transformers'
    Mistral-like models: ``create_causal_mask if config.sliding_window is None else
    create_sliding_window_causal_mask``), rather than per layer type or not at all (Qwen2-MoE, Qwen3-VL-MoE: their
    configs carry a window the full layers ignore)."""
    module = sys.modules.get(modeling)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return False
    return re.search(r"create_causal_mask if (?:self\.)?config\.sliding_window is None\s+else "
                     r"create_sliding_window_causal_mask", source) is not None


def _keys(window: object) -> int:
    """A window attribute's value in keys: 0 where it names none (None, or not a number of keys)."""
    return int(window) if isinstance(window, int) and not isinstance(window, bool) and window > 0 else 0


def _has_sinks(module: nn.Module) -> bool:
    """Whether ``module``'s softmax has a sink logit: learned per head (gpt-oss's ``sinks`` parameter) or computed
    per query from its input (Inkling 2's ``sink_proj``)."""
    return isinstance(getattr(module, "sinks", None), nn.Parameter) or isinstance(getattr(module, "sink_proj", None),
                                                                                  nn.Module)


def _is_causal_lm(model: nn.Module) -> bool:
    return any(word in type(model).__name__ for word in ("CausalLM", "LMHead"))


def unknown_causality(module: nn.Module) -> AttnscopeError:
    """The refusal for a call without a mask at a module that does not say whether it is causal."""
    return AttnscopeError(
        f"model type {model_type_of(module)!r}: its {type(module).__name__} modules do not say whether they are "
        f"causal (no is_causal attribute) and the model gave one of them no mask, so attnscope cannot tell which keys "
        f"each query sees; the type needs an adapter row that says ({HOW_TO_ADD})")


def misstated_window(module: nn.Module, site: AttentionSite, kwargs: Mapping[str, Any]) -> AttnscopeError | None:
    """The refusal for a call that passes the attention function a sliding window (``sliding_window``, what flash
    kernels slide by) other than the one its site states, which records and views would then misstate; None
    where the call passes none or the same."""
    if "sliding_window" not in kwargs or site.chunked:
        return None
    used = _keys(kwargs["sliding_window"])
    if used == site.window:
        return None
    return AttnscopeError(
        f"model type {model_type_of(module)!r}: {site.name}'s attention call slides over a window of {used or 'all'} "
        f"keys, but attnscope read {site.window or 'none'} from the module, so its record would state the wrong "
        f"window; the type needs an adapter row that names its window ({HOW_TO_ADD})")


def selected_key_blocks(module: nn.Module) -> AttnscopeError:
    """The refusal for a call that attends to the key blocks a sparse-attention indexer selected (``block_indices``):
    the attention function cannot apply a selection whose block size the call does not carry."""
    return AttnscopeError(
        f"model type {model_type_of(module)!r}: its {type(module).__name__} modules attend to blocks of keys their "
        f"indexer selects, which transformers hands only its eager and SDPA attention as a mask; attnscope's attention "
        f"would see every key, so the type needs an adapter or a bridge for it ({HOW_TO_ADD})")


def find_modules(model: nn.Module, rules: tuple[ModuleRule, ...]) -> dict[tuple[str, int], nn.Module]:
    """``(kind, layer) -> module`` for every module matched by ``rules`` (first rule wins)."""
    found: dict[tuple[str, int], nn.Module] = {}
    for name, module in model.named_modules():
        for rule in rules:
            match = re.search(rule.pattern, name)
            if match:
                found.setdefault((rule.kind, int(match.group(1))), module)
                break
    return found
