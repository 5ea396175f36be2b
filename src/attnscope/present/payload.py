"""AttentionRecord -> the JSON payload the HTML views draw (schema: ``payload.schema.json``).

Python packs, JS draws. The payload carries what the views show and nothing derived from it:

* the tokens of each side (``input``, and ``target`` for encoder-decoders) with their special
  mask and sentence ids;
* per kind of attention (``self``, or ``encoder``/``decoder``/``cross``) the weights
  ``[layer, head, q_pos, k_pos]`` quantized to uint8 (``round(weight * 255)``; decoded
  ``value * scale[layer]`` with ``scale = 1/255``, so at most 0.5/255 ~ 0.002 off);
* optionally the norms ||alpha f(x)|| of Kobayashi et al. 2020, same shape and encoding but
  scaled per layer for display: ``value = round(255 * norm / layer_max)`` and
  ``scale[layer] = layer_max / 255``, so decoding gives back the norm (to 1/510 of the layer's
  largest norm) and opacity ``value / 255`` compares heads within a layer;
* optionally, on the input side only (``self``, or ``encoder``: the context-mixing measures are
  defined there), context-mixing measures (``attnscope.analysis.mixing``): a list ``mixing`` of
  ``{method, label, reference, layers, rollout}`` where ``layers`` is each layer's map and
  ``rollout`` the maps aggregated through each layer, both ``[layer, q_pos, k_pos]`` (no head
  axis: a layer-level measure) and encoded as the norms are, scaled per layer
  (``value = round(255 * v / layer_max)``, ``scale[layer] = layer_max / 255``): decoded within
  1/510 of the layer's largest value; rows that sum to 1 are off by at most 0.002 per entry;
* for a model with learned attention sinks (gpt-oss), per kind ``sink_mass`` ``[layer, head, q_pos]`` as
  float16: the share of each query's softmax given to the learned sink logit (its row over the keys sums
  to 1 minus it); the head view writes it under the tokens as the "learned sink" of each head;
* for the neuron view, the query and key vectors ``[layer, head, pos, d_head]`` as little-endian
  float16, and the model's ``scaling`` (``1/sqrt(d_head)`` for most models). With grouped
  key/value heads only the distinct key heads are shipped (``[layer, kv_head, pos, d_head]``;
  query head ``h`` uses key head ``h // (n_heads / n_kv_heads)``).

The neuron view's q*k, q.k and softmax(q.k * scaling) for the ONE chosen (layer, head, query)
are computed in the browser, on demand, from the shipped vectors: shipping every product would be
``[layer, head, q_pos, k_pos, d_head]`` (BERT-base at 512 tokens: 1.2e10 numbers), far too big.
The recorded attention is shipped beside it, so the page shows both.

Binary arrays are base64 strings, optionally zlib-compressed (``"compression": "deflate"``;
browsers inflate them with the built-in ``DecompressionStream("deflate")``).
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal, NotRequired, TypedDict

import numpy as np

from ..analysis.measures import MeasureField
from ..analysis.mixing import Mixing, get_measure, method_name
from ..analysis.mixing import measures as registered_measures
from ..errors import AttnscopeError
from ..records.attention import AttentionRecord

FORMAT = "attnscope.views"
VERSION = 1

VIEWS = {
    "head": "tokens in two columns joined by lines, one colour per head, opacity = weight",
    "model": "a grid of layers x heads thumbnails; click one to open it in the head view",
    "neuron": "query, key, q*k, q.k and softmax for one layer, head and query token (needs q/k)",
}
"""Registry of the interactive views: name -> what it shows (CLI choices come from it)."""

MIXING_KINDS = ("self", "encoder")  # the measures are defined on the input side only
MIXING_LABELS = MeasureField("label")
"""How the views' measure control names each context-mixing measure (the paper is in its tooltip):
a read-only view of each registered measure's ``label`` (see ``attnscope.analysis.measures``)."""

KIND_LABELS = {
    "self": "self-attention",
    "encoder": "encoder self-attention",
    "decoder": "decoder self-attention",
    "cross": "cross-attention (decoder -> encoder)",
}
# which token side the queries (left column) and keys (right column) of each kind come from
KIND_SIDES = {"self": ("input", "input"), "encoder": ("input", "input"), "decoder": ("target", "target"),
              "cross": ("target", "input")}


class PackedArray(TypedDict):
    """A numeric array as base64 bytes: ``dtype`` ``uint8`` (decoded ``value * scale[index 0]``),
    ``float16`` or ``uint16`` (little-endian, decoded as is), C order, in ``shape``."""

    dtype: Literal["uint8", "float16", "uint16"]
    shape: list[int]
    compression: Literal["deflate", "none"]
    data: str
    scale: NotRequired[list[float]]
    lazy: NotRequired[bool]


class Side(TypedDict):
    tokens: list[str]
    special: list[bool]
    sentence: list[int]


class Vectors(TypedDict):
    """Queries ``[layer, head, q_pos, d_head]`` and keys ``[layer, kv_head, k_pos, d_head]``."""

    queries: PackedArray
    keys: PackedArray
    n_kv_heads: int


class MixingMaps(TypedDict):
    """One context-mixing measure: ``layers`` and ``rollout`` ``[layer, q_pos, k_pos]``, uint8 scaled per layer."""

    method: str
    label: str
    reference: str
    layers: PackedArray
    rollout: PackedArray


class KindPayload(TypedDict):
    kind: str
    label: str
    query_side: str
    key_side: str
    causal: bool
    attention: PackedArray
    norms: PackedArray | None
    vectors: Vectors | None
    mixing: NotRequired[list[MixingMaps]]
    sink_mass: NotRequired[PackedArray]  # float16 [layer, head, q_pos]: learned sinks (gpt-oss) only


class Start(TypedDict, total=False):
    """What the page opens on: ``layer`` (a model layer number) and the ``heads`` shown (0-indexed)."""

    layer: int
    heads: list[int]


class Payload(TypedDict):
    format: str
    version: int
    title: str
    views: list[str]
    notes: list[str]
    model: dict[str, Any]
    level: str
    sides: dict[str, Side]
    kinds: list[KindPayload]
    layers: NotRequired[list[int]]
    start: NotRequired[Start]


# ---- the long view's payload (present/longview.py; schema longview.schema.json) ----
class Overview(TypedDict):
    """Per layer and head the overview ``[R, R]`` (float16), and per layer the mean over its heads."""

    block: int
    source_block: int
    size: int
    heads: list[list[PackedArray]]
    mean: list[PackedArray]


class Thumbnails(TypedDict):
    block: int
    size: int
    data: PackedArray


class TopK(TypedDict):
    """Per layer and head: ``indices`` uint16 ``[k, q_pos]`` as differences along q_pos (mod 65536),
    ``weights`` float16 ``[k, q_pos]``; rank 0 is each query's strongest key."""

    k: int
    source_k: int
    indices: list[list[PackedArray]]
    weights: list[list[PackedArray]]


class LongPayload(TypedDict):
    format: str
    version: int
    title: str
    views: list[str]
    notes: list[str]
    tokens: list[str]
    special: list[bool]
    causal: bool
    layers: list[int]
    heads: list[int]
    overview: Overview
    thumbnails: Thumbnails
    top_k: TopK
    window: dict[str, int]


# ---- block averages ------------------------------------------------------------------------------
def resolve_views(views: str | list[str] | tuple[str, ...], record: AttentionRecord) -> tuple[list[str], list[str]]:
    """``"all"``, one name or a list of names -> (views to ship, notes for the page).

    ``"all"`` leaves out the neuron view, with a note, when the record has no queries and keys;
    asking for the neuron view by name on such a record is an error.
    """
    has_vectors = record.queries is not None and record.keys is not None
    if views == "all":
        if has_vectors:
            return list(VIEWS), []
        return ["head", "model"], ["neuron view left out: the record has no queries/keys (extract with qkv=True)"]
    names = [views] if isinstance(views, str) else list(views)
    unknown = [name for name in names if name not in VIEWS]
    if unknown or not names:
        raise AttnscopeError(f"unknown view {', '.join(unknown) or '(none)'}; choose from {', '.join(VIEWS)} or all")
    if "neuron" in names and not has_vectors:
        raise AttnscopeError("the neuron view needs queries and keys: extract with qkv=True (CLI: attnscope view)")
    return list(dict.fromkeys(names)), []


def build_payload(record: AttentionRecord, views: str | list[str] | tuple[str, ...] = "all", *,
                  norms: bool = True, compress: bool = True, title: str | None = None,
                  layer: int | None = None, heads: Sequence[int] | None = None,
                  include_layers: Sequence[int] | None = None, lazy: bool = False,
                  mixing: Mapping[str, Mixing] | Sequence[Mixing] | None = None) -> Payload:
    """The JSON-ready payload for ``record`` (see the module docstring and ``payload.schema.json``).

    ``mixing``: context-mixing measures of the same input (``attnscope.mixing`` or
    ``attnscope.experiments.mixing.mixing_measures``), shipped with the input side's attention so
    the views' measure control offers them; their tokens must be the record's input tokens.

    ``norms=False`` leaves the record's norms out (smaller page, no norm toggle). ``layer`` and
    ``heads`` choose what the page opens on (0-indexed model numbers); ``include_layers`` ships only
    those layers (as BertViz's argument of that name). ``lazy=True`` ships no arrays, only their
    shapes and scales (``"lazy": true``): the notebook widget fetches layers from the kernel with
    :func:`layer_arrays`.
    """
    record.require_complete("the head, model and neuron views")
    chosen, notes = resolve_views(views, record)
    layers = _included_layers(record, include_layers)
    sides = {"input": _side(record.tokens, record.special_mask, record.sentence_ids)}
    if record.target_tokens is not None:
        sides["target"] = _side(record.target_tokens, record.arrays["target.special_mask"],
                                record.arrays["target.sentence_ids"])
    shipping = _Shipping(layers, norms, "neuron" in chosen, compress, lazy)
    kinds = [_kind(record, kind, shipping) for kind in record.kinds]
    measures = _checked_mixing(record, mixing)
    if measures:
        side = next(kind for kind in kinds if kind["kind"] in MIXING_KINDS)
        side["mixing"] = [mixing_maps(measure, layers, compress) for measure in measures]
    payload = Payload(
        format=FORMAT,
        version=VERSION,
        title=title or default_title(record),
        views=chosen,
        notes=notes,
        model=record.model.to_json(),
        level=record.level,
        sides=sides,
        kinds=kinds,
    )
    if include_layers is not None:
        payload["layers"] = layers
    start = _start(record, layers, layer, heads)
    if start:
        payload["start"] = start
    return payload


def _checked_mixing(record: AttentionRecord, mixing: Mapping[str, Mixing] | Sequence[Mixing] | None) -> list[Mixing]:
    """The measures to ship, once each, in their given order; a clear error for a measure of another input."""
    measures = list((mixing.values() if isinstance(mixing, Mapping) else mixing) or ())
    if not measures:
        return []
    side = next((kind for kind in record.kinds if kind in MIXING_KINDS), None)
    if side is None:
        raise AttnscopeError("context-mixing measures belong to the input side's attention (self or encoder); "
                             "the record has none")
    n_layers = int(record.get(side).shape[0])  # type: ignore[union-attr]
    for measure in measures:
        if tuple(measure.tokens) != tuple(record.tokens) or measure.n_layers != n_layers:
            raise AttnscopeError(f"the {measure.method} measure was computed on another input than the record's "
                                 f"({len(measure.tokens)} tokens x {measure.n_layers} layers against {len(record.tokens)} "
                                 f"x {n_layers}): compute it on the record's text alone (no second sentence)")
    return list({method_name(m.method): m for m in measures}.values())


def mixing_maps(measure: Mixing, layers: list[int], compress: bool = True) -> MixingMaps:
    """One measure's per-layer maps and rollout ``[layer, q_pos, k_pos]`` for ``layers``, uint8 scaled per layer."""
    registered = get_measure(measure.method)
    maps, rollout = take_layers(measure.layers, layers), take_layers(measure.rollout, layers)
    return MixingMaps(method=registered.name, label=registered.label, reference=registered.reference,
                      layers=pack_uint8(maps, _layer_max(maps), compress),
                      rollout=pack_uint8(rollout, _layer_max(rollout), compress))


@dataclass(frozen=True)
class _Shipping:
    """What goes into each kind's entry: which layers (model numbers), and which arrays, how packed."""

    layers: list[int]
    norms: bool
    vectors: bool
    compress: bool
    lazy: bool


def _included_layers(record: AttentionRecord, include_layers: Sequence[int] | None) -> list[int]:
    """The model layer numbers to ship (all when None); each must exist in every kind of attention."""
    n_layers = min(int(record.get(kind).shape[0]) for kind in record.kinds)  # type: ignore[union-attr]
    if include_layers is None:
        return list(range(n_layers))
    chosen = sorted({int(layer) for layer in include_layers})
    outside = [layer for layer in chosen if not 0 <= layer < n_layers]
    if outside or not chosen:
        raise AttnscopeError(f"include_layers {list(include_layers)}: choose 0-indexed layers from 0 to {n_layers - 1}")
    return chosen


def _start(record: AttentionRecord, layers: list[int], layer: int | None, heads: Sequence[int] | None) -> Start:
    start = Start()
    if layer is not None:
        if layer not in layers:
            raise AttnscopeError(f"layer {layer} is not among the layers shown ({', '.join(map(str, layers))}; 0-indexed)")
        start["layer"] = int(layer)
    if heads is not None:
        n_heads = min(int(record.get(kind).shape[1]) for kind in record.kinds)  # type: ignore[union-attr]
        chosen = sorted({int(head) for head in heads})
        if not chosen or not all(0 <= head < n_heads for head in chosen):
            raise AttnscopeError(f"heads {list(heads)}: choose 0-indexed heads from 0 to {n_heads - 1}")
        start["heads"] = chosen
    return start


def default_title(record: AttentionRecord) -> str:
    text = " / ".join(record.text) if record.text else " ".join(record.tokens)
    return f"{record.model.name}: {text[:120]}"


def _side(tokens: tuple[str, ...], special: np.ndarray, sentence: np.ndarray) -> Side:
    return Side(tokens=list(tokens), special=[bool(s) for s in special], sentence=[int(s) for s in sentence])


def _kind(record: AttentionRecord, kind: str, shipping: _Shipping) -> KindPayload:
    query_side, key_side = KIND_SIDES[kind]
    layers = shipping.layers
    pack = _lazy_pack if shipping.lazy else pack_uint8
    attention = record.get(kind)
    assert attention is not None  # kinds lists only captured kinds
    norms = record.get(kind, "norms") if shipping.norms else None
    causal = kind == "decoder" or (kind == "self" and record.model.causal)
    vectors = kind_vectors(record, kind, layers) if shipping.vectors else None
    sink_mass = record.get(kind, "sink_mass")
    payload = KindPayload(
        kind=kind,
        label=KIND_LABELS[kind],
        query_side=query_side,
        key_side=key_side,
        causal=causal,
        attention=pack(take_layers(attention, layers), np.full(len(layers), 1.0), shipping.compress),
        norms=None if norms is None else pack(take_layers(norms, layers), _layer_max(take_layers(norms, layers)),
                                              shipping.compress),
        vectors=None if vectors is None else _pack_vectors(*vectors, shipping),
    )
    if sink_mass is not None:  # small ([layer, head, q_pos]): shipped whole, even in a lazy payload
        payload["sink_mass"] = pack_float16(take_layers(sink_mass, layers), shipping.compress)
    return payload


def _lazy_pack(values: np.ndarray, layer_max: np.ndarray, compress: bool) -> PackedArray:
    """Shape and per-layer scale only (``"lazy": true``): the widget fetches each layer's bytes."""
    packed = PackedArray(dtype="uint8", shape=list(values.shape), compression="none", data="", lazy=True)
    packed["scale"] = [float(top) / 255 for top in layer_max]
    return packed


def _layer_max(values: np.ndarray) -> np.ndarray:
    """Largest value of each layer ``[layer]`` (1 where a layer is all zeros, to avoid 0/0)."""
    top = values.reshape(values.shape[0], -1).max(axis=1).astype(np.float64)
    return np.where(top > 0, top, 1.0)


def kind_vectors(record: AttentionRecord, kind: str,
                 layers: list[int]) -> tuple[np.ndarray, np.ndarray, int] | None:
    """Queries ``[layer, head, q_pos, d_head]``, keys ``[layer, kv_head, k_pos, d_head]`` (one copy
    per group of grouped key/value heads) and the number of key heads, or None without q/k."""
    queries, keys = record.get(kind, "queries"), record.get(kind, "keys")
    if queries is None or keys is None:
        return None
    n_kv_heads = record.model.n_kv_heads
    if record.kv_expanded and n_kv_heads < keys.shape[1]:
        keys = keys[:, :: keys.shape[1] // n_kv_heads]  # [layer, kv_head, k_pos, d_head]: one copy per group
    else:
        n_kv_heads = keys.shape[1]
    return take_layers(queries, layers), take_layers(keys, layers), n_kv_heads


def take_layers(values: np.ndarray, layers: list[int]) -> np.ndarray:
    """``values[layers]`` along the first axis, without a copy when ``layers`` is every layer in order."""
    return values if layers == list(range(values.shape[0])) else values[layers]


def _pack_vectors(queries: np.ndarray, keys: np.ndarray, n_kv_heads: int, shipping: _Shipping) -> Vectors:
    if shipping.lazy:
        return Vectors(queries=PackedArray(dtype="float16", shape=list(queries.shape), compression="none", data="",
                                           lazy=True),
                       keys=PackedArray(dtype="float16", shape=list(keys.shape), compression="none", data="", lazy=True),
                       n_kv_heads=n_kv_heads)
    return Vectors(queries=pack_float16(queries, shipping.compress), keys=pack_float16(keys, shipping.compress),
                   n_kv_heads=n_kv_heads)


# zlib level of a layer the widget asks for while the user waits: SmolLM2's layer 15 at 1,000 tokens
# compresses in 120 ms at level 1 against 369 ms at level 6, for 561 KB against 414 KB
FETCH_LEVEL = 1


def layer_arrays(record: AttentionRecord, kind: str, field: str, layer: int, *, compress: bool = True) -> PackedArray:
    """One layer of one array, packed as the full payload packs it (leading axis of size 1).

    ``field``: ``attention``, ``norms``, ``queries`` or ``keys``; ``layer`` a model layer number.
    What the notebook widget sends when the page asks for a layer it is about to draw.
    """
    if kind not in record.kinds:
        raise AttnscopeError(f"the record holds no {kind} attention")
    if field in ("queries", "keys"):
        vectors = kind_vectors(record, kind, [layer])
        if vectors is None:
            raise AttnscopeError(f"the record holds no {field} for {kind} attention")
        return pack_float16(vectors[0] if field == "queries" else vectors[1], compress, level=FETCH_LEVEL)
    values = record.get(kind, field)
    if values is None or field not in ("attention", "norms"):
        raise AttnscopeError(f"the record holds no {kind} {field}")
    one = values[layer : layer + 1]  # [1, head, q_pos, k_pos]
    return pack_uint8(one, np.ones(1) if field == "attention" else _layer_max(one), compress, level=FETCH_LEVEL)


def pack_uint8(values: np.ndarray, layer_max: np.ndarray, compress: bool, *, level: int = 6) -> PackedArray:
    """``values`` ``[layer, ...]`` >= 0 -> uint8 ``round(255 * value / layer_max[layer])``."""
    scaled = values / layer_max.reshape(-1, *([1] * (values.ndim - 1)))
    quantized = np.rint(np.clip(scaled, 0.0, 1.0) * 255).astype(np.uint8)
    packed = _pack(quantized, "uint8", compress, level)
    packed["scale"] = [float(top) / 255 for top in layer_max]
    return packed


def pack_bytes(values: np.ndarray, compress: bool) -> PackedArray:
    """uint8 values as they are (the caller says how to read them; no ``scale``)."""
    return _pack(values.astype(np.uint8), "uint8", compress)


def pack_float16(values: np.ndarray, compress: bool, *, level: int = 6) -> PackedArray:
    return _pack(values.astype("<f2"), "float16", compress, level)


def pack_uint16(values: np.ndarray, compress: bool) -> PackedArray:
    """Integers in [0, 65535] (e.g. key positions) as little-endian uint16."""
    return _pack(values.astype("<u2"), "uint16", compress)


def _pack(array: np.ndarray, dtype: Literal["uint8", "float16", "uint16"], compress: bool,
          level: int = 6) -> PackedArray:
    raw = np.ascontiguousarray(array).tobytes()
    data = zlib.compress(raw, level) if compress else raw
    return PackedArray(dtype=dtype, shape=list(array.shape), compression="deflate" if compress else "none",
                       data=base64.b64encode(data).decode("ascii"))


def packed_bytes(packed: PackedArray) -> bytes:
    """The raw bytes of a packed array (base64-decoded, inflated)."""
    raw = base64.b64decode(packed["data"])
    return zlib.decompress(raw) if packed["compression"] == "deflate" else raw


def unpack(packed: PackedArray) -> np.ndarray:
    """The inverse of packing, for tests and tools: float32 values in ``shape``."""
    raw = packed_bytes(packed)
    if packed["dtype"] in ("float16", "uint16"):
        little_endian = "<f2" if packed["dtype"] == "float16" else "<u2"
        return np.frombuffer(raw, dtype=little_endian).astype(np.float32).reshape(packed["shape"])
    values = np.frombuffer(raw, dtype=np.uint8).reshape(packed["shape"]).astype(np.float32)
    scale = np.asarray(packed["scale"], dtype=np.float32)
    return values * scale.reshape(-1, *([1] * (values.ndim - 1)))


def payload_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) every payload follows (``present/payload.schema.json``), its
    mixing ``method`` enum read from the measures registered now (the file lists the built-in ones; not cached,
    so a measure registered later is in it)."""
    schema = json.loads(_schema_text())
    schema["$defs"]["mixing"]["properties"]["method"]["enum"] = [m.name for m in registered_measures()]
    return dict(schema)


@cache
def _schema_text() -> str:
    return resources.files("attnscope.present").joinpath("payload.schema.json").read_text(encoding="utf-8")


def to_json(payload: Mapping[str, Any]) -> str:
    """Compact JSON, safe inside ``<script type="application/json">``: every ``<`` is ``\\u003c``,
    so neither ``</script>`` nor ``<!--`` can end or confuse the element."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).replace("<", "\\u003c")
