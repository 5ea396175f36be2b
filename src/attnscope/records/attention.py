"""AttentionRecord: everything captured for one input, immutable, saved as one safetensors file.

Axis order is always ``[layer, head, q_pos, k_pos]`` for attention and norms and
``[layer, head, pos, d_head]`` for queries, keys and values. Layers and heads are 0-indexed.

Arrays are kept in one mapping keyed ``"<kind>.<field>"``:

* kinds of attention: ``self`` (encoder-only and decoder-only models), or ``encoder``,
  ``decoder`` and ``cross`` (encoder-decoders; ``cross`` has decoder queries and encoder keys);
* fields: ``attention``, ``norms``, ``queries``, ``keys``, ``values``, and for models with learned
  attention sinks (gpt-oss) ``sink_mass`` ``[layer, head, q_pos]``: the share of each query's softmax
  that went to the sink logit, so that the row's weights over the real keys sum to 1 minus it;
* token arrays: ``input.token_ids``, ``input.special_mask``, ``input.sentence_ids``,
  ``input.word_ids`` and, for encoder-decoders, the same under ``target.``.

The typed properties (``attention``, ``cross_attention``, ...) are the way to read them.

A *partial* record (made with a :class:`~attnscope.capture.plan.CapturePlan`) holds only some
layers, heads and query rows of the input side, and may hold per-row statistics
(``<kind>.stat_<name>``, ``[layer, head, row]``), a distance histogram (``<kind>.distance_histogram``,
``[layer, head, bin]``), the top-k keys per row (``<kind>.topk_indices`` / ``<kind>.topk_weights``,
``[layer, head, row, k]``) and a block-averaged overview (``<kind>.overview``, ``[layer, head,
q_block, k_block]``) instead of, or beside, attention rows. Its ``selection`` says which layers and
heads the leading axes hold and ``query_positions`` which query positions the rows are; consumers
that need the whole matrix get a clear error from ``attention`` rather than a wrong shape.
:meth:`AttentionRecord.open` maps a record file lazily, so a record larger than memory can be browsed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from ..errors import AttnscopeError
from .checks import check_record_parts
from .format import open_arrays, read_attnscope_file, write_attnscope_file

FORMAT_VERSION = 1
ATTENTION_KINDS = ("self", "encoder", "decoder", "cross")
QKV_FIELDS = ("queries", "keys", "values")
HELD_LABELS = {"attention": "attention rows", "norms": "norm-weighted rows", "stat_": "row statistics",
               "distance_histogram": "distance histograms", "topk_": "top-k keys", "overview": "an overview",
               "sentence_attention": "sentence averages", "locality": "locality shares"}


@dataclass(frozen=True)
class Selection:
    """What a partial record holds: ``layers`` and ``heads`` (0-indexed model numbers) index the
    leading axes of its arrays, in this order; ``plan`` is the capture plan that made it
    (:meth:`CapturePlan.describe`)."""

    layers: tuple[int, ...]
    heads: tuple[int, ...]
    plan: Mapping[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        return (f"layers {_ranges(self.layers)}, heads {_ranges(self.heads)}, "
                f"queries {self.plan.get('queries', 'all')}")

    def to_json(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "heads": list(self.heads), "plan": dict(self.plan)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Selection:
        return cls(tuple(data["layers"]), tuple(data["heads"]), dict(data.get("plan", {})))


def _ranges(numbers: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"``."""
    parts: list[str] = []
    for number in numbers:
        if parts and number == int(parts[-1].rpartition("-")[2]) + 1:
            parts[-1] = f"{parts[-1].partition('-')[0]}-{number}"
        else:
            parts.append(str(number))
    return ",".join(parts)


@dataclass(frozen=True)
class ModelInfo:
    """What a record needs to know about the model that produced it."""

    name: str
    model_type: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    causal: bool
    is_encoder_decoder: bool
    scaling: float
    dtype: str = "float32"
    windows: tuple[int, ...] = ()  # per input-side layer: its sliding window in keys, 0 = global; () = none slide
    learned_sinks: bool = False  # a learned sink logit per head (gpt-oss): rows sum to 1 - sink_mass
    chunked: tuple[int, ...] = ()  # input-side layers whose window is a chunk (Llama 4's), not a sliding window

    def __post_init__(self) -> None:
        for name in ("windows", "chunked"):  # JSON gives lists
            object.__setattr__(self, name, tuple(int(w) for w in getattr(self, name)))

    def to_json(self) -> dict[str, Any]:
        """The facts as JSON types (``windows`` and ``chunked`` lists), for record files and view payloads."""
        return {**asdict(self), "windows": list(self.windows), "chunked": list(self.chunked)}

    def window(self, layer: int) -> int:
        """The window of input-side ``layer`` in keys, 0 = all keys: sliding (query q sees q - window + 1 .. q), or
        a chunk where ``layer`` is in ``chunked`` (query q sees (q // window) * window .. q)."""
        return self.windows[layer] if self.windows else 0

    def visible_keys(self, layer: int, n: int) -> np.ndarray:
        """Bool ``[q_pos, k_pos]``: the keys each query of input-side ``layer`` may see on ``n`` tokens."""
        return visible_keys(n, self.causal, self.window(layer), layer in self.chunked)

    @property
    def main_kind(self) -> str:
        """The kind of attention of the input side: ``encoder`` or ``self``."""
        return "encoder" if self.is_encoder_decoder else "self"


def visible_keys(n: int, causal: bool, window: int = 0, chunked: bool = False) -> np.ndarray:
    """Bool ``[q_pos, k_pos]``: which keys each query may see (causal: ``k <= q``; a sliding window: ``|q - k| <
    window``, the keys before a query in a causal model; a chunk: ``q // window == k // window``)."""
    queries, keys = np.arange(n)[:, None], np.arange(n)[None, :]
    visible = keys <= queries if causal else np.ones((n, n), dtype=bool)
    if window and chunked:
        visible &= queries // window == keys // window
    elif window:
        visible &= np.abs(queries - keys) < window
    return visible


def _frozen(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array)
    array.flags.writeable = False
    return array


@dataclass(frozen=True, eq=False)
class AttentionRecord:
    """The attention of every layer and head of one model on one input.

    ``tokens`` are the word pieces as a person reads them (``##berries``); ``target_tokens`` the
    decoder's input for encoder-decoders. ``level`` is ``"token"`` or ``"word"`` (after
    :meth:`to_word_level`). ``kv_expanded`` says that grouped key/value heads were repeated so
    that ``keys``/``values`` have one entry per query head (head ``h`` uses kv head
    ``h // (n_heads // n_kv_heads)``).

    >>> rec.attention.shape            # doctest: +SKIP
    (6, 12, 9, 9)                      # [layer, head, q_pos, k_pos]
    """

    model: ModelInfo
    tokens: tuple[str, ...]
    arrays: Mapping[str, np.ndarray]
    target_tokens: tuple[str, ...] | None = None
    kv_expanded: bool = False
    level: str = "token"
    text: tuple[str, ...] = field(default=())
    selection: Selection | None = None

    def __post_init__(self) -> None:
        frozen = {key: _frozen(value) for key, value in self.arrays.items()}
        object.__setattr__(self, "arrays", MappingProxyType(frozen))
        main = self.model.main_kind
        attention = self.arrays.get(f"{main}.attention")
        if attention is None and self.selection is None:
            raise ValueError("a record needs a 4-D [layer, head, q_pos, k_pos] attention array")
        if attention is None and not any(key.startswith(f"{main}.") for key in self.arrays):
            raise ValueError("a partial record needs attention rows, statistics, top-k keys or an overview")
        if attention is not None and attention.ndim != 4:
            raise ValueError("a record needs a 4-D [layer, head, q_pos, k_pos] attention array")
        if attention is not None and attention.shape[-1] != len(self.tokens):
            raise ValueError(f"attention has {attention.shape[-1]} keys but {len(self.tokens)} tokens")

    # ---- what a partial record holds --------------------------------------------------------
    @property
    def is_partial(self) -> bool:
        """True when the record holds only part of the attention (see :attr:`selection`)."""
        return self.selection is not None

    @property
    def layers_held(self) -> tuple[int, ...]:
        """The 0-indexed layers the leading axis of the input side's arrays holds."""
        return self.selection.layers if self.selection else tuple(range(self.model.n_layers))

    @property
    def heads_held(self) -> tuple[int, ...]:
        return self.selection.heads if self.selection else tuple(range(self.model.n_heads))

    @property
    def query_positions(self) -> np.ndarray:
        """The query positions of the rows held, ``[row]`` (every position in a complete record)."""
        held = self.arrays.get("input.query_positions")
        return held if held is not None else np.arange(len(self.tokens))

    def held(self, field_name: str = "attention") -> np.ndarray:
        """The input side's ``field_name`` array as stored: for a partial record its axes are the
        held layers, heads and rows (``[layer, head, row, ...]``); see :attr:`layers_held`."""
        array = self.get(self.model.main_kind, field_name)
        if array is None:
            raise AttnscopeError(f"this record holds no {field_name.replace('_', ' ')} "
                                 f"({self.holdings()}); capture it with a plan that keeps it")
        return array

    def head_rows(self, layer: int, head: int, field_name: str = "attention") -> np.ndarray:
        """Held rows of one head, ``[row, ...]`` (rows at :attr:`query_positions`), by model numbers."""
        layer_index, head_index = self._held_index(layer, head)
        return self.held(field_name)[layer_index, head_index]

    def _held_index(self, layer: int, head: int) -> tuple[int, int]:
        if layer not in self.layers_held or head not in self.heads_held:
            raise AttnscopeError(f"layer {layer} head {head} is not in this record ({self.holdings()})")
        return self.layers_held.index(layer), self.heads_held.index(head)

    @property
    def statistics(self) -> dict[str, np.ndarray]:
        """Per-row statistics of a planned capture, name -> ``[layer, head, row]`` (empty if none)."""
        prefix = f"{self.model.main_kind}.stat_"
        return {key[len(prefix):]: value for key, value in self.arrays.items() if key.startswith(prefix)}

    def holdings(self) -> str:
        """One line saying what the record holds."""
        if self.selection is None:
            return "complete: every layer, head and query"
        fields = {key.split(".", 1)[1] for key in self.arrays if key.startswith(f"{self.model.main_kind}.")}
        kept = [label for prefix, label in HELD_LABELS.items() if any(f.startswith(prefix) for f in fields)]
        return f"partial: {self.selection.describe()}; holds {', '.join(kept)}"

    def require_complete(self, purpose: str) -> None:
        """Raise a clear error when ``purpose`` needs the whole matrix and this record is partial."""
        if self.selection is not None:
            raise AttnscopeError(f"{purpose} needs every layer, head and query of the attention matrix, but this "
                                 f"record is {self.holdings()}; capture it without a plan, or use the long view "
                                 "(attnscope view --long)")

    # ---- typed access -------------------------------------------------------------------
    def get(self, kind: str, field_name: str = "attention") -> np.ndarray | None:
        """The ``field_name`` array of attention ``kind``, or None if it was not captured."""
        return self.arrays.get(f"{kind}.{field_name}")

    @property
    def attention(self) -> np.ndarray:
        """Input-side attention ``[layer, head, q_pos, k_pos]`` (encoder for encoder-decoders).

        A partial record refuses (it would not have that shape): use :meth:`held` or :meth:`head_rows`.
        """
        self.require_complete("this use of record.attention")
        return self.arrays[f"{self.model.main_kind}.attention"]

    @property
    def norms(self) -> np.ndarray | None:
        """||alpha f(x)|| of Kobayashi et al. 2020, ``[layer, head, q_pos, k_pos]``, if captured."""
        return self.get(self.model.main_kind, "norms")

    @property
    def sink_mass(self) -> np.ndarray | None:
        """Learned sinks' share of each query's softmax (gpt-oss), ``[layer, head, q_pos]`` (for a partial
        record ``[layer, head, row]``): each attention row sums to 1 minus it. None for a model without them."""
        return self.get(self.model.main_kind, "sink_mass")

    def row_mass(self, kind: str | None = None) -> np.ndarray | None:
        """What each attention row of ``kind`` (default: the input side) sums to, ``[layer, head, q_pos]``:
        1 minus the sink mass for a model with learned sinks, None (every row sums to 1) otherwise."""
        sink_mass = self.get(kind or self.model.main_kind, "sink_mass")
        return None if sink_mass is None else 1.0 - sink_mass

    @property
    def queries(self) -> np.ndarray | None:
        """Per-head queries ``[layer, head, pos, d_head]`` (after rotary embeddings), if captured."""
        return self.get(self.model.main_kind, "queries")

    @property
    def keys(self) -> np.ndarray | None:
        """Per-head keys ``[layer, head, pos, d_head]``, expanded to query heads, if captured."""
        return self.get(self.model.main_kind, "keys")

    @property
    def values(self) -> np.ndarray | None:
        """Per-head values ``[layer, head, pos, d_head]``, expanded to query heads, if captured."""
        return self.get(self.model.main_kind, "values")

    @property
    def decoder_attention(self) -> np.ndarray | None:
        """Decoder self-attention ``[layer, head, q_pos, k_pos]`` of encoder-decoders."""
        return self.get("decoder")

    @property
    def cross_attention(self) -> np.ndarray | None:
        """Cross-attention ``[layer, head, target_pos, input_pos]`` of encoder-decoders."""
        return self.get("cross")

    @property
    def token_ids(self) -> np.ndarray:
        return self.arrays["input.token_ids"]

    @property
    def special_mask(self) -> np.ndarray:
        """True for special tokens such as [CLS], [SEP], <s>."""
        return self.arrays["input.special_mask"]

    @property
    def sentence_ids(self) -> np.ndarray:
        """0 for the first sentence, 1 for the second of a pair; specials join the sentence they close."""
        return self.arrays["input.sentence_ids"]

    @property
    def word_ids(self) -> np.ndarray:
        """Index of the word each token belongs to (numbered across both sentences); -1 for specials."""
        return self.arrays["input.word_ids"]

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds of attention this record holds, e.g. ``("encoder", "decoder", "cross")``."""
        return tuple(kind for kind in ATTENTION_KINDS if f"{kind}.attention" in self.arrays)

    @property
    def n_layers(self) -> int:
        """The model's number of layers (a partial record holds :attr:`layers_held` of them)."""
        return int(self.attention.shape[0]) if self.selection is None else self.model.n_layers

    @property
    def n_heads(self) -> int:
        return int(self.attention.shape[1]) if self.selection is None else self.model.n_heads

    def __repr__(self) -> str:
        shapes = ", ".join(f"{key}{list(value.shape)}" for key, value in self.arrays.items() if "." in key
                           and key.split(".")[0] in ATTENTION_KINDS)
        partial = f", {self.holdings()}" if self.selection else ""
        return (f"AttentionRecord(model={self.model.name!r}, level={self.level!r}, tokens={len(self.tokens)}, "
                f"{shapes}{partial})")

    @classmethod
    def from_attentions(cls, attentions: Any, tokens: Sequence[str], **options: Any) -> AttentionRecord:
        """A record of attention computed elsewhere: ``outputs.attentions`` of a transformers model
        called with ``output_attentions=True`` (a tuple of ``[batch, head, q_pos, k_pos]``), the whole
        output of an encoder-decoder (with ``target_tokens=``), or a TransformerLens ActivationCache's
        ``blocks.{layer}.attn.hook_pattern`` entries. Options: see :func:`attnscope.records.external.record_parts`.

        >>> out = hf_model(**inputs, output_attentions=True)                      # doctest: +SKIP
        >>> rec = AttentionRecord.from_attentions(out.attentions, tokens)         # doctest: +SKIP
        """
        from .external import record_parts

        parts = record_parts(attentions, tokens, **options)
        return cls(**{**parts, "model": ModelInfo(**parts["model"])})

    # ---- save / load --------------------------------------------------------------------
    def save(self, path: str | Path, *, float16: bool = False) -> Path:
        """Write the record to one ``.safetensors`` file (arrays) with JSON metadata in its header.

        ``float16=True`` halves the size; attention keeps about 3 significant digits.
        """
        arrays = {
            key: value.astype(np.float16) if float16 and value.dtype.kind == "f" else value
            for key, value in self.arrays.items()
        }
        return write_attnscope_file(path, arrays, self._metadata())

    def _metadata(self) -> dict[str, Any]:
        return record_metadata(self.model, self.tokens, target_tokens=self.target_tokens, kv_expanded=self.kv_expanded,
                               level=self.level, text=self.text, selection=self.selection)

    @classmethod
    def load(cls, path: str | Path) -> AttentionRecord:
        """Read a record written by :meth:`save`; floating arrays come back as float32."""
        header, arrays = read_attnscope_file(path, "record")
        meta = check_record_parts(header, arrays, path, FORMAT_VERSION)  # one AttnscopeError line naming the fault
        arrays = {key: v.astype(np.float32) if v.dtype == np.float16 else v for key, v in arrays.items()}
        return cls._from_parts(meta, arrays)

    @classmethod
    def open(cls, path: str | Path, *, values: bool = False) -> AttentionRecord:
        """Map a record file lazily: arrays are read from disk only where they are indexed.

        For records larger than memory (``attnscope extract --stream``). Arrays keep the stored
        dtype (float16 stays float16); slicing one head of one layer reads only its pages. The
        metadata, names, dtypes, shapes and the file's size are checked; ``values=True`` also checks
        what :meth:`load` does (finite values, rows summing to 1), reading one layer at a time:
        for a record about to be drawn.
        """
        header, arrays = open_arrays(Path(path))
        meta = check_record_parts(header, arrays, path, FORMAT_VERSION, values=values)
        return cls._from_parts(meta, arrays)

    @classmethod
    def _from_parts(cls, meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> AttentionRecord:
        selection = meta.get("selection")
        return cls(
            model=ModelInfo(**meta["model"]),
            tokens=tuple(meta["tokens"]),
            arrays=arrays,
            target_tokens=None if meta["target_tokens"] is None else tuple(meta["target_tokens"]),
            kv_expanded=meta["kv_expanded"],
            level=meta["level"],
            text=tuple(meta["text"]),
            selection=None if selection is None else Selection.from_json(selection),
        )

    # ---- word level ---------------------------------------------------------------------
    def to_word_level(self) -> AttentionRecord:
        """Aggregate word pieces to words as Clark et al. 2019 do.

        Attention *to* a word is the sum over its pieces; attention *from* a word is the mean over
        its pieces, so rows still sum to 1 (1 minus the sink mass, whose mean over the pieces is kept, for a
        model with learned sinks). Special tokens stay words of their own. Norms are
        aggregated the same way (a sum of norms, an upper bound of the norm of the sum). Queries,
        keys and values have no word-level meaning and are dropped.
        """
        if self.level == "word":
            return self
        self.require_complete("word-level aggregation")
        input_groups = word_groups(self.word_ids)
        words = join_pieces(self.tokens, input_groups)
        arrays: dict[str, np.ndarray] = {
            "input.token_ids": np.array([self.token_ids[g[0]] for g in input_groups]),
            "input.special_mask": np.array([bool(self.special_mask[g[0]]) for g in input_groups]),
            "input.sentence_ids": np.array([self.sentence_ids[g[0]] for g in input_groups]),
            "input.word_ids": _word_level_ids(self.special_mask, input_groups),
        }
        target_words = None
        target_groups = input_groups
        if self.target_tokens is not None:
            target_groups = word_groups(self.arrays["target.word_ids"])
            target_words = join_pieces(self.target_tokens, target_groups)
            for name in ("token_ids", "special_mask", "sentence_ids"):
                arrays[f"target.{name}"] = np.array([self.arrays[f"target.{name}"][g[0]] for g in target_groups])
            arrays["target.word_ids"] = _word_level_ids(self.arrays["target.special_mask"], target_groups)
        groups_by_kind = {
            "self": (input_groups, input_groups),
            "encoder": (input_groups, input_groups),
            "decoder": (target_groups, target_groups),
            "cross": (target_groups, input_groups),
        }
        for kind in self.kinds:
            query_groups, key_groups = groups_by_kind[kind]
            for field_name in ("attention", "norms"):
                matrix = self.get(kind, field_name)
                if matrix is not None:
                    arrays[f"{kind}.{field_name}"] = aggregate_to_words(matrix, query_groups, key_groups)
            sink_mass = self.get(kind, "sink_mass")  # [layer, head, q_tok]: a mean over each word's pieces
            if sink_mass is not None:
                arrays[f"{kind}.sink_mass"] = np.stack([sink_mass[..., g].mean(-1) for g in query_groups], axis=-1)
        return replace(self, tokens=words, target_tokens=target_words, arrays=arrays, level="word",
                       kv_expanded=False)




def record_metadata(model: ModelInfo, tokens: tuple[str, ...], *, target_tokens: tuple[str, ...] | None = None,
                    kv_expanded: bool = False, level: str = "token", text: tuple[str, ...] = (),
                    selection: Selection | None = None) -> dict[str, Any]:
    """The JSON metadata a record file carries beside its arrays."""
    return {
        "format_version": FORMAT_VERSION,
        "model": model.to_json(),
        "tokens": list(tokens),
        "target_tokens": None if target_tokens is None else list(target_tokens),
        "kv_expanded": kv_expanded,
        "level": level,
        "text": list(text),
        "selection": None if selection is None else selection.to_json(),
    }


def _word_level_ids(special_mask: np.ndarray, groups: list[list[int]]) -> np.ndarray:
    """Word ids of a word-level record: each word its own index, specials -1 as at token level."""
    return np.array([-1 if special_mask[g[0]] else i for i, g in enumerate(groups)], dtype=np.int64)


def word_groups(word_ids: np.ndarray) -> list[list[int]]:
    """Token positions grouped by word, in order; every special token (id -1) is its own group.

    >>> word_groups(np.array([-1, 0, 1, 1, -1]))
    [[0], [1], [2, 3], [4]]
    """
    groups: list[list[int]] = []
    previous: int | None = None
    for position, word in enumerate(int(w) for w in word_ids):
        if word >= 0 and word == previous:
            groups[-1].append(position)
        else:
            groups.append([position])
        previous = word if word >= 0 else None
    return groups


def join_pieces(tokens: tuple[str, ...], groups: list[list[int]]) -> tuple[str, ...]:
    """Glue each group's pieces into a word: ``##`` continuations lose their marks, others are concatenated."""
    words = []
    for group in groups:
        pieces = [tokens[i][2:] if j and tokens[i].startswith("##") else tokens[i] for j, i in enumerate(group)]
        words.append("".join(pieces).strip() or "".join(pieces))
    return tuple(words)


def aggregate_to_words(matrix: np.ndarray, query_groups: list[list[int]], key_groups: list[list[int]]) -> np.ndarray:
    """``[layer, head, q_tok, k_tok]`` -> ``[layer, head, q_word, k_word]``: mean over query pieces, sum over key pieces."""
    n_q_tokens, n_k_tokens = matrix.shape[-2:]
    mean_rows = np.zeros((len(query_groups), n_q_tokens), dtype=np.float64)  # [q_word, q_tok]
    for word, group in enumerate(query_groups):
        mean_rows[word, group] = 1.0 / len(group)
    sum_cols = np.zeros((n_k_tokens, len(key_groups)), dtype=np.float64)  # [k_tok, k_word]
    for word, group in enumerate(key_groups):
        sum_cols[group, word] = 1.0
    # two matrix products (not one 3-operand einsum, which loops over every index at once: hours on a 512-token window)
    return (mean_rows @ matrix.astype(np.float64) @ sum_cols).astype(np.float32)  # [layer, head, q_word, k_word]
