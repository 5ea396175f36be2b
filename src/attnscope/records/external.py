"""Bring your own attention: tensors computed elsewhere -> the parts of an :class:`~attnscope.records.AttentionRecord`.

Users of BertViz and TransformerLens already hold attention tensors. This module turns them into a
record, so every view, statistic and classifier of attnscope works on them:

* what ``model(..., output_attentions=True)`` returns: the tuple ``outputs.attentions`` (one
  ``[batch, head, q_pos, k_pos]`` tensor per layer), or the whole output object, whose
  ``encoder_attentions`` / ``decoder_attentions`` / ``cross_attentions`` make an encoder-decoder
  record;
* a TransformerLens ``ActivationCache`` (or any mapping) whose ``blocks.{layer}.attn.hook_pattern``
  entries are ``[batch, head, q_pos, k_pos]``.

Tensors may be torch tensors or numpy arrays; torch is not imported here. Only what the caller
gives is known: the model's name and type come from ``model=`` (a transformers model or config)
when given, ``d_head`` is 0 ("unknown") without one, and queries and keys are never held (so the
neuron view is left out). The public way in is :meth:`AttentionRecord.from_attentions`, which
builds the record from :func:`record_parts` (this module does not import ``record``, so the two
do not import each other).

>>> out = hf_model(**inputs, output_attentions=True)                                   # doctest: +SKIP
>>> rec = AttentionRecord.from_attentions(out.attentions, tokenizer.convert_ids_to_tokens(inputs.input_ids[0]))
...                                                                                    # doctest: +SKIP
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any

import numpy as np

from ..errors import AttnscopeError

# TransformerLens's name of the attention pattern of block ``layer``: [batch, head_index, query_pos, key_pos]
PATTERN_KEY = re.compile(r"^blocks\.(\d+)\.attn\.hook_pattern$")
# what an encoder-decoder output names its attention -> attnscope's kind
SEQ2SEQ_FIELDS = {"encoder_attentions": "encoder", "decoder_attentions": "decoder", "cross_attentions": "cross"}
# [CLS], [SEP], <s>, </s>, <pad>, <|endoftext|>, <|im_start|>: the usual written forms of special tokens
SPECIAL_FORM = re.compile(r"^(\[[A-Z]+\]|<\|?[^<>\s|]+\|?>)$")


def record_parts(attentions: Any, tokens: Sequence[str], *, target_tokens: Sequence[str] | None = None,
                    batch_index: int = 0, model: Any = None, name: str | None = None, causal: bool | None = None,
                    special: Sequence[bool] | None = None, sentence_b_start: int | None = None,
                    word_ids: Sequence[int] | None = None, text: Sequence[str] = ()) -> dict[str, Any]:
    """The keyword arguments of an AttentionRecord for attention computed elsewhere (see the module
    docstring for what ``attentions`` may be); ``model`` is a dict of ModelInfo's fields.

    ``tokens``: the input's tokens, one per key position of item ``batch_index`` (padding included);
    ``target_tokens``: the decoder's tokens of an encoder-decoder output. ``causal``: whether the
    input side attends only backwards (default: read from the weights, True when nothing above the
    diagonal is attended). ``special``: which tokens are special (default: tokens written like
    ``[CLS]``, ``<s>`` or ``<|endoftext|>``). ``sentence_b_start``: where the second sentence of a
    pair starts, as in BertViz. ``name``: the model's name on pages and tables (default: ``model``'s
    ``name_or_path``, the last folder of a local path, or ``external``). ``word_ids``: the word of each token (default: ``##`` pieces join
    the word before them; special tokens are words of their own, id -1).
    """
    kinds = _kinds_of(attentions)
    stacked = {kind: _stack(layers, batch_index, kind) for kind, layers in kinds.items()}
    is_seq2seq = "encoder" in stacked
    if is_seq2seq and target_tokens is None and ("decoder" in stacked or "cross" in stacked):
        raise AttnscopeError("encoder-decoder attention needs target_tokens= (the decoder's input tokens)")
    tokens = tuple(str(token) for token in tokens)
    targets = None if target_tokens is None else tuple(str(token) for token in target_tokens)
    _check_lengths(stacked, len(tokens), None if targets is None else len(targets))
    main = stacked["encoder" if is_seq2seq else "self"]
    if causal is None:
        causal = not is_seq2seq and _attends_only_backwards(main)
    arrays = {f"{kind}.attention": values for kind, values in stacked.items()}
    sinks = _learned_sink_mass(stacked)
    arrays.update({f"{kind}.sink_mass": values for kind, values in sinks.items()})
    arrays.update(_side("input", tokens, special, sentence_b_start, word_ids))
    if targets is not None and is_seq2seq:
        arrays.update(_side("target", targets, None, None, None))
    info = {**_model_info(model, name, main, causal=causal, is_encoder_decoder=is_seq2seq), "learned_sinks": bool(sinks)}
    return {"model": info, "tokens": tokens, "arrays": arrays, "target_tokens": targets if is_seq2seq else None,
            "text": tuple(text)}


# some row summing to less than 1 by more than this says the model has learned sinks (half-precision
# rounding stays well below it); every row then holds its sink's share, 1 minus its sum
SINK_EVIDENCE = 1e-2


def _learned_sink_mass(stacked: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per kind, ``1 - sum`` of each row ``[layer, head, q_pos]`` when some row sums to less than 1: the eager
    weights of a model with learned sinks (gpt-oss), which drop the sink's column; empty for every other model."""
    masses = {kind: 1.0 - values.sum(-1, dtype=np.float64) for kind, values in stacked.items()}
    if not any(mass.max(initial=0.0) > SINK_EVIDENCE for mass in masses.values()):
        return {}
    return {kind: np.clip(mass, 0.0, 1.0).astype(np.float32) for kind, mass in masses.items()}


# ---- what was handed in -> per kind, one [batch, head, q_pos, k_pos] tensor per layer ----------
def _kinds_of(attentions: Any) -> dict[str, list[Any]]:
    if isinstance(attentions, Mapping) or _is_cache(attentions):
        keys = list(attentions.keys())
        patterns = sorted((int(m.group(1)), key) for key in keys if (m := PATTERN_KEY.match(str(key))))
        if patterns:
            return {"self": [attentions[key] for _, key in patterns]}
        given = {name: list(attentions[name]) for name in ("attentions", *SEQ2SEQ_FIELDS)
                 if name in keys and attentions[name] is not None and len(attentions[name])}
        if "attentions" in given:  # an encoder or decoder alone (BERT's output also has empty cross_attentions)
            return {"self": given["attentions"]}
        if given:
            return {SEQ2SEQ_FIELDS[name]: layers for name, layers in given.items()}
        raise AttnscopeError("found no attention in this mapping: expected 'attentions', 'encoder_attentions' or "
                             "TransformerLens 'blocks.{layer}.attn.hook_pattern' entries (call the model with "
                             "output_attentions=True)")
    if isinstance(attentions, Sequence | np.ndarray) or hasattr(attentions, "shape"):
        return {"self": list(attentions)}
    raise AttnscopeError(f"cannot read attention from a {type(attentions).__name__}: pass outputs.attentions "
                         "(a tuple of [batch, head, q_pos, k_pos] tensors), the model output or an ActivationCache")


def _is_cache(value: Any) -> bool:
    """A TransformerLens ActivationCache (or look-alike): keys() and [name], not a Mapping subclass."""
    return hasattr(value, "keys") and hasattr(value, "__getitem__") and not isinstance(value, str | bytes)


def _stack(layers: list[Any], batch_index: int, kind: str) -> np.ndarray:
    """Per-layer ``[batch, head, q_pos, k_pos]`` (or ``[head, q_pos, k_pos]``) -> ``[layer, head, q_pos, k_pos]``."""
    if not layers:
        raise AttnscopeError(f"no layers of {kind} attention were given")
    arrays = [_numpy(layer) for layer in layers]
    shapes = {array.shape for array in arrays}
    if len(shapes) != 1 or arrays[0].ndim not in (3, 4):
        raise AttnscopeError(f"{kind} attention must be one [batch, head, q_pos, k_pos] tensor per layer, "
                             f"all of one shape; got shapes {sorted(shapes)}")
    if arrays[0].ndim == 4:
        batch = arrays[0].shape[0]
        if not -batch <= batch_index < batch:
            raise AttnscopeError(f"batch_index {batch_index} is out of range for a batch of {batch}")
        arrays = [array[batch_index] for array in arrays]
    stacked = np.stack(arrays).astype(np.float32)  # [layer, head, q_pos, k_pos]
    if not np.isfinite(stacked).all():
        raise AttnscopeError(f"{kind} attention holds NaN or infinite values")
    return stacked


def _numpy(tensor: Any) -> np.ndarray:
    if hasattr(tensor, "detach"):  # a torch tensor, on any device and in any dtype
        tensor = tensor.detach().cpu().float().numpy()
    return np.asarray(tensor)


def _check_lengths(stacked: dict[str, np.ndarray], n_tokens: int, n_targets: int | None) -> None:
    """Every kind's query and key lengths must match its sides' tokens (padding included)."""
    sides = {"self": (n_tokens, n_tokens), "encoder": (n_tokens, n_tokens), "decoder": (n_targets, n_targets),
             "cross": (n_targets, n_tokens)}
    for kind, values in stacked.items():
        expected = sides[kind]
        if values.shape[-2:] != expected:
            raise AttnscopeError(f"{kind} attention is [q_pos {values.shape[-2]}, k_pos {values.shape[-1]}] but "
                                 f"the tokens given make it [{expected[0]}, {expected[1]}]: pass the tokens of "
                                 "batch item batch_index, padding included")


def _attends_only_backwards(attention: np.ndarray) -> bool:
    """True when no layer or head puts weight above the diagonal (a causal model)."""
    n = attention.shape[-1]
    if n < 2:
        return False
    above = np.triu(np.ones((n, n), dtype=bool), k=1)
    return bool(np.all(attention[..., above] == 0.0))


# ---- token arrays and model facts ---------------------------------------------------------------
def _side(prefix: str, tokens: tuple[str, ...], special: Sequence[bool] | None, sentence_b_start: int | None,
          word_ids: Sequence[int] | None) -> dict[str, np.ndarray]:
    n = len(tokens)
    special_mask = np.array([bool(SPECIAL_FORM.match(t)) for t in tokens] if special is None else list(special),
                            dtype=bool)
    if special_mask.shape != (n,):
        raise AttnscopeError(f"special= has {special_mask.size} entries for {n} tokens")
    sentence = np.zeros(n, dtype=np.int64)
    if sentence_b_start is not None:
        if not 0 < sentence_b_start < n:
            raise AttnscopeError(f"sentence_b_start {sentence_b_start} is not inside the {n} tokens")
        sentence[sentence_b_start:] = 1
    words = _word_ids(tokens, special_mask) if word_ids is None else np.array(list(word_ids), dtype=np.int64)
    if words.shape != (n,):
        raise AttnscopeError(f"word_ids= has {words.size} entries for {n} tokens")
    return {f"{prefix}.token_ids": np.full(n, -1, dtype=np.int64),  # ids unknown: the tokens came as text
            f"{prefix}.special_mask": special_mask, f"{prefix}.sentence_ids": sentence, f"{prefix}.word_ids": words}


def _word_ids(tokens: tuple[str, ...], special: np.ndarray) -> np.ndarray:
    """WordPiece convention: a ``##`` piece continues the word before it; specials are -1."""
    words = np.full(len(tokens), -1, dtype=np.int64)
    word = -1
    for position, token in enumerate(tokens):
        if special[position]:
            continue
        if not (token.startswith("##") and position and words[position - 1] >= 0):
            word += 1
        words[position] = word
    return words


def _model_info(model: Any, name: str | None, main: np.ndarray, *, causal: bool,
                is_encoder_decoder: bool) -> dict[str, Any]:
    """ModelInfo's fields: shapes from the tensors, name and type from ``model`` if given."""
    config = getattr(model, "config", model)
    n_layers, n_heads = int(main.shape[0]), int(main.shape[1])
    d_head = _d_head(config, n_heads)
    source = str(getattr(config, "name_or_path", "") or "external")
    return {
        "name": name or (PurePath(source).name if PurePath(source).is_absolute() else source),  # no local paths
        "model_type": str(getattr(config, "model_type", "") or "unknown"),
        "n_layers": n_layers,
        "n_heads": n_heads,
        "n_kv_heads": n_heads,  # attention is per query head
        "d_head": d_head,
        "causal": causal,
        "is_encoder_decoder": is_encoder_decoder,
        "scaling": d_head ** -0.5 if d_head else 1.0,  # only the neuron view uses it, and it needs q/k
    }


def _d_head(config: Any, n_heads: int) -> int:
    """Size of one head from a transformers config (``head_dim``, or width / heads); 0 when unknown."""
    if config is None:
        return 0
    head_dim = getattr(config, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0:
        return head_dim
    width = next((getattr(config, name) for name in ("hidden_size", "d_model", "n_embd")
                  if isinstance(getattr(config, name, None), int)), 0)
    return width // n_heads if width and width % n_heads == 0 else 0
