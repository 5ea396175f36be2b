"""Per-architecture facts as data: which modules compute attention, of what kind, and where
their output projection lives.

One :class:`Adapter` per family of Hugging Face model types. A :class:`SiteRule` matches the
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
  itself and the ``window - 1`` keys before it; None or absent on a layer that sees every key),
  e.g. Gemma 3 slides on 5 of every 6 layers. transformers builds the window into the mask the
  attention function receives; the site only carries the fact, for records and views.

Adding an architecture is adding a row here, nothing else. A model type not in the table is read
from the model itself (:data:`GENERIC_DECODER`, :data:`GENERIC_ENCODER_DECODER`): its attention
modules where transformers' Llama-like and BART-like models keep them, each module's causality from
its ``is_causal`` (or, where it has none, from the mask of each call); whatever cannot be read with
certainty is refused (:func:`find_sites`, and at capture time: every attention call must come from a
site, once per forward pass, with a mask where the module does not say whether it is causal).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

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
    site is refused."""

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

    @property
    def generic(self) -> bool:
        """True for the adapters of model types not in the table (their sites are read from the model)."""
        return not self.model_types


@dataclass(frozen=True, eq=False)
class AttentionSite:
    """One attention module of a loaded model: the place the capture function records from.

    ``out_proj`` is the module whose weight maps the concatenated heads back to the residual
    stream (``[d_model, n_heads * d_head]`` for ``nn.Linear``). ``window``: the sliding window in
    keys (query ``q`` sees keys ``q - window + 1 .. q``), 0 when the layer sees every key.
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
    causal_known: bool = True
    learned_sinks: bool = False  # its softmax has one learned sink logit per head (gpt-oss's ``sinks``)


_LLAMA_LIKE = (SiteRule("self", r"layers\.(\d+)\.self_attn$", "o_proj", causal=True, window="sliding_window"),)
_LLAMA_BLOCKS = (ModuleRule("self", r"layers\.(\d+)$"),)
_LLAMA_FFN = (ModuleRule("self", r"layers\.(\d+)\.mlp$"),)
_LLAMA_FINAL = (r"^(?:model\.)?norm$", r"^lm_head$")
_LLAMA_UNEMBEDDING = Unembedding(r"^(?:model\.)?norm$")
_POST_NORM_UNEMBEDDING = Unembedding(r"^(?:model\.)?norm$", r"layers\.(\d+)\.post_attention_layernorm$",
                                     r"layers\.(\d+)\.post_feedforward_layernorm$")
_LLAMA_PROJECTIONS = HeadProjections("q_proj", "k_proj", "v_proj", group_size=("num_key_value_groups",))
_BART_POST_LN = LayerNorms((ModuleRule("encoder", r"encoder\.layers\.(\d+)\.self_attn_layer_norm$"),),
                           (ModuleRule("encoder", r"encoder\.layers\.(\d+)\.final_layer_norm$"),))
_BART_LIKE = (
    SiteRule("encoder", r"encoder\.layers\.(\d+)\.self_attn$", "out_proj"),
    SiteRule("decoder", r"decoder\.layers\.(\d+)\.self_attn$", "out_proj", causal=True),
    SiteRule("cross", r"decoder\.layers\.(\d+)\.encoder_attn$", "out_proj"),
)

_BART_BLOCKS = (ModuleRule("encoder", r"encoder\.layers\.(\d+)$"), ModuleRule("decoder", r"decoder\.layers\.(\d+)$"))
_BART_FFN = (ModuleRule("encoder", r"encoder\.layers\.(\d+)\.fc2$"), ModuleRule("decoder", r"decoder\.layers\.(\d+)\.fc2$"))

_T5_SITES = (
    SiteRule("encoder", r"encoder\.block\.(\d+)\.layer\.0\.SelfAttention$", "o"),
    SiteRule("decoder", r"decoder\.block\.(\d+)\.layer\.0\.SelfAttention$", "o", causal=True),
    SiteRule("cross", r"decoder\.block\.(\d+)\.layer\.1\.EncDecAttention$", "o"),
)


def _llama_row(name: str, model_types: tuple[str, ...], unembedding: Unembedding) -> Adapter:
    """A row of the Llama family: Llama's modules, pre-norm, whole-model pruning; ``unembedding`` says how
    its sublayers reach the logits."""
    return Adapter(name, model_types, _LLAMA_LIKE, blocks=_LLAMA_BLOCKS, ffn=_LLAMA_FFN, final=_LLAMA_FINAL,
                   projections=_LLAMA_PROJECTIONS, norms=PRE_LN, unembedding=unembedding)

def _softmax_layers_row(family: str, model_type: str, attention_class: str, linear: str, out_proj: str = "o_proj",
                        sparse: str = "") -> Adapter:
    """A hybrid whose layers' ``self_attn`` is softmax attention (``attention_class``) on some layers and
    ``linear`` attention, which has no weights, on the others: the row names the softmax class."""
    rule = SiteRule("self", r"layers\.(\d+)\.self_attn$", out_proj, causal=True, window="sliding_window",
                    classes=(attention_class,))
    return Adapter(family, (model_type,), (rule,), note=f"its softmax attention layers{sparse}; its other layers' "
                   f"self_attn is {linear} attention, which has no attention weights")


ADAPTERS: tuple[Adapter, ...] = (
    Adapter(
        "bert",
        ("bert", "roberta", "xlm-roberta", "electra", "camembert", "data2vec-text", "ernie"),
        (SiteRule("self", r"layer\.(\d+)\.attention\.self$", "../output.dense"),),
        blocks=(ModuleRule("self", r"encoder\.layer\.(\d+)$"),),
        ffn=(ModuleRule("self", r"layer\.(\d+)\.output\.dense$"),),
        final=(),  # AutoModel: last_hidden_state is the last layer's output
        projections=HeadProjections("query", "key", "value", head_count=("num_attention_heads",),
                                    width=("all_head_size",)),
        norms=LayerNorms((ModuleRule("self", r"layer\.(\d+)\.attention\.output\.LayerNorm$"),),
                         (ModuleRule("self", r"layer\.(\d+)\.output\.LayerNorm$"),)),
    ),
    Adapter(  # BERT's attention modules, computed through AttentionInterface, around other layer layouts
        "bert-like",
        ("bert-generation", "esm", "markuplm", "mobilebert", "roberta-prelayernorm", "roc_bert", "splinter",
         "xlm-roberta-xl", "xmod", "megatron-bert", "rembert", "tapas", "visual_bert", "roformer", "luke", "ibert"),
        (SiteRule("self", r"encoder\.layer\.(\d+)\.attention\.self$", "../output.dense"),),
        note="BERT's attention modules; their layers normalise (pre-LN, a bottleneck) unlike BERT's, so running "
        "from a middle layer onwards, pruning and the whole-layer measures are off; Megatron-BERT, RemBERT, TAPAS, "
        "VisualBERT, RoFormer, LUKE and I-BERT compute attention itself: attnscope bridges it (see attnscope.capture.bridges)",
    ),
    Adapter("longformer", ("longformer",), (SiteRule("self", r"encoder\.layer\.(\d+)\.attention\.self$",
                                                     "../output.dense"),),
            note="local attention: each query sees the keys within half its attention_window on either side (the "
            "record holds zeros outside that band); global attention is refused; Longformer computes attention "
            "itself: attnscope bridges it (see attnscope.capture.bridges)"),
    # no out_proj: the output projection also takes what is not attention (ConvBERT's convolution heads,
    # Nyströmformer's convolution of the values), so a head's vector in the residual stream is not α f(x)
    Adapter("convbert", ("convbert",), (SiteRule("self", r"encoder\.layer\.(\d+)\.attention\.self$", ""),),
            note="mixed attention: half of each layer's heads are self-attention (captured), the other half span-based "
            "convolutions over each token's neighbours (no attention over the sequence); ConvBERT computes "
            "attention itself: attnscope bridges it (see attnscope.capture.bridges)"),
    Adapter("nystromformer", ("nystromformer",),
            (SiteRule("self", r"encoder\.layer\.(\d+)\.attention\.self$", ""),),
            note="exact softmax attention where it has as many landmarks as positions (its Nyström approximation "
            "is refused), plus a convolution of the values over positions; attnscope bridges it (see "
            "attnscope.capture.bridges)"),
    Adapter(
        "distilbert",
        ("distilbert",),
        (SiteRule("self", r"layer\.(\d+)\.attention$", "out_lin"),),
        blocks=(ModuleRule("self", r"transformer\.layer\.(\d+)$"),),
        ffn=(ModuleRule("self", r"layer\.(\d+)\.ffn$"),),
        final=(),
        norms=LayerNorms((ModuleRule("self", r"layer\.(\d+)\.sa_layer_norm$"),),
                         (ModuleRule("self", r"layer\.(\d+)\.output_layer_norm$"),)),
    ),
    Adapter(
        "mpnet",
        ("mpnet",),
        (SiteRule("self", r"layer\.(\d+)\.attention\.attn$", "o"),),
        blocks=(ModuleRule("self", r"encoder\.layer\.(\d+)$"),),
        ffn=(ModuleRule("self", r"layer\.(\d+)\.output\.dense$"),),
        note="MPNet computes attention itself; attnscope routes it through the capture function "
        "with a bridge module (see attnscope.capture.bridges).",
        final=(),
        norms=LayerNorms((ModuleRule("self", r"layer\.(\d+)\.attention\.LayerNorm$"),),
                         (ModuleRule("self", r"layer\.(\d+)\.output\.LayerNorm$"),)),
    ),
    Adapter("gpt2", ("gpt2",), (SiteRule("self", r"(?:^|\.)h\.(\d+)\.attn$", "c_proj", causal=True, conv1d=True),),
            blocks=(ModuleRule("self", r"(?:^|\.)h\.(\d+)$"),), ffn=(ModuleRule("self", r"(?:^|\.)h\.(\d+)\.mlp$"),),
            final=(r"^(?:transformer\.)?ln_f$", r"^lm_head$"), norms=PRE_LN,
            unembedding=Unembedding(r"^(?:transformer\.)?ln_f$")),
    Adapter("gptj", ("gptj", "codegen"), (SiteRule("self", r"(?:^|\.)h\.(\d+)\.attn$", "out_proj", causal=True),),
            blocks=(ModuleRule("self", r"(?:^|\.)h\.(\d+)$"),), ffn=(ModuleRule("self", r"(?:^|\.)h\.(\d+)\.mlp$"),),
            note="attention and feed-forward read the same normalised input, side by side"),
    Adapter("gpt-bigcode", ("gpt_bigcode",),
            (SiteRule("self", r"(?:^|\.)h\.(\d+)\.attn$", "c_proj", causal=True),),  # nn.Linear, unlike GPT-2
            blocks=(ModuleRule("self", r"(?:^|\.)h\.(\d+)$"),), ffn=(ModuleRule("self", r"(?:^|\.)h\.(\d+)\.mlp$"),),
            note="multi-query attention: one key/value head shared by every query head"),
    Adapter("bloom", ("bloom",), (SiteRule("self", r"(?:^|\.)h\.(\d+)\.self_attention$", "dense", causal=True),),
            blocks=(ModuleRule("self", r"(?:^|\.)h\.(\d+)$"),), ffn=(ModuleRule("self", r"(?:^|\.)h\.(\d+)\.mlp$"),),
            note="ALiBi: a per-head linear bias by distance instead of position embeddings; BLOOM computes attention "
            "itself, attnscope routes it through the capture function with a bridge (see attnscope.capture.bridges)"),
    Adapter("falcon", ("falcon",), (SiteRule("self", r"(?:^|\.)h\.(\d+)\.self_attention$", "dense", causal=True),),
            blocks=(ModuleRule("self", r"(?:^|\.)h\.(\d+)$"),), ffn=(ModuleRule("self", r"(?:^|\.)h\.(\d+)\.mlp$"),),
            note="Falcon computes attention itself and picks its attention class by name: attnscope loads it with "
            "eager attention and routes it through the capture function with a bridge (see attnscope.capture.bridges)"),
    Adapter("gpt-neo", ("gpt_neo",),
            (SiteRule("self", r"(?:^|\.)h\.(\d+)\.attn\.attention$", "out_proj", causal=True, window="sliding_window"),),
            blocks=(ModuleRule("self", r"(?:^|\.)h\.(\d+)$"),), ffn=(ModuleRule("self", r"(?:^|\.)h\.(\d+)\.mlp$"),),
            note="global and local (sliding-window) layers alternate; unscaled scores; GPT-Neo computes attention "
            "itself: attnscope loads it with eager attention and bridges it (see attnscope.capture.bridges)"),
    Adapter("albert", ("albert",), (SiteRule("self", r"encoder\.attention_runs\.(\d+)$", "dense"),),
            note="ALBERT shares weights across layers, running one attention module several times: each run is "
            "its own layer of the record (the i-th attention to run, as transformers' output_attentions lists "
            "them), through a bridge (see attnscope.capture.bridges)"),
    Adapter("deberta", ("deberta", "deberta-v2"), (SiteRule("self", r"encoder\.layer\.(\d+)\.attention\.self$", "../output.dense"),),
            note="disentangled attention: each weight is the softmax of content-to-content plus relative-position "
            "terms (content-to-position, position-to-content), as DeBERTa mixes its values; DeBERTa computes it "
            "itself: attnscope bridges it (see attnscope.capture.bridges)"),
    Adapter("xlm", ("xlm", "flaubert"), (SiteRule("self", r"(?:^|\.)attentions\.(\d+)$", "out_lin", causal=None),),
            note="XLM and FlauBERT compute attention themselves: attnscope bridges it (see attnscope.capture.bridges)"),
    Adapter("openai-gpt", ("openai-gpt",),
            (SiteRule("self", r"(?:^|\.)h\.(\d+)\.attn$", "c_proj", causal=True, conv1d=True),),
            note="GPT-1 computes attention itself: attnscope bridges it (see attnscope.capture.bridges)"),
    Adapter("mpt", ("mpt",), (SiteRule("self", r"blocks\.(\d+)\.attn$", "out_proj", causal=True),),
            note="ALiBi: a per-head linear bias by distance; MPT computes attention itself: attnscope bridges it "
            "(see attnscope.capture.bridges)"),
    Adapter("dbrx", ("dbrx",), (SiteRule("self", r"blocks\.(\d+)\.norm_attn_norm\.attn$", "out_proj", causal=True),)),
    Adapter("reformer", ("reformer",),
            (SiteRule("self", r"layers\.(\d+)\.attention\.self_attention$", "../output.dense", causal=None),),
            note="LSH and local attention over inputs no longer than a chunk (where both attend over the whole "
            "sequence; an LSH query sees itself only where it sees nothing else); longer inputs, hashed into "
            "buckets or chunks, are refused; Reformer computes attention itself: attnscope bridges it (see "
            "attnscope.capture.bridges)"),
    # no out_proj: XLNet's output projection is a parameter (``o``, [d_model, head, d_head]), not a module
    Adapter("xlnet", ("xlnet",), (SiteRule("self", r"layer\.(\d+)\.rel_attn$", "", causal=None),),
            note="relative attention: each weight is the softmax of content plus relative-position and segment "
            "terms; XLNet computes it itself: attnscope bridges it (see attnscope.capture.bridges); its two-stream "
            "pretraining mode (target_mapping) runs attention twice per layer and is refused"),
    Adapter("ctrl", ("ctrl",), (SiteRule("self", r"(?:^|\.)h\.(\d+)\.multi_head_attention$", "dense", causal=True),),
            blocks=(ModuleRule("self", r"(?:^|\.)h\.(\d+)$"),)),
    Adapter("gpt-neox", ("gpt_neox",), (SiteRule("self", r"layers\.(\d+)\.attention$", "dense", causal=True),),
            blocks=(ModuleRule("self", r"layers\.(\d+)$"),), ffn=(ModuleRule("self", r"layers\.(\d+)\.mlp$"),)),
    # hybrids: attention on some layers, a recurrent block or Mamba mixer at the same place on the others
    Adapter("recurrent-gemma", ("recurrent_gemma",),
            (SiteRule("self", r"layers\.(\d+)\.temporal_block$", "o_proj", causal=True, window="sliding_window",
                      classes=("RecurrentGemmaAttention",)),),
            note="its attention layers slide over a window; its other layers are recurrent (no attention weights)"),
    Adapter("nemotron-h", ("nemotron_h",),
            (SiteRule("self", r"layers\.(\d+)\.mixer$", "o_proj", causal=True, classes=("NemotronHAttention",)),),
            note="its attention layers; its other layers are Mamba mixers and feed-forward blocks (no attention)"),
    # no out_proj: the heads' outputs are combined in pairs (out_h - λ out_h+heads/2) and normalised before o_proj,
    # so no per-head vector reaches the residual stream (the measures that need one are unavailable)
    Adapter("diffllama", ("diffllama",), (SiteRule("self", r"layers\.(\d+)\.self_attn$", "", causal=True),),
            note="differential attention: head h and head h + heads/2 are the two softmaxes of one differential "
            "head (its output is out_h - λ out_h+heads/2); the record holds each softmax as its own head, as "
            "transformers' output_attentions does; DiffLlama calls attention twice per layer (same queries and keys, "
            "two halves of the values): attnscope's bridge calls it once with both halves"),
    _softmax_layers_row("kimi-linear", "kimi_linear", "KimiLinearAttention", "linear (delta-rule)"),
    _softmax_layers_row("minimax", "minimax", "MiniMaxAttention", "lightning (linear)"),
    Adapter("zamba", ("zamba", "zamba2"),
            (SiteRule("self", r"layers\.(\d+)\.shared_transf(?:ormer)?\.self_attn$", "o_proj", causal=True),),
            note="its hybrid layers' attention (a shared transformer block: one set of weights, or Zamba2's few "
            "with per-layer adapters, each layer its own module); its other layers are Mamba mixers (no attention)"),
    # no out_proj: its attention multiplies its output by a gate (gate_proj) before o_proj, and every run of a
    # layer shares that o_proj (the measures that need a head's vector are unavailable)
    Adapter("hrm", ("hrm_text",), (SiteRule("self", r"attention_runs\.(\d+)$", "", causal=True),),
            note="two stacks of layers run in cycles: each run of a layer is its own layer of the record, in the "
            "order transformers' output_attentions lists them; HRM computes the attention of each run as its own "
            "site through a bridge (see attnscope.capture.bridges)"),
    Adapter("longcat-flash", ("longcat_flash",),
            (SiteRule("self", r"layers\.\d+\.self_attn\.\d+$", "o_proj", causal=True, layer_attribute="layer_idx"),),
            note="two attention modules per block: layer 2 i + j of the record is block i's module j, as "
            "transformers' output_attentions lists them"),
    Adapter("inkling2", ("inkling2_text", "inkling2_loop_text"), _LLAMA_LIKE,
            not_tokens=("Inkling2BlockAttentionResidual", "Inkling2LoopBlockAttentionResidual",
                        "Inkling2LoopMessageAttentionResidual"),
            note="its layers' self-attention; the attention that mixes each layer's input from earlier blocks' "
            "outputs (attention over depth, not tokens) is computed and not recorded"),
    _softmax_layers_row("glm5-next", "glm5_next_text", "Glm5NextTextAttention", "linear",
                        sparse=" (sparse: each query attends to the keys its indexer picks)"),
    # no out_proj: its softmax layers multiply their output by a gate (g_proj) before o_proj, so a head's vector in
    # the residual stream is not α f(x) (the measures that need it are unavailable)
    _softmax_layers_row("bailing-hybrid", "bailing_hybrid", "BailingHybridAttention", "linear (delta-rule)", out_proj=""),
    Adapter("opt", ("opt",), (SiteRule("self", r"layers\.(\d+)\.self_attn$", "out_proj", causal=True),),
            blocks=(ModuleRule("self", r"layers\.(\d+)$"),), ffn=(ModuleRule("self", r"layers\.(\d+)\.fc2$"),)),
    _llama_row("llama", ("llama", "mistral", "qwen2", "qwen3", "gemma", "olmo", "granite", "phi3", "smollm3"),
               _LLAMA_UNEMBEDDING),
    # Llama's modules, but a norm on each sublayer's output before the residual (the logits see it)
    _llama_row("gemma2", ("gemma2", "olmo2"), _POST_NORM_UNEMBEDDING),
    Adapter(
        "gemma3",
        ("gemma3_text",),
        _LLAMA_LIKE,
        blocks=_LLAMA_BLOCKS,
        ffn=_LLAMA_FFN,  # its post-feed-forward RMSNorm maps a zeroed MLP output to zero
        note="sliding-window layers (5 of every 6 in Gemma 3 270M) mixed with global ones; running from a "
        "middle layer onwards is off (its layers take per-layer-type rotary embeddings)",
        unembedding=_POST_NORM_UNEMBEDDING,
    ),
    Adapter(
        "bart",
        ("bart", "marian", "blenderbot-small"),
        _BART_LIKE,
        blocks=_BART_BLOCKS,
        ffn=_BART_FFN,
        norms=_BART_POST_LN,
    ),
    Adapter(  # the same modules as BART, but each normalises before its sublayer
        "mbart",
        ("mbart", "pegasus", "m2m_100", "blenderbot"),
        _BART_LIKE,
        blocks=_BART_BLOCKS,
        ffn=_BART_FFN,
        norms=PRE_LN,
    ),
    Adapter("led", ("led",),
            (SiteRule("encoder", r"encoder\.layers\.(\d+)\.self_attn\.longformer_self_attn$", "../output"),
             *_BART_LIKE[1:]),
            note="its encoder attends locally: each query sees the keys within half its attention_window on either "
            "side (the record holds zeros outside that band); global attention is refused; LED computes its "
            "encoder's attention itself: attnscope bridges it (see attnscope.capture.bridges)"),
    Adapter("prophetnet", ("prophetnet",),
            (*_BART_LIKE[:2], SiteRule("cross", r"decoder\.layers\.(\d+)\.cross_attn$", "out_proj")),
            note="its decoder's self-attention is the main stream of its n-gram attention (as transformers' "
            "decoder_attentions), its cross-attention the main stream's rows; the predicting streams' weights are "
            "not recorded; ProphetNet computes attention itself: attnscope bridges it (see attnscope.capture.bridges)"),
    Adapter(
        "t5",
        ("t5", "mt5", "umt5"),
        _T5_SITES,
        blocks=(ModuleRule("encoder", r"encoder\.block\.(\d+)$"), ModuleRule("decoder", r"decoder\.block\.(\d+)$")),
        ffn=(ModuleRule("encoder", r"encoder\.block\.(\d+)\.layer\.1\.DenseReluDense$"),
             ModuleRule("decoder", r"decoder\.block\.(\d+)\.layer\.2\.DenseReluDense$")),
    ),
    Adapter("longt5", ("longt5",),
            (SiteRule("encoder", r"encoder\.block\.(\d+)\.layer\.0\.LocalSelfAttention$", "o"), *_T5_SITES[1:]),
            note="its encoder attends locally: each query sees the keys less than local_radius + 1 away (the record "
            "holds zeros outside that band); transient-global attention is refused; LongT5 computes its encoder's "
            "attention itself: attnscope bridges it (see attnscope.capture.bridges)"),
    # T5's attention modules; some feed-forward layers are mixtures of experts (no DenseReluDense)
    Adapter("switch-transformers", ("switch_transformers",), _T5_SITES),
)

_GENERIC_NOTE = ("model type not in the table: its attention modules and their causality are read from the model; "
                 "running from a middle layer onwards and the whole-layer measures are off")
GENERIC_DECODER = Adapter(
    "generic (read from the model)", (),
    (SiteRule("self", r"layers\.(\d+)\.(?:self_attn|self_attention|attn|attention)$", "o_proj|out_proj|dense",
              causal=None, window="sliding_window"),),
    _LLAMA_BLOCKS, _LLAMA_FFN, note=_GENERIC_NOTE, unembedding=_LLAMA_UNEMBEDDING,
)
GENERIC_ENCODER_DECODER = Adapter(
    "generic encoder-decoder (read from the model)", (),
    (
        SiteRule("encoder", r"encoder\.layers\.(\d+)\.self_attn$", "o_proj|out_proj", causal=None,
                 window="sliding_window"),
        SiteRule("decoder", r"decoder\.layers\.(\d+)\.self_attn$", "o_proj|out_proj", causal=None,
                 window="sliding_window"),
        SiteRule("cross", r"decoder\.layers\.(\d+)\.(?:encoder_attn|cross_attn|cross_attention)$",
                 "o_proj|out_proj", causal=None),
    ),
    _BART_BLOCKS, note=_GENERIC_NOTE,
)


def adapter_for(model_type: str, is_encoder_decoder: bool = False) -> Adapter:
    """The adapter of ``model_type``; a type not in the table is read from the model
    (:data:`GENERIC_ENCODER_DECODER` or :data:`GENERIC_DECODER`)."""
    for adapter in ADAPTERS:
        if model_type in adapter.model_types:
            return adapter
    return GENERIC_ENCODER_DECODER if is_encoder_decoder else GENERIC_DECODER


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
    window = getattr(module, rule.window, None) if rule.window else None
    return AttentionSite(rule.kind, layer, name, causal, out_proj, rule.conv1d,
                         window=int(window) if isinstance(window, int) else 0, causal_known=known,
                         learned_sinks=_has_sinks(module))


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
