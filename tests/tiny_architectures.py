"""Any text model type of transformers as a tiny random model, and its captured attention against eager.

:func:`check_type` builds a tiny random model of one ``model_type`` from its config class (hidden 64, 2
layers, 4 heads), adds seeded noise to every weight so that attention is far from uniform, saves it with
a WordPiece tokenizer into a folder, loads that folder with ``attnscope.load_model`` as a user would,
captures one input with ``extract`` and compares every attention kind (self, encoder, decoder, cross)
with the same folder loaded with ``attn_implementation="eager"`` and ``output_attentions=True``.

Used by ``tests/test_architectures.py`` (a representative subset) and ``benchmarks/architectures.py``
(every text model type of the installed transformers, each in its own process).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

TEXT = "The quick brown fox jumps over the lazy dog near the river bank."
TARGET = "Der schnelle braune Fuchs springt."
TOLERANCE = 1e-5  # equal: the largest absolute difference of any attention weight is at most this
NOISE = 0.1  # std of the seeded noise added to every weight (random init alone gives near-uniform attention)
VOCAB = 30522  # the WordPiece tokenizer's vocabulary (the default model's)

# config attribute -> tiny value, set where the config class has the attribute
TINY_SIZES: dict[str, Any] = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "n_embed", "dim", "embed_dim", "model_dim"), 64),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
                     "num_decoder_layers", "num_encoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "num_decoder_attention_heads"), 4),
    "num_key_value_heads": 2,
    # sliding-window layers' own head counts (Inkling: as many query heads as its full layers)
    "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16,
    **dict.fromkeys(("intermediate_size", "ffn_dim", "d_ff", "encoder_ffn_dim", "decoder_ffn_dim", "n_inner",
                     "hidden_dim"), 128),
    **dict.fromkeys(("head_dim", "d_kv", "attention_head_dim", "v_head_dim"), 16),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim", "rotary_dim"), 8),  # MLA's and GPT-J's partial rotary
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 16),
    "num_random_blocks": 1,  # BigBird: with blocks of 2 keys, block-sparse from 15 tokens on (WINDOWS)
    "num_kv_shared_layers": 0,  # two layers cannot both produce and reuse another's keys (Gemma 3n, Gemma 4)
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k"), 2),
    **dict.fromkeys(("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size"), 32),
    **dict.fromkeys(("vocab_size", "decoder_vocab_size"), VOCAB),
    **dict.fromkeys(("pad_token_id", "decoder_start_token_id"), 0),  # inside the tiny vocabulary (Marian's: 58100)
    "bos_token_id": 101,
    "eos_token_id": 102,
}
SLIDING_WINDOW = 4  # keys: shorter than the input (16 tokens; the decoder's: 12), so windowed layers really slide

# every config attribute that bounds the keys a query sees (a window, a chunk, a band, a block, a budget of keys) ->
# a tiny value, set where a config or a part of it has the attribute whatever its default (None included), so that
# each type's windows are shorter than its input and a type whose window attnscope ignored could not pass
WINDOWS: dict[str, int] = {
    # each query sees itself and the keys before it (and after, in a bidirectional model), 4 in all
    **dict.fromkeys(("sliding_window", "sliding_window_size", "attention_window_size", "window_size",
                     "local_attention_window_len"), SLIDING_WINDOW),
    **dict.fromkeys(("attention_window", "local_attention"), SLIDING_WINDOW),  # Longformer, ModernBERT: 2 each side
    "local_radius": 2,  # LongT5: blocks of 3 tokens, each seeing its own and its neighbours' (2 either side)
    "attention_chunk_size": SLIDING_WINDOW,  # Llama 4's chunked layers: each query sees its chunk's keys
    "keep_window_size": SLIDING_WINDOW,  # Doge: the keys its dynamic mask keeps
    "index_topk": SLIDING_WINDOW,  # DeepSeek sparse attention: the keys its indexer selects per query
    "index_kpool": 2,  # GLM-5 Next's indexer selects pools of keys (its top 4 keys: 2 pools of 2)
    # MiniMax M3's indexer: the top block of 2 keys (beside the block before the query)
    "index_block_size": 2, "index_topk_blocks": 1,
    **dict.fromkeys(("local_attn_chunk_length", "lsh_attn_chunk_length"), SLIDING_WINDOW),  # Reformer's chunks
    # BigBird's and PEGASUS-X's blocks of keys (BigBird attends block-sparsely only over more than 5 + 2 x its
    # random blocks: 14 tokens here; MiniMax's lightning-attention blocks only split a computation)
    "block_size": 2,
}
# switches without which a config holds no window (Qwen2's sliding_window is None unless this is set)
WINDOW_SWITCHES: dict[str, Any] = {"use_sliding_window": True}
# names that look like windows (:data:`WINDOW_LIKE`) but bound no query's keys, each with why
NOT_WINDOWS: dict[str, str] = {
    **dict.fromkeys(("chunk_size_feed_forward", "chunk_size_lm_head"), "a computation split in chunks (same result)"),
    **dict.fromkeys(("chunk_size", "mamba_chunk_size", "max_inference_chunksize", "chunkwise_kernel"),
                    "a state-space or recurrent scan's chunks (no attention weights)"),
    **dict.fromkeys(("max_window_layers", "sliding_window_pattern", "_sliding_window_pattern",
                     "prefix_dense_sliding_window_pattern", "local_layer_ids", "mtp_local_layer_ids"),
                    "which layers slide (the tiny layer types choose)"),
    **dict.fromkeys(("local_num_chunks_before", "local_num_chunks_after", "lsh_num_chunks_before",
                     "lsh_num_chunks_after", "index_local_blocks"),
                    "neighbouring chunks or blocks seen, counted in chunks or blocks (their lengths are windows)"),
    "global_block_size": "LongT5's transient-global summaries (its local attention has none)",
    "stagger_local_blocks": "PEGASUS-X: whether its blocks alternate offsets (their size is a window)",
    "block_sizes": "Funnel: layers per block",
    "conv_window": "YOSO's convolution over values (no attention weights)",
    **dict.fromkeys(("num_local_experts", "moe_topk", "norm_topk_prob", "topk_group", "topk_method"),
                    "experts routed per token"),
    "local_attention_probs_dropout_prob": "dropout",
}
WINDOW_LIKE = r"window|chunk|local|radius|band|block_size|topk"  # attribute names checked against the tables above

# model types whose config needs more than the sizes above to build a small model
SPECIAL: dict[str, dict[str, Any]] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},  # one of each
    "esmc": {"num_key_value_heads": 4},  # no grouped-query attention
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},  # its second layer attends (the default: 1 in 8)
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},  # the default: all Mamba
    **{t: {"global_head_dim": 32} for t in ("gemma4_text", "gemma4_unified_text")},  # its global layers: 512
    # its decoder starts from eos, as released FSMT models do: from the pad token, eager's default decoder mask
    # (padding by token id) would hide the start token that attnscope's explicit decoder mask keeps
    "fsmt": {"decoder_start_token_id": 102},
    "zaya": {"num_experts_per_tok": 1,  # the only value it supports
             "layer_types": ["hybrid", "hybrid_sliding"]},  # one of each (its default does not slide)
    "minimax_m3_vl_text": {"layer_types": ["full_attention", "minimax_m3_sparse"]},  # its default has no sparse layer
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},  # its default names none
    "dots1": {"n_shared_experts": 1},  # its default (None) does not build
    "xmod": {"default_language": "en_XX"},  # its adapters are per language: without one it refuses to run
    "squeezebert": {"embedding_size": 64},  # its embeddings must be as wide as its layers
    # its LM head model is a decoder; its axial position embeddings' widths add up to its hidden size
    "reformer": {"is_decoder": True, "axial_pos_embds_dim": [32, 32]},
    # the size of its output layer (checkpoints pad the embeddings beyond it): the tiny vocabulary
    **{t: {"unpadded_vocab_size": VOCAB} for t in ("inkling2_text", "inkling2_loop_text")},
    # DBRX's attention reads its rope_theta from attn_config, as released configs carry it (the class has no default),
    # (and clips q/k/v: its clamp needs a bound)
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
    # rope parameters per layer type, as released configs carry them (its default names none)
    "cohere_compass_text": {"rope_parameters": {kind: {"rope_type": "default", "rope_theta": 10000.0}
                                                for kind in ("full_attention", "sliding_attention")}},
    # its hybrid layers share one attention block: with a single one transformers cannot tie it to the others
    "zamba": {"layer_types": ["hybrid", "hybrid"]},
    "zamba2": {"layer_types": ["hybrid", "hybrid"], "hybrid_layer_ids": [0, 1]},  # (not derived when set so)
    "axk1": {"n_group": 1, "topk_group": 1},  # its default routes over 8 groups of experts (the tiny model has 4)
    "mamba2": {"num_heads": 8},  # its heads times their size must be hidden_size * expand (128)
    "glm5_next_text": {"qk_rope_head_dim": 0},  # its sparse (DSA) attention layers have no rotary part
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                       "indexer_compress_ratio": 2},
}

# what eager gets beside the inputs, where a model computes differently by default than attnscope calls it:
# FSMT builds its decoder's causal mask only without a cache (attnscope's extract runs with use_cache=False)
EAGER_KWARGS: dict[str, dict[str, Any]] = {"fsmt": {"use_cache": False}}

# model types with a text vocabulary whose forward pass needs other inputs too: not text types (counted apart)
NEEDS_OTHER_INPUTS: dict[str, str] = {
    **dict.fromkeys(("bros", "lilt"), "needs each token's bounding box on a page (bbox)"),
    "lxmert": "needs visual features and boxes of an image",
    "blip_2_qformer": "needs query embeddings from an image encoder",
    "tvp": "needs video frames",
    "gemma3n_vision": "an image encoder",
    **dict.fromkeys(("gemma3n_audio", "granite_speech5_encoder", "voxtral_encoder", "voxtral_realtime_encoder"),
                    "an audio encoder: needs audio features"),
    "nemotron3_5_transcribe_word_timestamp": "needs embeddings from an audio encoder",
    "decision_transformer": "needs states, actions and returns (reinforcement learning), not tokens",
    "gemma4_assistant": "a speculative-decoding drafter: needs its target model's keys and values (shared_kv_states)",
}


# model types whose eager attention returns each row renormalised without the learned sink (the sink only scales
# their output): attnscope records the weights the model mixes values with, which sum to 1 minus the sink mass,
# so eager's rows are compared after scaling each by that sum (dividing attnscope's rows by it instead would magnify
# their rounding where the sink takes nearly the whole row: 3e-4 at a sink mass of 0.9998 in a 4-layer Granite)
EAGER_WITHOUT_SINK = frozenset({"granite_swa", "granitemoe_swa"})

# model types whose eager output_attentions returns the scores before the softmax (with the mask added), not
# weights, for these kinds: compared with attnscope's weights after a softmax
EAGER_RETURNS_SCORES: dict[str, tuple[str, ...]] = {"squeezebert": ("self",), "prophetnet": ("encoder", "cross")}

# hybrids whose eager output_attentions returns, for their linear-attention layers, the recurrent state (K^T V,
# [head, d_head, d_head]) rather than weights: compared on their softmax layers (layer_types "full_attention")
EAGER_RETURNS_LINEAR_STATES = frozenset({"minimax"})

# model types whose decoder runs predicting streams beside its main stream (ProphetNet's n-grams): eager's
# cross-attention has a row per query of every stream; the record holds the main stream's (the tokens')
EAGER_CROSS_OF_EVERY_STREAM = frozenset({"prophetnet"})

# model types whose eager attention of these kinds is a band ([head, q_pos, 2 * window + 1]: entry j of query i
# is key i - window + j), Longformer's local attention: compared after scattering it into [head, q_pos, k_pos]
EAGER_BANDED: dict[str, tuple[str, ...]] = {"longformer": ("self",), "led": ("encoder",)}

# model types whose eager attention of these kinds is in blocks ([batch, block, head, block_len, 3 * block_len]:
# each block's queries over its own and its two neighbours' keys), LongT5's local attention: compared after
# scattering the blocks into [head, q_pos, k_pos]
EAGER_BLOCKED: dict[str, tuple[str, ...]] = {"longt5": ("encoder",)}

# model types that have no attention weights although their eager output_attentions returns tensors: counted
# with the types whose eager returns no attentions (no_eager), with the reason
NOT_ATTENTION: dict[str, str] = {
    "rwkv": "recurrent (RWKV time mixing): its output_attentions returns each layer's time-mixing output "
            "[batch, pos, width], not weights over keys",
    "yoso": "LSH-sampled attention (YOSO) has no weights: its output_attentions returns each layer's context "
            "vectors [batch, pos, width]",
}


def text_model_types() -> tuple[list[str], list[str]]:
    """``(text, other)``: the model types of ``CONFIG_MAPPING`` with a causal LM, masked LM, seq2seq LM or
    text base model class, and the rest (vision, audio, multimodal-only, time series, ..., and the types of
    :data:`NEEDS_OTHER_INPUTS`)."""
    from transformers.models.auto import configuration_auto, modeling_auto

    mappings = {name: getattr(modeling_auto, name) for name in dir(modeling_auto) if name.endswith("_MAPPING_NAMES")}
    # (not DECISION: a decision model built on a text model maps that model's type, Qwen2's; Decision Transformer
    # is among NEEDS_OTHER_INPUTS)
    non_text_words = ("IMAGE", "VIDEO", "AUDIO", "CTC", "SPEECH", "VISION", "VISUAL", "DOCUMENT", "BACKBONE",
                      "OBJECT_DETECTION", "DEPTH", "SEGMENTATION", "KEYPOINT", "MASK_GENERATION", "TIME_SERIES",
                      "SPECTROGRAM", "WAVEFORM", "RNNT", "TDT", "MULTIMODAL", "RETRIEVAL", "POSE",
                      "NORMAL", "POINTMAP", "MATTING", "TABLE_RECOGNITION", "TEXT_RECOGNITION", "ZERO_SHOT")
    non_text = {t for name, mapping in mappings.items() if any(w in name for w in non_text_words) for t in mapping}
    text_names = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
                  "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_MAPPING_NAMES")
    candidates = {t for name in text_names for t in mappings[name]} - non_text
    every = sorted(configuration_auto.CONFIG_MAPPING_NAMES)
    text = [t for t in every if t in candidates and t not in NEEDS_OTHER_INPUTS and _has_text_config(t)]
    return text, [t for t in every if t not in text]


def _has_text_config(model_type: str) -> bool:
    """A vocabulary, and no vision or audio sub-config (a config that does not build with its defaults is
    tried all the same, and reported unbuilt)."""
    from transformers import CONFIG_MAPPING

    try:
        config_class = CONFIG_MAPPING[model_type]
    except (KeyError, ImportError):
        return False
    sub = " ".join(getattr(config_class, "sub_configs", {}) or {})
    if any(w in sub for w in ("vision", "audio", "speech", "image", "video")):
        return False
    try:
        return hasattr(config_class(), "vocab_size")
    except Exception:  # noqa: BLE001 - any failure of a default config
        return True


def tiny_config(model_type: str) -> Any:
    """A small config of ``model_type``: :data:`TINY_SIZES` where the class has those attributes, windows
    shorter than the input where it has any (:data:`WINDOWS`: each turned on, and a layer that uses them), and
    the :data:`SPECIAL` overrides."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    overrides = _tiny_sizes(config_class, default)
    if (layer_types := _tiny_layer_types(config_class, default)) is not None:
        overrides["layer_types"] = layer_types
    if (rope := _tiny_rope(default, overrides)) is not None:
        overrides["rope_parameters"] = rope
    if _has(default, "attn_layer_indices"):  # hybrids that name their attention layers (Bamba)
        overrides["attn_layer_indices"] = [1]
    for name, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
        if isinstance(sub_class, type) and isinstance(getattr(default, name, None), sub_class):
            overrides[name] = _tiny_sub_config(sub_class)  # a composite's parts are full-size by default
    overrides.update(SPECIAL.get(model_type, {}))
    config = config_class(**overrides)
    _set_mrope_sections(config)
    return config


def window_attributes(config: Any) -> dict[str, Any]:
    """``{name: value}`` of every attribute of ``config`` and of its parts (sub-configs, per-layer configs: dotted
    names) whose name looks like a window's (:data:`WINDOW_LIKE`)."""
    return {name: value for name, value in _flat(config.to_dict()).items()
            if re.search(WINDOW_LIKE, name.rpartition(".")[2])}


def _flat(values: Mapping[Any, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        flat.update(_flat(value, f"{name}.") if isinstance(value, Mapping) else {name: value})
    return flat


def _tiny_sub_config(config_class: Any) -> Any:
    return config_class(**_tiny_sizes(config_class, config_class()))


def _tiny_sizes(config_class: Any, default: Any) -> dict[str, Any]:
    """:data:`TINY_SIZES`, :data:`WINDOWS` and :data:`WINDOW_SWITCHES` where ``default`` has the attribute and it
    can be set (by its own name, not an alias of another that is set), keeping the dims the config derives from
    each other consistent (multi-head latent attention's rotary ``head_dim`` is its ``qk_rope_head_dim``, and its
    key heads are its query heads)."""
    aliases = getattr(config_class, "attribute_map", None) or {}
    wanted = {**TINY_SIZES, **WINDOWS, **WINDOW_SWITCHES}
    sizes = {name: value for name, value in wanted.items() if _has(default, name) and _settable(config_class, name)
             and aliases.get(name, name) not in wanted.keys() - {name}}
    if "num_key_value_heads" in sizes and _has(default, "kv_lora_rank"):  # MLA: every head its own keys
        sizes["num_key_value_heads"] = sizes["num_attention_heads"]
    rope_dim = _value(default, "qk_rope_head_dim")
    if "head_dim" in sizes and rope_dim is not None and _value(default, "head_dim") == rope_dim:
        sizes["head_dim"] = sizes["qk_rope_head_dim"]
    return sizes


def _has(config: Any, name: str) -> bool:
    """Whether ``config`` has ``name``; an attribute that varies by layer (Gemma 4's ``head_dim``: reading it
    raises) is there all the same, and passing it sets every layer's that no per-layer entry overrides."""
    try:
        getattr(config, name)
    except AttributeError:
        return False
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError, a RuntimeError
        return True
    return True


def _value(config: Any, name: str) -> Any:
    """``config.name``, or None where it is absent or varies by layer (reading it raises)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
        return None


def _settable(config_class: Any, name: str) -> bool:
    """Whether ``name`` can be passed to the config: not a read-only property, itself or through the
    config's ``attribute_map`` (Bamba's ``layer_types`` is its property ``layers_block_type``)."""
    target = (getattr(config_class, "attribute_map", None) or {}).get(name, name)
    return not isinstance(getattr(config_class, target, None), property)


def _head_dim(config: Any) -> int | None:
    head_dim = _value(config, "head_dim")
    if isinstance(head_dim, int):
        return head_dim
    hidden, heads = _value(config, "hidden_size"), _value(config, "num_attention_heads")
    return hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None


def _set_mrope_sections(config: Any) -> None:
    """Multimodal rotary sections (Qwen2-VL, GLM-4V: the config class names ``mrope_section``) split the rotary
    frequencies, half the rotary dims, in three; the modeling code's default fits the full-size head only, so
    set sections that fit the tiny head (:func:`_mrope_sections`)."""
    if "mrope_section" not in getattr(type(config), "ignore_keys_at_rope_validation", ()):
        return
    per_layer_type = [rope for rope in config.rope_parameters.values() if isinstance(rope, dict)]  # Cohere Compass
    for rope in per_layer_type or [config.rope_parameters]:
        rope["mrope_section"] = _mrope_sections(rope, _head_dim(config) or 0, _value(config, "partial_rotary_factor"))


def _mrope_sections(rope: dict[str, Any], head_dim: int, partial: float | None) -> list[int]:
    """Three sections adding up to half the rotary dims of ``head_dim``, in the default's proportions (1/4, 3/8,
    3/8)."""
    total = int(head_dim * rope.get("partial_rotary_factor", partial or 1.0)) // 2
    return [total - 2 * (3 * total // 8), 3 * total // 8, 3 * total // 8]


def _tiny_rope(default: Any, overrides: dict[str, Any]) -> dict[str, Any] | None:
    """The default's rope parameters with sections for the tiny head where the config checks them when it is
    built (Cosmos 3 Edge), else None."""
    rope = _value(default, "rope_parameters")
    if not isinstance(rope, dict) or "mrope_section" not in rope:
        return None
    head_dim = overrides.get("head_dim") or TINY_SIZES["hidden_size"] // TINY_SIZES["num_attention_heads"]
    return {**rope, "mrope_section": _mrope_sections(rope, head_dim, _value(default, "partial_rotary_factor"))}


def _tiny_layer_types(config_class: Any, default: Any) -> list[str] | None:
    """Two of the default's layer types (:func:`_two_layer_types`), or None where it names no more than two or
    they cannot be set; a full and a sliding layer where the config has a sliding window that no default layer
    uses (released configs of these types slide on some layers)."""
    layer_types = _value(default, "layer_types")
    if not isinstance(layer_types, list | tuple) or not _settable(config_class, "layer_types"):
        return None
    if set(layer_types) == {"full_attention"} and _has(default, "sliding_window"):
        return ["full_attention", "sliding_attention"]
    return list(_two_layer_types(layer_types)) if len(layer_types) > 2 else None


def _two_layer_types(layer_types: list[str] | tuple[str, ...]) -> tuple[str, str]:
    """Two layers of a longer pattern: the first kind and another one where there is another, a windowed
    attention kind where there is one (its window is what a capture could miss), else an attention kind (a
    hybrid's first layers are often all recurrent)."""
    first = layer_types[0]
    others = [kind for kind in layer_types if kind != first]
    attention = [kind for kind in others if "attention" in kind and "linear" not in kind]
    windowed = [kind for kind in attention if _windowed_kind(kind)]
    return first, next(iter(windowed or attention or others), first)


def _windowed_kind(layer_type: str) -> bool:
    """Whether layers of this ``layer_types`` entry see a window of keys (sliding or chunked)."""
    return "sliding" in layer_type or "chunked" in layer_type


def model_class_name(model_type: str, config: Any) -> str:
    """The class a user's checkpoint of ``model_type`` would name: seq2seq LM, causal LM, else base model."""
    from transformers.models.auto import modeling_auto as auto

    for mapping, wanted in ((auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, config.is_encoder_decoder),
                            (auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, not config.is_encoder_decoder),
                            (auto.MODEL_MAPPING_NAMES, True)):
        name = mapping.get(model_type)
        if wanted and name:
            return name if isinstance(name, str) else name[0]
    raise ValueError(f"no model class for {model_type!r}")


def perturb(model: torch.nn.Module, seed: int = 0) -> None:
    """Add seeded N(0, NOISE) noise to every floating-point weight (tied weights once)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.is_floating_point():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * NOISE)


def build_folder(model_type: str, folder: Path, config: Any | None = None) -> Path:
    """A tiny random model of ``model_type`` (perturbed weights) and the WordPiece tokenizer, saved in ``folder``."""
    import transformers

    from attnscope.models.loading import _auto_class, resolve_source

    config = config or tiny_config(model_type)
    config.architectures = [model_class_name(model_type, config)]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _auto_class(config).from_config(config)
        perturb(model)
        model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(resolve_source("minilm")).save_pretrained(folder)
    return folder


def eager_attentions(folder: Path, input_ids: list[int], decoder_ids: list[int] | None,
                     token_type_ids: list[int] | None = None) -> dict[str, list[np.ndarray]]:
    """Per kind, each layer's ``[head, q_pos, k_pos]`` attention from transformers' eager implementation
    with ``output_attentions=True`` (kinds it returns none of are left out)."""
    import transformers

    from attnscope.models.loading import _auto_class

    config = transformers.AutoConfig.from_pretrained(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _auto_class(config).from_pretrained(folder, attn_implementation="eager").eval()
    inputs: dict[str, Any] = {"input_ids": torch.tensor([input_ids])}
    if token_type_ids is not None and getattr(config, "type_vocab_size", 0) >= 2:
        inputs["token_type_ids"] = torch.tensor([token_type_ids])
    if decoder_ids is not None:
        inputs["decoder_input_ids"] = torch.tensor([decoder_ids])
    inputs.update(EAGER_KWARGS.get(config.model_type, {}))
    with torch.inference_mode():
        out = model.base_model(**inputs, output_attentions=True)
    names = {"encoder": "encoder_attentions", "decoder": "decoder_attentions", "cross": "cross_attentions"} \
        if decoder_ids is not None else {"self": "attentions"}
    found = {}
    for kind, name in names.items():
        layers = [a for a in (getattr(out, name, None) or ()) if isinstance(a, torch.Tensor)]
        if layers:
            found[kind] = [(a[0] if a.dim() == 4 else a).float().numpy() for a in layers]
    return found


def compare(captured: Mapping[str, np.ndarray], eager: Mapping[str, list[np.ndarray]]) -> tuple[float, str]:
    """The largest absolute difference between captured ``[layer, head, q_pos, k_pos]`` attention and eager's
    layers, over every kind, and what differs ("" when only the values do); inf when a kind, a layer count
    or a shape differs, or a value is not finite."""
    if set(captured) != set(eager):
        return float("inf"), f"kinds differ: attnscope {sorted(captured)}, eager {sorted(eager)}"
    worst = 0.0
    for kind, layers in eager.items():
        got = captured[kind]
        if len(got) != len(layers):
            return float("inf"), f"{kind}: attnscope has {len(got)} layers, eager {len(layers)}"
        for layer, expected in enumerate(layers):
            if got[layer].shape != expected.shape:
                return float("inf"), f"{kind} layer {layer}: shape {got[layer].shape} vs eager's {expected.shape}"
            error = float(np.max(np.abs(got[layer].astype(np.float64) - expected)))
            if not np.isfinite(error):
                return float("inf"), f"{kind} layer {layer}: not finite"
            worst = max(worst, error)
    return worst, ""


# keys bounded by no sliding window or chunk: the record states none, and the band check (:func:`window_problem`) asks
# only that it does not. Keys a sparse-attention indexer selects per query (a config with one of INDEXERS set: DeepSeek
# V3.2, GLM-5, HunYuan V4, AXK2, ...), and the model types named here, each with why
INDEXERS = ("index_topk", "indexer_budget", "index_topk_blocks")
NO_BAND: dict[str, str] = {"longt5": "blocks: a query sees its own block of keys and the two beside it"}


def banded(model_type: str, config: Any) -> bool:
    """Whether the keys of ``model_type`` (built from ``config``) lie in a band a record can state."""
    selected = any(value is not None for name, value in window_attributes(config).items()
                   if name.rpartition(".")[2] in INDEXERS)
    return model_type not in NO_BAND and not selected


def window_problem(record: Any, band: bool = True) -> str:
    """What is wrong with the window ``record`` states for each input-side layer ("" when nothing is): it must be the
    narrowest band of keys that holds every nonzero weight of that layer (any head), a sliding window
    (``|q - k| < w``) or a chunk (``q // c == k // c``), or none (0) where no band narrower than the input does;
    computed from the weights alone, on an input longer than every window (:data:`WINDOWS`). Without a ``band``
    (:func:`banded`), only none."""
    attention = record.get(record.model.main_kind)  # [layer, head, q_pos, k_pos]
    n = attention.shape[-1]
    for layer in range(attention.shape[0]):
        support = (attention[layer] != 0).any(axis=0)  # [q_pos, k_pos]: keys some head weighs
        stated = (record.model.window(layer), layer in record.model.chunked)
        if stated[0] >= n:  # a window as long as the input is none on it
            stated = (0, False)
        narrowest = _narrowest_band(support) if band else (0, False)
        if not _band(n, *stated)[support].all() or stated != narrowest:
            return (f"{record.model.main_kind} layer {layer}: the record states {_band_name(*stated)}, its weights "
                    f"lie in {_band_name(*narrowest)}")
    return ""


def _band(n: int, window: int, chunked: bool) -> np.ndarray:
    """Bool ``[q_pos, k_pos]``: the pairs a band of ``window`` keys holds (every pair where ``window`` is 0)."""
    queries, keys = np.arange(n)[:, None], np.arange(n)[None, :]
    if not window:
        return np.ones((n, n), dtype=bool)
    return queries // window == keys // window if chunked else np.abs(queries - keys) < window


def _narrowest_band(support: np.ndarray) -> tuple[int, bool]:
    """The band narrower than the input that holds every pair of ``support`` ``[q_pos, k_pos]`` and the fewest pairs,
    ``(window, chunked)``; ``(0, False)`` where none does."""
    n = support.shape[0]
    holding = [(int(_band(n, w, chunked).sum()), w, chunked) for chunked in (False, True) for w in range(1, n)
               if _band(n, w, chunked)[support].all()]
    return min(holding)[1:] if holding else (0, False)


def _band_name(window: int, chunked: bool) -> str:
    return "no window" if not window else f"chunks of {window} keys" if chunked else f"a sliding window of {window} keys"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:600] if text else ""


def _decoder_ids(tokenizer: Any, config: Any) -> list[int]:
    """The decoder input eager gets when attnscope gave no record: a start token and the target's tokens."""
    start = next((i for i in (getattr(config, "decoder_start_token_id", None), config.pad_token_id) if i is not None), 0)
    return [start, *tokenizer(TARGET, add_special_tokens=False)["input_ids"]]


def _as_weights(model_type: str, config: Any, eager: dict[str, list[np.ndarray]]) -> dict[str, list[np.ndarray]]:
    """Eager's attentions as weights where a type returns something else beside them: the softmax of its scores
    (:data:`EAGER_RETURNS_SCORES`), a band or blocks scattered into keys (:data:`EAGER_BANDED`,
    :data:`EAGER_BLOCKED`), the main stream's cross-attention rows (:data:`EAGER_CROSS_OF_EVERY_STREAM`),
    its softmax layers only (:data:`EAGER_RETURNS_LINEAR_STATES`)."""
    if model_type in EAGER_RETURNS_SCORES:
        eager = {kind: [_softmax(a) for a in layers] if kind in EAGER_RETURNS_SCORES[model_type] else layers
                 for kind, layers in eager.items()}
    if model_type in EAGER_BANDED:
        eager = {kind: [_unbanded(a) for a in layers] if kind in EAGER_BANDED[model_type] else layers
                 for kind, layers in eager.items()}
    if model_type in EAGER_BLOCKED:
        length = eager["cross"][0].shape[-1]  # the encoder's tokens
        eager = {kind: [_unblocked(a, length) for a in layers] if kind in EAGER_BLOCKED[model_type] else layers
                 for kind, layers in eager.items()}
    if model_type in EAGER_CROSS_OF_EVERY_STREAM:
        n_main = eager["decoder"][0].shape[1]  # the main stream's queries: the decoder's tokens
        eager = {**eager, "cross": [a[:, :n_main] for a in eager["cross"]]}
    if model_type in EAGER_RETURNS_LINEAR_STATES:
        return {kind: [a for a, layer_type in zip(layers, config.layer_types, strict=True)
                       if layer_type == "full_attention"] for kind, layers in eager.items()}
    return eager


def _with_sink_share(layers: list[np.ndarray], sink_mass: np.ndarray) -> list[np.ndarray]:
    """Each layer's rows ``[head, q_pos, k_pos]`` times the share the sink leaves the keys (1 - ``sink_mass``
    ``[layer, head, q_pos]``); the layers as they are where their count differs (the comparison says so)."""
    if len(layers) != len(sink_mass):
        return layers
    return [rows * (1.0 - mass)[..., None] for rows, mass in zip(layers, sink_mass, strict=True)]


def _unbanded(band: np.ndarray) -> np.ndarray:
    """Longformer's band ``[head, q_pos, 2 * window + 1]`` as ``[head, q_pos, k_pos]`` (zeros outside the band)."""
    n_heads, length, width = band.shape
    window = (width - 1) // 2
    full = np.zeros((n_heads, length, length), dtype=band.dtype)
    for query in range(length):
        keys = np.arange(max(0, query - window), min(length, query + window + 1))
        full[:, query, keys] = band[:, query, keys - query + window]
    return full


def _unblocked(blocks: np.ndarray, length: int) -> np.ndarray:
    """LongT5's blocks ``[batch 1, block, head, block_len, 3 * block_len]`` as ``[head, q_pos, k_pos]`` over the
    first ``length`` positions (key slot j of a query in block b is position (b - 1) * block_len + j)."""
    _, n_blocks, n_heads, block_len, _ = blocks.shape
    full = np.zeros((n_heads, n_blocks * block_len, (n_blocks + 2) * block_len), dtype=blocks.dtype)
    for block in range(n_blocks):
        rows = slice(block * block_len, (block + 1) * block_len)
        full[:, rows, block * block_len:(block + 3) * block_len] = blocks[0, block]  # keys shifted by one block
    return full[:, :length, block_len:block_len + length]


def _softmax(scores: np.ndarray) -> np.ndarray:
    """Softmax over keys of ``[head, q_pos, k_pos]`` scores, in float64."""
    shifted = np.exp(scores.astype(np.float64) - scores.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def check_type(model_type: str, folder: Path, config: Any | None = None) -> dict[str, Any]:
    """Build, capture and compare one model type in ``folder``: ``{"outcome": ..., ...}``.

    Outcomes: ``equal`` (the weights equal eager's and each input-side layer's stated window is the band its weights
    lie in: :func:`window_problem`) and ``differs`` (``error``, ``reason``), ``refused`` (attnscope's one-line
    :class:`~attnscope.errors.AttnscopeError`, ``reason``), ``crash`` (any other exception from attnscope,
    ``reason``), ``no_eager`` (transformers' eager forward returns no attentions) and ``unbuilt`` (the
    tiny model could not be built or eager could not run it: not attnscope's doing).
    """
    import transformers

    import attnscope
    from attnscope.errors import AttnscopeError

    try:
        build_folder(model_type, folder, config)
    except Exception as error:  # noqa: BLE001 - any config or model that does not build is "unbuilt"
        return {"outcome": "unbuilt", "reason": f"build: {type(error).__name__}: {_first_line(error)}"}
    record, refusal = None, None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loaded = attnscope.load_model(str(folder))
            pair = TARGET if loaded.is_encoder_decoder else None
            record = attnscope.extract(loaded, TEXT, pair)
    except AttnscopeError as error:
        refusal = {"outcome": "refused", "reason": _first_line(error)}
    except Exception as error:  # noqa: BLE001 - anything else from attnscope is a defect
        refusal = {"outcome": "crash", "reason": f"{type(error).__name__}: {_first_line(error)}"}
    config = transformers.AutoConfig.from_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    if record is not None:
        input_ids = record.token_ids.tolist()
        decoder = record.arrays["target.token_ids"].tolist() if "target.token_ids" in record.arrays else None
        types = record.sentence_ids.tolist()
    else:
        input_ids, types = tokenizer(TEXT)["input_ids"], None
        decoder = _decoder_ids(tokenizer, config) if config.is_encoder_decoder else None
    try:
        eager = eager_attentions(folder, input_ids, decoder, types)
    except Exception as error:  # noqa: BLE001 - transformers' own eager path failing is not attnscope's doing
        return {"outcome": "unbuilt", "reason": f"eager: {type(error).__name__}: {_first_line(error)}"}
    if not eager or model_type in NOT_ATTENTION:
        return {"outcome": "no_eager", **({"reason": NOT_ATTENTION[model_type]} if model_type in NOT_ATTENTION else {}),
                **({"attnscope": refusal} if refusal else {})}
    if refusal is not None:
        return refusal
    assert record is not None
    eager = _as_weights(model_type, config, eager)
    captured = {kind: record.get(kind) for kind in record.kinds}
    if model_type in EAGER_WITHOUT_SINK and record.sink_mass is not None:
        eager = {**eager, "self": _with_sink_share(eager["self"], record.sink_mass)}
    error, reason = compare(captured, eager)
    window = window_problem(record, banded(model_type, config)) if error <= TOLERANCE else ""
    outcome = "equal" if error <= TOLERANCE and not window else "differs"
    return {"outcome": outcome, "error": error if np.isfinite(error) else None, "reason": reason or window}
