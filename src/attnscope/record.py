"""AttentionRecord: everything captured for one input, immutable, saved as one safetensors file.

Axis order is always ``[layer, head, q_pos, k_pos]`` for attention and norms and
``[layer, head, pos, d_head]`` for queries, keys and values. Layers and heads are 0-indexed.

Arrays are kept in one mapping keyed ``"<kind>.<field>"``:

* kinds of attention: ``self`` (encoder-only and decoder-only models), or ``encoder``,
  ``decoder`` and ``cross`` (encoder-decoders; ``cross`` has decoder queries and encoder keys);
* fields: ``attention``, ``norms``, ``queries``, ``keys``, ``values``;
* token arrays: ``input.token_ids``, ``input.special_mask``, ``input.sentence_ids``,
  ``input.word_ids`` and, for encoder-decoders, the same under ``target.``.

The typed properties (``attention``, ``cross_attention``, ...) are the way to read them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from .errors import AttnscopeError
from .record_checks import check_record_parts

FORMAT_VERSION = 1
ATTENTION_KINDS = ("self", "encoder", "decoder", "cross")
QKV_FIELDS = ("queries", "keys", "values")


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

    @property
    def main_kind(self) -> str:
        """The kind of attention of the input side: ``encoder`` or ``self``."""
        return "encoder" if self.is_encoder_decoder else "self"


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

    def __post_init__(self) -> None:
        frozen = {key: _frozen(value) for key, value in self.arrays.items()}
        object.__setattr__(self, "arrays", MappingProxyType(frozen))
        attention = self.arrays.get(f"{self.model.main_kind}.attention")
        if attention is None or attention.ndim != 4:
            raise ValueError("a record needs a 4-D [layer, head, q_pos, k_pos] attention array")
        if attention.shape[-1] != len(self.tokens):
            raise ValueError(f"attention has {attention.shape[-1]} keys but {len(self.tokens)} tokens")

    # ---- typed access -------------------------------------------------------------------
    def get(self, kind: str, field_name: str = "attention") -> np.ndarray | None:
        """The ``field_name`` array of attention ``kind``, or None if it was not captured."""
        return self.arrays.get(f"{kind}.{field_name}")

    @property
    def attention(self) -> np.ndarray:
        """Input-side attention ``[layer, head, q_pos, k_pos]`` (encoder for encoder-decoders)."""
        return self.arrays[f"{self.model.main_kind}.attention"]

    @property
    def norms(self) -> np.ndarray | None:
        """||alpha f(x)|| of Kobayashi et al. 2020, ``[layer, head, q_pos, k_pos]``, if captured."""
        return self.get(self.model.main_kind, "norms")

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
        return int(self.attention.shape[0])

    @property
    def n_heads(self) -> int:
        return int(self.attention.shape[1])

    def __repr__(self) -> str:
        shapes = ", ".join(f"{key}{list(value.shape)}" for key, value in self.arrays.items() if "." in key
                           and key.split(".")[0] in ATTENTION_KINDS)
        return f"AttentionRecord(model={self.model.name!r}, level={self.level!r}, tokens={len(self.tokens)}, {shapes})"

    # ---- save / load --------------------------------------------------------------------
    def save(self, path: str | Path, *, float16: bool = False) -> Path:
        """Write the record to one ``.safetensors`` file (arrays) with JSON metadata in its header.

        ``float16=True`` halves the size; attention keeps about 3 significant digits.
        """
        from safetensors.numpy import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {
            key: value.astype(np.float16) if float16 and value.dtype.kind == "f" else value
            for key, value in self.arrays.items()
        }
        save_file(dict(arrays), str(path), metadata={"attnscope": json.dumps(self._metadata())})
        return path

    def _metadata(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "model": asdict(self.model),
            "tokens": list(self.tokens),
            "target_tokens": None if self.target_tokens is None else list(self.target_tokens),
            "kv_expanded": self.kv_expanded,
            "level": self.level,
            "text": list(self.text),
        }

    @classmethod
    def load(cls, path: str | Path) -> AttentionRecord:
        """Read a record written by :meth:`save`; floating arrays come back as float32."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="numpy") as handle:
                header = (handle.metadata() or {}).get("attnscope")
                arrays = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 - not a dict
        except (OSError, ValueError, RuntimeError, SafetensorError) as error:
            raise AttnscopeError(f"cannot read record {path}: {error}") from None
        meta = check_record_parts(header, arrays, path, FORMAT_VERSION)  # one AttnscopeError line naming the fault
        arrays = {key: v.astype(np.float32) if v.dtype == np.float16 else v for key, v in arrays.items()}
        return cls(
            model=ModelInfo(**meta["model"]),
            tokens=tuple(meta["tokens"]),
            arrays=arrays,
            target_tokens=None if meta["target_tokens"] is None else tuple(meta["target_tokens"]),
            kv_expanded=meta["kv_expanded"],
            level=meta["level"],
            text=tuple(meta["text"]),
        )

    # ---- word level ---------------------------------------------------------------------
    def to_word_level(self) -> AttentionRecord:
        """Aggregate word pieces to words as Clark et al. 2019 do.

        Attention *to* a word is the sum over its pieces; attention *from* a word is the mean over
        its pieces, so rows still sum to 1. Special tokens stay words of their own. Norms are
        aggregated the same way (a sum of norms, an upper bound of the norm of the sum). Queries,
        keys and values have no word-level meaning and are dropped.
        """
        if self.level == "word":
            return self
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
        return replace(self, tokens=words, target_tokens=target_words, arrays=arrays, level="word",
                       kv_expanded=False)


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
    return np.einsum("wq,lhqk,kv->lhwv", mean_rows, matrix.astype(np.float64), sum_cols).astype(np.float32)
