"""Checks that a record file holds what its metadata says, before it becomes an AttentionRecord.

A damaged or hand-edited file must not load as garbage nor crash deep inside numpy: every
problem is refused with one :class:`~attnscope.errors.AttnscopeError` line that names it.
In order:

1. the metadata is JSON, an object, of a format version this attnscope reads;
2. it follows the written schema ``record.schema.json`` (read by :func:`schema_problem`, a small
   reader of exactly the keywords the schema uses, so jsonschema is not needed at run time);
3. every array has the name, dtype and shape the model info and the tokens imply, read from
   ``.shape``/``.dtype`` only (memory-mapped arrays are not read for this);
4. floating arrays are finite and attention rows sum to 1, or to 1 minus their sink mass for a model
   with learned sinks (read one layer at a time).

Shapes use axis names: ``layer``, ``head``, ``q_pos``, ``k_pos``, ``pos``, ``d_head``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

from ..errors import AttnscopeError
from ..files import parse_json
from .attribution import (
    ATTRIBUTION_ARRAYS,
    ATTRIBUTION_HEADS,
    ATTRIBUTION_LOGITS,
    ATTRIBUTION_SOURCES,
    ATTRIBUTION_TOP,
    LENS_IDS,
    LENS_PROBS,
    ROUTE_ARRAYS,
    ROUTE_EDGES,
    ROUTE_HEADS,
    ROUTE_IMPORTANCE,
)
from .format import LOCALITY, ROW_STATISTICS, SENTENCE_ATTENTION, distance_bin_edges

TOKEN_FIELDS = {"token_ids": "i", "special_mask": "b", "sentence_ids": "i", "word_ids": "i"}  # name -> dtype kind
ATTENTION_FIELDS = ("attention", "norms")  # [layer, head, q_pos, k_pos]
VECTOR_FIELDS = ("queries", "keys", "values")  # [layer, head, pos, d_head]


class ArrayLike(Protocol):
    """What the checks need of an array: numpy arrays, memory maps and lazy shards all qualify."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> np.dtype: ...

    def __getitem__(self, index: Any) -> Any: ...


def check_record_parts(header: str | None, arrays: Mapping[str, ArrayLike], path: str | Path,
                       format_version: int, *, values: bool = True) -> dict[str, Any]:
    """The record metadata parsed from ``header``, once it and ``arrays`` are checked to agree.

    ``format_version`` is the newest version this attnscope reads. ``arrays`` maps
    ``"<kind>.<field>"`` / ``"input.<field>"`` / ``"target.<field>"`` to arrays (see
    :mod:`attnscope.record`). Raises AttnscopeError naming the first problem found. ``values=False``
    checks names, dtypes and shapes only (a lazily opened record is not read whole).
    """
    try:
        meta = _parse_metadata(header, format_version)
        _check_arrays(meta, arrays, values)
    except _Damaged as problem:
        raise AttnscopeError(f"{path} is not a valid attnscope record: {problem}") from None
    return meta


class _Damaged(Exception):
    """One problem of a record file, said in a few words."""


# ---- metadata -------------------------------------------------------------------------------
def _json_object(header: str | None) -> dict[str, Any]:
    """The metadata of a record file (of either kind): a JSON object."""
    if header is None:
        raise _Damaged("a safetensors file without attnscope metadata")
    try:
        meta = parse_json(header, parse_constant=_refuse_constant)
    except json.JSONDecodeError as error:
        raise _Damaged(f"its metadata is not JSON ({error.msg} at character {error.pos})") from None
    if not isinstance(meta, dict):
        raise _Damaged(f"its metadata is a JSON {_json_type(meta)}, not an object")
    return meta


def _parse_metadata(header: str | None, format_version: int) -> dict[str, Any]:
    meta = _json_object(header)
    version: Any = meta.get("format_version")
    if _numeric(version) and version > format_version:
        raise _Damaged(f"format version {version} is newer than this attnscope reads ({format_version}); "
                       "upgrade attnscope")
    problem = schema_problem(meta, record_schema())
    if problem:
        raise _Damaged(problem)
    model = meta["model"]
    if model["n_heads"] % model["n_kv_heads"]:
        raise _Damaged(f"model info has {model['n_heads']} heads, not a multiple of its "
                       f"{model['n_kv_heads']} key/value heads")
    if meta["target_tokens"] is not None and not model["is_encoder_decoder"]:
        raise _Damaged("target tokens in a record of a model that is not an encoder-decoder")
    return meta


def _refuse_constant(name: str) -> None:
    """Python's json reads NaN and Infinity; JSON (and so the schema) has no such numbers."""
    raise _Damaged(f"its metadata holds {name}, which is not JSON")


@cache
def record_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a record's metadata (``attnscope/records/record.schema.json``)."""
    return json.loads(resources.files("attnscope.records").joinpath("record.schema.json").read_text(encoding="utf-8"))


_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
               type(None): "null"}
_ANNOTATIONS = {"$schema", "$id", "title", "description"}


def _json_type(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def schema_problem(value: Any, schema: Mapping[str, Any], where: str = "the metadata") -> str | None:
    """The first thing in ``value`` that breaks ``schema``, as ``"<where>: <problem>"``; None if it conforms.

    Reads only the keywords ``record.schema.json`` uses (type, properties, required,
    additionalProperties, items, enum, minimum, exclusiveMinimum, minItems) with JSON Schema's
    meaning, and refuses a schema with any other: a keyword must never be ignored silently.
    The tests check its verdicts against jsonschema's on every damaged file they build.
    """
    unknown = set(schema) - set(_KEYWORDS) - _ANNOTATIONS
    if unknown:
        raise ValueError(f"schema keyword(s) {sorted(unknown)} not supported by schema_problem")
    for keyword, check in _KEYWORDS.items():
        if keyword in schema:
            problem = check(value, schema[keyword], schema, where)
            if problem:
                return problem
    return None


def _described(value: Any) -> str:
    return "null" if value is None else f"{_json_type(value)} {json.dumps(value)[:40]}"


def _numeric(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _type_problem(value: Any, wanted: str | list[str], _schema: Any, where: str) -> str | None:
    wanted = [wanted] if isinstance(wanted, str) else wanted
    actual = _json_type(value)
    integral = actual == "number" and float(value).is_integer()  # 1.0 is an integer in JSON Schema
    if actual in wanted or (actual == "integer" and "number" in wanted) or (integral and "integer" in wanted):
        return None
    return f"{where}: should be {' or '.join(wanted)}, not {_described(value)}"


def _enum_problem(value: Any, allowed: list[Any], _schema: Any, where: str) -> str | None:
    if any(value == option and type(value) is type(option) for option in allowed):
        return None
    return f"{where}: should be one of {', '.join(map(json.dumps, allowed))}, not {_described(value)}"


def _minimum_problem(value: Any, bound: float, _schema: Any, where: str) -> str | None:
    return f"{where}: should be at least {bound}, not {value}" if _numeric(value) and not value >= bound else None


def _exclusive_minimum_problem(value: Any, bound: float, _schema: Any, where: str) -> str | None:
    return f"{where}: should be more than {bound}, not {value}" if _numeric(value) and not value > bound else None


def _min_items_problem(value: Any, bound: int, _schema: Any, where: str) -> str | None:
    if isinstance(value, list) and len(value) < bound:
        return f"{where}: should hold at least {bound} item(s), not {len(value)}"
    return None


def _required_problem(value: Any, names: list[str], _schema: Any, where: str) -> str | None:
    missing = [repr(name) for name in names if isinstance(value, dict) and name not in value]
    return f"{where}: missing {', '.join(missing)}" if missing else None


def _additional_problem(value: Any, allowed: bool, schema: Mapping[str, Any], where: str) -> str | None:
    if allowed or not isinstance(value, dict):
        return None
    extra = [repr(name) for name in sorted(set(value) - set(schema.get("properties", {})))]
    return f"{where}: unexpected key(s) {', '.join(extra)}" if extra else None


def _properties_problem(value: Any, properties: Mapping[str, Any], _schema: Any, where: str) -> str | None:
    if not isinstance(value, dict):
        return None
    prefix = "" if where == "the metadata" else f"{where}."
    problems = (schema_problem(value[name], sub, f"{prefix}{name}") for name, sub in properties.items() if name in value)
    return next(filter(None, problems), None)


def _items_problem(value: Any, item_schema: Mapping[str, Any], _schema: Any, where: str) -> str | None:
    if not isinstance(value, list):
        return None
    problems = (schema_problem(item, item_schema, f"{where}[{index}]") for index, item in enumerate(value))
    return next(filter(None, problems), None)


KeywordCheck = Callable[[Any, Any, Mapping[str, Any], str], str | None]  # (value, keyword's value, schema, where)
_KEYWORDS: dict[str, KeywordCheck] = {
    "type": _type_problem, "enum": _enum_problem, "minimum": _minimum_problem,
    "exclusiveMinimum": _exclusive_minimum_problem, "minItems": _min_items_problem, "required": _required_problem,
    "additionalProperties": _additional_problem, "properties": _properties_problem, "items": _items_problem,
}


# ---- arrays: names, dtypes, shapes ----------------------------------------------------------
def _check_arrays(meta: dict[str, Any], arrays: Mapping[str, ArrayLike], values: bool = True) -> None:
    expected = _expected_shapes(meta, arrays)
    unknown = sorted(set(arrays) - set(expected))
    if unknown:
        raise _Damaged(f"unexpected array(s) {', '.join(unknown)} for this model and these tokens")
    main = _main_kind(meta)
    if f"{main}.attention" not in arrays and not meta.get("selection"):
        raise _Damaged(f"no {main}.attention array")
    if meta.get("selection") and not any(name.startswith(f"{main}.") for name in arrays):
        raise _Damaged(f"a partial record without any {main}.* array")
    for name, (kind_of_dtype, shape) in expected.items():
        if name in arrays:
            _check_array(name, arrays[name], kind_of_dtype, shape)
        elif name.startswith(("input.", "target.")):
            raise _Damaged(f"no {name} array")
    _check_learned_sinks(meta, arrays)
    for name in expected if values else ():
        if name in arrays and name.split(".")[1] in (*ATTENTION_FIELDS, *VECTOR_FIELDS, "sink_mass"):
            kind, _, field_name = name.partition(".")
            _check_values(name, arrays[name], arrays.get(f"{kind}.sink_mass") if field_name == "attention" else None)


def _check_learned_sinks(meta: dict[str, Any], arrays: Mapping[str, ArrayLike]) -> None:
    """A record of a model with learned sinks holds their mass beside every attention array; no other does."""
    sinks = meta["model"].get("learned_sinks", False)  # older files do not say: no sinks
    for name in arrays:
        kind, _, field_name = name.partition(".")
        if field_name == "sink_mass" and not sinks:
            raise _Damaged(f"{name} in a record whose model info has no learned sinks")
        if field_name == "attention" and sinks and f"{kind}.sink_mass" not in arrays:
            raise _Damaged(f"no {kind}.sink_mass array, though the model info says it has learned sinks")


def _main_kind(meta: dict[str, Any]) -> str:
    return "encoder" if meta["model"]["is_encoder_decoder"] else "self"


class Agreed(NamedTuple):
    """A size the metadata does not give, taken from the first array that has it (``source``)."""

    size: int
    source: str


# a str names a size the metadata does not give ("decoder layers"): all arrays with it must agree
Shape = tuple[int | str | Agreed, ...]


def _expected_shapes(meta: dict[str, Any], arrays: Mapping[str, ArrayLike]) -> dict[str, tuple[str, Shape]]:
    """Every array name this record may hold -> (numpy dtype kind, expected shape).

    Input-side sizes come from the model info and the tokens; an encoder-decoder's decoder layers
    and heads are not in the model info, so ``decoder.*`` and ``cross.*`` only have to agree.
    """
    model = meta["model"]
    n_tokens = len(meta["tokens"])
    expected: dict[str, tuple[str, Shape]] = {f"input.{f}": (k, (n_tokens,)) for f, k in TOKEN_FIELDS.items()}
    kv_heads = model["n_heads"] if meta["kv_expanded"] else model["n_kv_heads"]
    main = (model["n_layers"], model["n_heads"], kv_heads, model["d_head"])
    sides = {_main_kind(meta): (*main, n_tokens, n_tokens)}
    targets = meta["target_tokens"]
    if targets is not None:
        expected.update({f"target.{f}": (k, (len(targets),)) for f, k in TOKEN_FIELDS.items()})
        decoder = ("decoder layers", "decoder heads", "decoder heads", "decoder d_head")
        sides["decoder"] = (*decoder, len(targets), len(targets))
        sides["cross"] = (*decoder, len(targets), n_tokens)
    for kind, (layers, heads, kv, d_head, q_len, k_len) in sides.items():
        expected.update({f"{kind}.{f}": ("f", (layers, heads, q_len, k_len)) for f in ATTENTION_FIELDS})
        expected[f"{kind}.queries"] = ("f", (layers, heads, q_len, d_head))
        expected[f"{kind}.sink_mass"] = ("f", (layers, heads, q_len))
        expected.update({f"{kind}.{f}": ("f", (layers, kv, k_len, d_head)) for f in ("keys", "values")})
    if meta.get("selection"):
        expected = {name: value for name, value in expected.items() if not name.startswith(f"{_main_kind(meta)}.")}
        expected.update(_partial_shapes(meta, n_tokens))
    return _bind_unknown_sizes(expected, arrays)


def _partial_shapes(meta: dict[str, Any], n_tokens: int) -> dict[str, tuple[str, Shape]]:
    """The input side's arrays of a partial record: ``[held layer, held head, row, ...]`` (see
    :mod:`attnscope.capture.planned`); rows are the ``input.query_positions``."""
    selection, kind = meta["selection"], _main_kind(meta)
    lead: Shape = (len(selection["layers"]), len(selection["heads"]))
    rows = "query rows"
    shapes: dict[str, tuple[str, Shape]] = {"input.query_positions": ("i", (rows,))}
    shapes.update({f"{kind}.{f}": ("f", (*lead, rows, n_tokens)) for f in ATTENTION_FIELDS})
    shapes.update({f"{kind}.stat_{name}": ("f", (*lead, rows)) for name in ROW_STATISTICS})
    shapes[f"{kind}.sink_mass"] = ("f", (*lead, rows))
    shapes[f"{kind}.distance_histogram"] = ("f", (*lead, len(distance_bin_edges(n_tokens))))
    shapes[f"{kind}.topk_indices"] = ("i", (*lead, rows, "top k"))
    shapes[f"{kind}.topk_weights"] = ("f", (*lead, rows, "top k"))
    block = selection["plan"].get("overview") or 0
    blocks = -(-n_tokens // min(block, n_tokens)) if block else "overview blocks"
    shapes[f"{kind}.overview"] = ("f", (*lead, blocks, blocks))
    sentences = len(selection["plan"].get("sentences") or ()) or "sentences"
    shapes[f"{kind}.{SENTENCE_ATTENTION}"] = ("f", (*lead, sentences, sentences))
    shapes[f"{kind}.{LOCALITY}"] = ("f", (*lead, len(selection["plan"].get("locality") or ()) or "pairs"))
    return shapes


def _bind_unknown_sizes(expected: dict[str, tuple[str, Shape]],
                        arrays: Mapping[str, ArrayLike]) -> dict[str, tuple[str, Shape]]:
    """Replace each named size by the one the first array holding it has (so the others must agree)."""
    sizes: dict[str, Agreed] = {}
    for name, (_, shape) in expected.items():
        array = arrays.get(name)
        if array is not None and len(array.shape) == len(shape):
            for axis, size in zip(shape, array.shape):
                if isinstance(axis, str):
                    sizes.setdefault(axis, Agreed(int(size), name))
    return {name: (kind, tuple(sizes.get(axis, axis) if isinstance(axis, str) else axis for axis in shape))
            for name, (kind, shape) in expected.items()}


_AXES = {"attention": ("layers", "heads", "queries", "keys"), "norms": ("layers", "heads", "queries", "keys"),
         "queries": ("layers", "heads", "positions", "d_head"), "keys": ("layers", "heads", "positions", "d_head"),
         "values": ("layers", "heads", "positions", "d_head"),
         "topk_indices": ("layers", "heads", "rows", "keys kept"), "topk_weights": ("layers", "heads", "rows", "keys kept"),
         "overview": ("layers", "heads", "query blocks", "key blocks"),
         SENTENCE_ATTENTION: ("layers", "heads", "query sentences", "key sentences"),
         LOCALITY: ("layers", "heads", "(sink, window) pairs"),
         "distance_histogram": ("layers", "heads", "distance bins"), "query_positions": ("rows",),
         "sink_mass": ("layers", "heads", "rows"),
         # generation records
         "rows": ("layers", "heads", "packed keys"), "value_norms": ("layers", "heads", "positions"),
         "candidate_ids": ("steps", "candidates"), "candidate_probs": ("steps", "candidates"), "chosen_probs": ("steps",),
         ATTRIBUTION_HEADS: ("steps", "layers", "heads"), ATTRIBUTION_LOGITS: ("steps",),
         ATTRIBUTION_TOP: ("steps", "ranks", "(layer, head)"), ATTRIBUTION_SOURCES: ("steps", "ranks", "sources"),
         LENS_IDS: ("steps", "layers", "lens tokens"), LENS_PROBS: ("steps", "layers", "lens tokens")}
_DTYPE_KINDS = {"f": "floating point", "i": "integer", "b": "boolean"}


def _check_array(name: str, array: ArrayLike, kind_of_dtype: str, shape: Shape) -> None:
    actual = np.dtype(array.dtype)
    if not (actual.kind == kind_of_dtype or (kind_of_dtype == "i" and actual.kind == "u")):
        raise _Damaged(f"{name} is {actual.name}, should be {_DTYPE_KINDS[kind_of_dtype]}")
    if len(array.shape) != len(shape):
        raise _Damaged(f"{name} has {len(array.shape)} dimensions {list(array.shape)}, should have {len(shape)}")
    field_name = name.split(".")[-1]
    axes = _AXES.get(field_name, ("layers", "heads", "rows") if field_name.startswith("stat_") else ("tokens",))
    for axis, size, wanted in zip(axes, array.shape, shape):
        if isinstance(wanted, Agreed) and size != wanted.size:
            raise _Damaged(f"{name} has {size} {axis} (shape {list(array.shape)}), {wanted.source} has {wanted.size}")
        if isinstance(wanted, int) and size != wanted:
            raise _Damaged(f"{name} has {size} {axis} (shape {list(array.shape)}), the metadata says {wanted}")


# ---- values ---------------------------------------------------------------------------------
def row_sum_tolerance(dtype: np.dtype, n_keys: int) -> float:
    """How far a stored attention row may sum from 1.

    float32 softmax rows sum to 1 within a few 1e-7; 1e-4 leaves room for aggregation (word
    level) and interventions. float16 storage rounds each weight by at most 2**-11 of itself
    (so the sum by at most 2**-11) and flushes weights below 2**-25 to 0 (at most 2**-25 per key).
    """
    if np.dtype(dtype).itemsize >= 4:
        return 1e-4
    return 2 * 2**-11 + n_keys * 2**-25


def _check_values(name: str, array: ArrayLike, sink_mass: ArrayLike | None = None) -> None:
    """Finite values; attention, norms and sink mass non-negative; sink mass at most 1; attention rows
    summing to 1 minus their ``sink_mass`` (``[layer, head, q_pos]``, None: 0).

    Records hold no padding (extraction cuts it off) and word-level rows are means of token rows,
    so every stored attention row sums to 1 (less its sink mass). Read one layer at a time to bound memory.
    """
    field_name = name.split(".")[1]
    tolerance = row_sum_tolerance(array.dtype, array.shape[-1])
    for layer in range(array.shape[0]):
        values = np.asarray(array[layer])
        if not np.isfinite(values).all():
            raise _Damaged(f"{name} holds NaN or infinite values (layer {layer}, 0-indexed)")
        if field_name in (*ATTENTION_FIELDS, "sink_mass") and values.size and values.min() < 0:
            raise _Damaged(f"{name} holds negative weights (layer {layer}, 0-indexed)")
        if field_name == "sink_mass" and values.size and values.max() > 1:
            raise _Damaged(f"{name} holds a mass above 1 (layer {layer}, 0-indexed)")
        if field_name == "attention" and values.size:
            _check_rows(name, layer, values, tolerance, None if sink_mass is None else np.asarray(sink_mass[layer]))


def _check_rows(name: str, layer: int, values: np.ndarray, tolerance: float, sink_mass: np.ndarray | None) -> None:
    """Rows of ``values`` ``[head, q_pos, k_pos]`` (one layer) sum to 1 minus ``sink_mass`` ``[head, q_pos]``
    (None: to 1) within ``tolerance``."""
    sums = values.sum(axis=-1, dtype=np.float64)  # [head, q_pos]
    wanted = 1.0 if sink_mass is None else 1.0 - sink_mass.astype(np.float64)
    worst = np.unravel_index(np.argmax(np.abs(sums - wanted)), sums.shape)
    expected = float(np.broadcast_to(wanted, sums.shape)[worst])
    if not math.isclose(sums[worst], expected, abs_tol=tolerance):
        head, query = (int(i) for i in worst)
        should = "1" if sink_mass is None else "1 minus their sink mass"
        raise _Damaged(f"{name} rows should sum to {should}, layer {layer} head {head} query {query} sums to "
                       f"{sums[worst]:.6g}, not {expected:.6g} (0-indexed)")


# ---- generation records ---------------------------------------------------------------------
GENERATION_FORMAT = "attnscope-generation/1"


@cache
def generation_schema() -> dict[str, Any]:
    """The JSON Schema of a generation record's metadata (its model info is a record's)."""
    strings = {"type": "array", "items": {"type": "string"}}
    return {"type": "object", "additionalProperties": False,
            "required": ["format", "model", "tokens", "prompt_length", "candidate_tokens", "prompt", "settings",
                         "changes"],
            "properties": {"format": {"enum": [GENERATION_FORMAT]}, "model": record_schema()["properties"]["model"],
                           "tokens": {**strings, "minItems": 2}, "prompt_length": {"type": "integer", "minimum": 1},
                           "candidate_tokens": {"type": "array", "items": {**strings, "minItems": 1}},
                           "prompt": {"type": "string"}, "settings": {"type": "object"}, "changes": {"type": "string"},
                           "first_row": {"type": "integer", "minimum": 0},
                           "lens_tokens": {"type": "array", "items": {"type": "array", "items": strings}}}}


OPTIONAL_GENERATION_ARRAYS = ("value_norms", "sink_mass", *ATTRIBUTION_ARRAYS, *ROUTE_ARRAYS)  # older files lack them


def check_generation_parts(header: str | None, arrays: Mapping[str, ArrayLike], path: str | Path) -> dict[str, Any]:
    """A generation record's metadata parsed from ``header``, once it and ``arrays`` are checked to agree
    (see :class:`attnscope.GenerationRecord` for the arrays): the schema, positions and steps, every
    array's dtype and shape against the model info and the tokens, finite values, probabilities in
    [0, 1] and attention rows summing to 1 within the stored precision. One AttnscopeError line."""
    try:
        meta = _parse_generation_metadata(header)
        for name, (kind_of_dtype, shape) in _bind_unknown_sizes(_generation_shapes(meta, arrays), arrays).items():
            if name in arrays:
                _check_array(name, arrays[name], kind_of_dtype, shape)
            elif name not in OPTIONAL_GENERATION_ARRAYS:
                raise _Damaged(f"no {name} array")
        _check_generation_values(meta, arrays)
    except _Damaged as problem:
        raise AttnscopeError(f"{path} is not a valid attnscope generation record: {problem}") from None
    return meta


def _parse_generation_metadata(header: str | None) -> dict[str, Any]:
    meta = _json_object(header)
    problem = schema_problem(meta, generation_schema())
    if problem:
        raise _Damaged(problem)
    n, prompt_length, first_row = len(meta["tokens"]), meta["prompt_length"], meta.get("first_row", 0)
    if prompt_length >= n:
        raise _Damaged(f"prompt_length {prompt_length} leaves no generated token of the {n}")
    if first_row >= prompt_length:
        raise _Damaged(f"first_row {first_row} is past the prompt's last position ({prompt_length - 1})")
    steps, k = n - prompt_length, {len(c) for c in meta["candidate_tokens"]}
    if len(meta["candidate_tokens"]) != steps or len(k) > 1:
        raise _Damaged(f"candidate_tokens should be {steps} lists (one per generated token) of one length")
    if "lens_tokens" in meta and len(meta["lens_tokens"]) != steps:
        raise _Damaged(f"lens_tokens should be {steps} lists (one per generated token)")
    return meta


def _generation_shapes(meta: dict[str, Any], arrays: Mapping[str, ArrayLike]) -> dict[str, tuple[str, Shape]]:
    """Array name -> (numpy dtype kind, shape) of a generation record; names ``<field>`` (no kind)."""
    model, n = meta["model"], len(meta["tokens"])
    first_row, steps = meta.get("first_row", 0), n - meta["prompt_length"]
    packed = n * (n + 1) // 2 - first_row * (first_row + 1) // 2  # rows first_row..n-1 hold first_row+1..n keys
    k = len(meta["candidate_tokens"][0])
    shapes: dict[str, tuple[str, Shape]] = {
        "rows": ("f", (model["n_layers"], model["n_heads"], packed)),
        "value_norms": ("f", (model["n_layers"], model["n_heads"], n)),
        "sink_mass": ("f", (model["n_layers"], model["n_heads"], n - first_row)),  # learned sinks, per kept row
        **{name: (kind, (n,)) for name, kind in (("token_ids", "i"), ("special_mask", "b"), ("word_ids", "i"))},
        "candidate_ids": ("i", (steps, k)), "candidate_probs": ("f", (steps, k)), "chosen_probs": ("f", (steps,)),
        ATTRIBUTION_HEADS: ("f", (steps, model["n_layers"], model["n_heads"])), ATTRIBUTION_LOGITS: ("f", (steps,)),
        ATTRIBUTION_TOP: ("i", (steps, "ranks", 2)), ATTRIBUTION_SOURCES: ("f", (steps, "ranks", n - 1)),
        LENS_IDS: ("i", (steps, model["n_layers"], "lens_k")), LENS_PROBS: ("f", (steps, model["n_layers"], "lens_k")),
        ROUTE_EDGES: ("i", ("route edges", 8)), ROUTE_IMPORTANCE: ("f", ("route edges",)),
        ROUTE_HEADS: ("f", ("route edges", model["n_heads"])),
    }
    unknown = sorted(set(arrays) - set(shapes))
    if unknown:
        raise _Damaged(f"unexpected array(s) {', '.join(unknown)}")
    return shapes


def _check_generation_values(meta: dict[str, Any], arrays: Mapping[str, ArrayLike]) -> None:
    """Finite values; norms non-negative; probabilities in [0, 1]; each kept row ``[layer, head, keys]``
    non-negative and summing to 1 (read one layer at a time)."""
    for name in ("candidate_probs", "chosen_probs"):
        values = np.asarray(arrays[name])
        if not (np.isfinite(values).all() and (values >= 0).all() and (values <= 1).all()):
            raise _Damaged(f"{name} holds a value that is no probability (NaN, infinite, or outside 0..1)")
    for name in (ATTRIBUTION_HEADS, ATTRIBUTION_LOGITS, ATTRIBUTION_SOURCES, LENS_PROBS, ROUTE_IMPORTANCE, ROUTE_HEADS):
        if name in arrays and not np.isfinite(np.asarray(arrays[name])).all():
            raise _Damaged(f"{name} holds NaN or infinite values")
    n, first_row = len(meta["tokens"]), meta.get("first_row", 0)
    starts = np.cumsum([0, *range(first_row + 1, n)])  # where each kept row begins on the packed axis
    if "sink_mass" in arrays and not meta["model"].get("learned_sinks", False):
        raise _Damaged("sink_mass in a record whose model info has no learned sinks")
    sink_mass = arrays.get("sink_mass")
    for name, array in ((name, arrays[name]) for name in ("rows", "value_norms", "sink_mass") if name in arrays):
        for layer in range(array.shape[0]):
            values = np.asarray(array[layer])  # [head, packed or position or row]
            if not np.isfinite(values).all():
                raise _Damaged(f"{name} holds NaN or infinite values (layer {layer}, 0-indexed)")
            if values.size and values.min() < 0:
                raise _Damaged(f"{name} holds negative values (layer {layer}, 0-indexed)")
            if name == "rows":
                _check_packed_rows(layer, values, starts, first_row, row_sum_tolerance(array.dtype, n),
                                   None if sink_mass is None else np.asarray(sink_mass[layer]))


def _check_packed_rows(layer: int, values: np.ndarray, starts: np.ndarray, first_row: int, tolerance: float,
                       sink_mass: np.ndarray | None = None) -> None:
    """Each row of ``values`` ``[head, packed]`` (rows begin at ``starts``) sums to 1 minus its ``sink_mass``
    ``[head, row]`` (None: to 1) within ``tolerance``."""
    sums = np.add.reduceat(values.astype(np.float64), starts, axis=-1)  # [head, row]
    wanted = np.ones_like(sums) if sink_mass is None else 1.0 - sink_mass.astype(np.float64)
    head, row = np.unravel_index(np.argmax(np.abs(sums - wanted)), sums.shape)
    if not math.isclose(sums[head, row], wanted[head, row], abs_tol=tolerance):
        should = "1" if sink_mass is None else "1 minus their sink mass"
        raise _Damaged(f"rows should sum to {should}, layer {layer} head {head} position {first_row + row} sums to "
                       f"{sums[head, row]:.6g}, not {wanted[head, row]:.6g} (0-indexed)")
