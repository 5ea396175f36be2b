"""Context-mixing measures: how much each token's representation after a layer draws on each input
token of that layer, and the same aggregated across layers.

Every measure here works on tensors of one input (:class:`LayerTensors`, captured by
``attnscope.experiments.mixing``), never on a model. Per layer ``l`` the map ``M[l][i, j]`` says how
much query (output) position ``i`` takes from key (input) position ``j``:

* ``attention``: the attention weights ``A^h[i, j]``; the layer map is their mean over heads.
* ``norm`` (Kobayashi et al. 2020): ``||A^h[i, j] f^h(x_j)||`` per head, where
  ``f^h(x_j) = v_j^h W_O^h`` is token j's value transformed by head h's slice of the output
  projection; the layer map is ``||sum_h A^h[i, j] f^h(x_j)||``. Not normalised (as in the paper).
  A model that gates its heads' output before the output projection (Qwen3-Next's gated attention)
  adds ``A^h[i, j] (g^h_i * v_j^h) W_O^h`` for key j, the gate ``g^h_i`` of query i applied per channel:
  with a gate (``LayerTensors.gate``) every measure below uses that vector in place of ``A f``.
* ``norm_residual`` = GlobEnc (Modarressi et al. 2022): the attention block's output decomposed per
  input token, residual and layer norms included. Token i's residual joins its own term; a LayerNorm
  ``LN(u) = g * (u - mean(u)) / s + b`` of a sum ``u = sum_j z_j`` is split as
  ``g * (z_j - mean(z_j)) / s`` with ``s`` the scale of the whole sum (Kobayashi et al. 2021), and
  for post-LN layers the second LayerNorm is applied the same way with the feed-forward sublayer
  left out (its output only enters through ``s``). The map is the norm of each token's term, rows
  normalised to sum to 1.
* ``alti`` (Ferrando et al. 2022): the same per-token terms ``T_i(x_j)`` of the attention block's
  output ``y_i`` (through the first LayerNorm only), scored by their Manhattan closeness to
  ``y_i``: ``c[i, j] = max(0, ||y_i||_1 - ||y_i - T_i(x_j)||_1)``, rows normalised.
* ``value_zeroing`` (Mohebbi et al. 2023): the cosine distance between the layer's output at
  position i and the same output recomputed with token j's value vector zeroed in every head, rows
  normalised. The distances come from the model (an intervention); :func:`value_zeroing_map`
  only normalises them.

Aggregation across layers is rollout (Abnar & Zuidema 2020): ``R[l] = M_hat[l] @ R[l - 1]``. For
``attention`` and ``norm``, which leave out the residual stream, ``M_hat = 0.5 * M + 0.5 * I`` with
``M`` row-normalised, as in the rollout paper; the other measures already hold the residual, so
``M_hat`` is their row-normalised map (as GlobEnc and ALTI aggregate). Layers are 0-indexed.
For causal models every map is lower-triangular.

Each measure is one registered :class:`~attnscope.analysis.measures.Measure` (name, label,
reference, rollout rule, compute function), registered at the end of this module; ``METHODS``,
``METHOD_ALIASES``, ``REFERENCES`` and ``ROLLOUT_RESIDUAL`` are views of that registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import AttnscopeError
from .measures import (  # the registry, read through this module (which registers the built-ins at its end)
    AliasView,
    Compute,
    Measure,
    MeasureField,
    get_measure,
    measure_choices,
    measures,
    measures_help,
    method_name,
    method_names,
    register_measure,
    unregister_measure,
)
from .rollout import attention_rollout, sink_on_diagonal

__all__ = [  # what this module offers: its own names, and the registry's (read through here)
    "METHODS",
    "METHOD_ALIASES",
    "REFERENCES",
    "ROLLOUT_RESIDUAL",
    "TERM_ELEMENTS",
    "LayerTensors",
    "Measure",
    "Mixing",
    "NormFacts",
    "alti_map",
    "attention_maps",
    "block_terms",
    "gated_norms",
    "get_measure",
    "globenc_map",
    "head_terms",
    "measure_choices",
    "measures",
    "measures_help",
    "method_name",
    "method_names",
    "mixing_from_record",
    "mixing_from_tensors",
    "norm_maps",
    "normalise_rows",
    "register_measure",
    "rollout_of",
    "unregister_measure",
    "value_zeroing_map",
]

# The old tables, now read from the registry (attnscope.analysis.measures); the measures themselves
# are registered at the end of this module, beside their compute functions.
REFERENCES: Mapping[str, str] = MeasureField("reference")
ROLLOUT_RESIDUAL: Mapping[str, float] = MeasureField("rollout_residual")
METHOD_ALIASES: Mapping[str, str] = AliasView()


@dataclass(frozen=True, eq=False)
class NormFacts:
    """A LayerNorm applied to a sum of per-token terms: ``weight``/``bias`` ``[d_model]``, and ``scale``
    ``[q_pos]`` = sqrt(var(u_i) + eps) of the norm's actual input ``u_i`` at each position."""

    weight: np.ndarray
    bias: np.ndarray
    scale: np.ndarray


@dataclass(frozen=True, eq=False)
class LayerTensors:
    """One attention layer on one input, as the measures read it (float64).

    ``attention`` ``[head, q_pos, k_pos]``; ``transformed`` ``[head, k_pos, d_model]`` = f^h(x_j)
    (value bias included, output bias not); ``out_bias`` ``[d_model]``; ``residual`` ``[q_pos,
    d_model]`` = the layer's input, which the residual connection adds to the attention output;
    ``after_attention``/``after_ffn``: the post-LN layer norms (None in pre-LN layers). A model with an output
    gate adds ``gate`` ``[head, q_pos, d_head]``, with ``values`` ``[head, k_pos, d_head]`` and ``out_proj``
    ``[head, d_head, d_model]`` (``transformed = values @ out_proj``): head h adds
    ``A^h[i, j] (gate[h, i] * values[h, j]) @ out_proj[h]`` for key j at query i.
    """

    attention: np.ndarray
    transformed: np.ndarray
    out_bias: np.ndarray
    residual: np.ndarray
    after_attention: NormFacts | None = None
    after_ffn: NormFacts | None = None
    gate: np.ndarray | None = None
    values: np.ndarray | None = None
    out_proj: np.ndarray | None = None


def attention_maps(layer: LayerTensors) -> tuple[np.ndarray, np.ndarray]:
    """Per head ``[head, q_pos, k_pos]`` and the layer's head mean ``[q_pos, k_pos]``."""
    return layer.attention, layer.attention.mean(axis=0)


def head_terms(layer: LayerTensors) -> np.ndarray:
    """``A^h[i, j] f^h(x_j)`` for every head (gated: ``A^h[i, j] (g^h_i * v^h_j) W_O^h``): ``[head, q_pos, k_pos,
    d_model]``."""
    if layer.gate is None:
        return layer.attention[..., None] * layer.transformed[:, None, :, :]
    assert layer.values is not None and layer.out_proj is not None  # a gated layer carries both
    gated = layer.gate[:, :, None, :] * layer.values[:, None, :, :]  # [head, q_pos, k_pos, d_head]
    return layer.attention[..., None] * np.einsum("hqkd,hdm->hqkm", gated, layer.out_proj)


def gated_norms(layer: LayerTensors) -> np.ndarray:
    """``||(g^h_i * v^h_j) W_O^h||``: ``[head, q_pos, k_pos]``, from the quadratic form of ``W_O^h W_O^h^T``."""
    assert layer.gate is not None and layer.values is not None and layer.out_proj is not None
    gram = np.einsum("hdm,hem->hde", layer.out_proj, layer.out_proj)  # [head, d_head, d_head]
    gated = layer.gate[:, :, None, :] * layer.values[:, None, :, :]  # [head, q_pos, k_pos, d_head]
    return np.sqrt(np.maximum(np.einsum("hqkd,hde,hqke->hqk", gated, gram, gated), 0.0))


# float64 terms [key, query, d_model] held at once (128 MB): long inputs are measured key chunk by key chunk
TERM_ELEMENTS = 1 << 24


@dataclass(frozen=True, eq=False)
class _Folded:
    """A layer's per-token terms ``T[i, j] = sum_h weights[j, i, h] vectors[j, h] + [i == j] residual[i]``.

    LayerNorms are linear in their input but for the scale, which belongs to the whole sum, so
    their linear part (centring, then the weight) is applied once to each vector, and the inverse of
    their scales (one per query) once to the attention weights, instead of to every ``[q, k, d]``
    term. ``weights`` ``[k_pos, q_pos, head]``, ``vectors`` ``[k_pos, head, d_model]`` (the batched
    matmul's layout), ``residual`` ``[q_pos, d_model]`` or None (a measure without the residual).
    """

    weights: np.ndarray
    vectors: np.ndarray
    residual: np.ndarray | None
    gated: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # gate [h, q, d], values [k, h, d], W [h*d, D]


def _matmul(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """``left @ right`` through torch, whose thread count the caller sets (numpy's BLAS starts its own
    threads, which stall on a busy 2-core machine: 10x slower measured)."""
    import torch  # here: the CLI reads METHODS from this module before it needs torch

    return (torch.from_numpy(left) @ torch.from_numpy(right)).numpy()


def _linear_part(vectors: np.ndarray, norm: NormFacts) -> np.ndarray:
    """What a LayerNorm does to one term of its input's sum: centred, times its weight ``[..., d_model]``."""
    return norm.weight * (vectors - vectors.mean(-1, keepdims=True))


def _fold(layer: LayerTensors, norms: Sequence[NormFacts], residual: bool = True) -> _Folded:
    """The layer's terms through ``norms`` (in order), with or without the residual (see :class:`_Folded`)."""
    transformed, kept = layer.transformed, layer.residual
    scale = np.ones(layer.attention.shape[1])
    for norm in norms:
        transformed, kept, scale = _linear_part(transformed, norm), _linear_part(kept, norm), scale * norm.scale
    weights = np.ascontiguousarray((layer.attention / scale[None, :, None]).transpose(2, 1, 0))
    gated = None
    if layer.gate is not None:  # the norms' linear part acts on d_model: on the projection's rows
        assert layer.values is not None and layer.out_proj is not None  # a gated layer carries both
        projection = layer.out_proj.reshape(-1, layer.out_proj.shape[-1])  # [head * d_head, d_model]
        for norm in norms:
            projection = _linear_part(projection, norm)
        gated = (layer.gate, np.ascontiguousarray(layer.values.transpose(1, 0, 2)), projection)
    return _Folded(weights, np.ascontiguousarray(transformed.transpose(1, 0, 2)),
                   kept / scale[:, None] if residual else None, gated)


def _term_chunks(folded: _Folded) -> Iterator[tuple[slice, np.ndarray]]:
    """The terms key chunk by key chunk: ``(keys, terms [key in chunk, q_pos, d_model])``."""
    n_keys, n_queries, _ = folded.weights.shape
    width = folded.vectors.shape[-1] if folded.gated is None else max(folded.gated[2].shape)
    step = max(1, TERM_ELEMENTS // (n_queries * width))
    for start in range(0, n_keys, step):
        keys = slice(start, min(n_keys, start + step))
        if folded.gated is None:
            terms = _matmul(folded.weights[keys], folded.vectors[keys])
        else:  # sum_h A[h, i, j] (g[h, i] * v[h, j]) W_O^h, as one product over (head, channel)
            gate, values, projection = folded.gated
            scaled = np.einsum("kqh,hqd,khd->kqhd", folded.weights[keys], gate, values[keys])
            terms = _matmul(np.ascontiguousarray(scaled.reshape(*scaled.shape[:2], -1)), projection)
        if folded.residual is not None:  # token i's own term holds its residual
            own = np.arange(keys.start, keys.stop)
            terms[own - start, own] += folded.residual[own]
        yield keys, terms


def _chunked_map(folded: _Folded, score: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``[q_pos, k_pos]`` from ``score(terms [key, q_pos, d_model]) -> [key, q_pos]`` over the key chunks."""
    n_keys, n_queries, _ = folded.weights.shape
    result = np.empty((n_queries, n_keys))
    for keys, terms in _term_chunks(folded):
        result[:, keys] = score(terms).T
    return result


def _euclidean(terms: np.ndarray) -> np.ndarray:
    return np.sqrt(np.einsum("kqd,kqd->kq", terms, terms))


def norm_maps(layer: LayerTensors) -> tuple[np.ndarray, np.ndarray]:
    """Kobayashi et al.'s norms: per head ``[head, q_pos, k_pos]`` and of the head sum ``[q_pos, k_pos]``."""
    sizes = (np.linalg.norm(layer.transformed, axis=-1)[:, None, :] if layer.gate is None  # [head, 1 or q, k]
             else gated_norms(layer))
    return layer.attention * sizes, _chunked_map(_fold(layer, (), residual=False), _euclidean)


def _first_norm(layer: LayerTensors) -> tuple[NormFacts, ...]:
    return () if layer.after_attention is None else (layer.after_attention,)


def _unowned(layer: LayerTensors) -> np.ndarray:
    """The part of the attention block's output no token owns ``[q_pos, d_model]``: the output bias
    (through the first LayerNorm, whose bias joins it, in post-LN layers)."""
    bias = np.broadcast_to(layer.out_bias, layer.residual.shape)
    norm = layer.after_attention
    return bias.copy() if norm is None else _linear_part(bias, norm) / norm.scale[:, None] + norm.bias


def block_terms(layer: LayerTensors) -> tuple[np.ndarray, np.ndarray]:
    """The attention block's output decomposed per input token (ALTI's ``T_i(x_j)``).

    Returns the terms ``[q_pos, k_pos, d_model]`` (sum over heads of ``A^h[i, j] f^h(x_j)``, plus
    ``x_i`` on the diagonal, through the first LayerNorm in post-LN layers) and the part no token
    owns ``[q_pos, d_model]``. ``terms.sum(1) + rest`` is the block's output: after the first
    LayerNorm in post-LN layers, residual + attention in pre-LN layers. (The measures never build
    this whole array; they go key chunk by key chunk.)
    """
    chunks = [terms for _, terms in _term_chunks(_fold(layer, _first_norm(layer)))]
    return np.concatenate(chunks).transpose(1, 0, 2), _unowned(layer)


def normalise_rows(matrix: np.ndarray) -> np.ndarray:
    """Rows scaled to sum to 1 (an all-zero row stays 0): ``[..., q_pos, k_pos]``."""
    totals = matrix.sum(axis=-1, keepdims=True)
    return np.divide(matrix, totals, out=np.zeros_like(matrix), where=totals > 0)


def globenc_map(layer: LayerTensors) -> np.ndarray:
    """GlobEnc's per-layer map ``[q_pos, k_pos]``, rows summing to 1 (see the module docstring): the
    second LayerNorm (post-LN layers) bypasses the feed-forward sublayer."""
    norms = _first_norm(layer) + (() if layer.after_ffn is None else (layer.after_ffn,))
    return normalise_rows(_chunked_map(_fold(layer, norms), _euclidean))


def alti_map(layer: LayerTensors) -> np.ndarray:
    """ALTI's per-layer contributions ``[q_pos, k_pos]``, rows summing to 1 (see the module docstring)."""
    folded = _fold(layer, _first_norm(layer))
    # y_i = sum_j T_i(x_j) + the unowned part: one product [q, (k, head)] @ [(k, head), d]
    n_keys, n_queries, n_heads = folded.weights.shape
    by_query = np.ascontiguousarray(folded.weights.transpose(1, 0, 2)).reshape(n_queries, n_keys * n_heads)
    output = _matmul(by_query, folded.vectors.reshape(n_keys * n_heads, -1))
    output += _unowned(layer) + (0.0 if folded.residual is None else folded.residual)
    size = np.abs(output).sum(-1)  # ||y_i||_1, [q_pos]

    def closeness(terms: np.ndarray) -> np.ndarray:  # in place: the chunk is not read again
        distance = np.abs(np.subtract(output[None], terms, out=terms), out=terms).sum(-1)
        return size - distance

    return normalise_rows(np.maximum(_chunked_map(folded, closeness), 0.0))


def value_zeroing_map(distances: np.ndarray) -> np.ndarray:
    """Cosine distances ``[q_pos, k_pos]`` (output i with token j's value zeroed) -> rows summing to 1."""
    return normalise_rows(np.clip(distances, 0.0, None))


@dataclass(frozen=True, eq=False)
class Mixing:
    """One context-mixing measure on one input.

    ``layers`` ``[layer, q_pos, k_pos]``: each layer's map; ``heads`` ``[layer, head, q_pos, k_pos]``
    for the measures defined per head (``attention``, ``norm``; else None); ``rollout``
    ``[layer, q_pos, k_pos]``: the maps aggregated through layer ``l`` (rows sum to 1).
    Layers and heads are 0-indexed.

    >>> mix = attnscope.mixing("minilm", "The cat sat.", method="alti")   # doctest: +SKIP
    >>> mix.rollout[-1].sum(-1)                                        # doctest: +SKIP
    array([1., 1., 1., 1., 1., 1.])
    """

    method: str
    tokens: tuple[str, ...]
    layers: np.ndarray
    rollout: np.ndarray
    heads: np.ndarray | None = None
    model: str = ""
    causal: bool = False

    @property
    def n_layers(self) -> int:
        return int(self.layers.shape[0])

    def output_shares(self) -> np.ndarray:
        """Each input token's share of the output ``[k_pos]`` (sums to 1), from the rollout through the
        last layer: its rows' mean for an encoder (the output is mean-pooled), the last row for a causal
        model (the output is the next-token prediction)."""
        rolled = self.rollout[-1]
        return rolled[-1] if self.causal else rolled.mean(axis=0)

    def to_frame(self) -> Any:
        """Long format: ``layer``, ``q_pos``, ``k_pos``, ``query``, ``key``, ``value`` (the layer's map), ``rollout``."""
        import pandas as pd

        layer, q, k = np.indices(self.layers.shape)
        tokens = np.array(self.tokens, dtype=object)
        return pd.DataFrame({"method": self.method, "layer": layer.ravel(), "q_pos": q.ravel(), "k_pos": k.ravel(),
                             "query": tokens[q.ravel()], "key": tokens[k.ravel()], "value": self.layers.ravel(),
                             "rollout": self.rollout.ravel()})

    def plot(self, layer: int = -1, *, aggregated: bool = True) -> Any:
        """A heatmap of the rollout through ``layer`` (or, with ``aggregated=False``, that layer's map)."""
        from .figures import map_figure

        index = range(self.n_layers)[layer]
        matrix = self.rollout[index] if aggregated else self.layers[index]
        what = "rollout through" if aggregated else "map of"
        return map_figure(matrix, self.tokens, f"{self.method} ({REFERENCES[self.method]}): {what} layer {index} "
                          "(0-indexed)")

    def __repr__(self) -> str:
        return f"Mixing({self.method!r}, model={self.model!r}, layers={self.n_layers}, tokens={len(self.tokens)})"


def rollout_of(method: str, layer_maps: np.ndarray) -> np.ndarray:
    """Rollout ``[layer, q_pos, k_pos]`` of a measure's layer maps (see the module docstring)."""
    return attention_rollout(normalise_rows(layer_maps), residual=get_measure(method).rollout_residual).matrix


def mixing_from_tensors(method: str, layers: Sequence[LayerTensors], tokens: Sequence[str], model: str = "",
                        distances: np.ndarray | None = None, causal: bool = False) -> Mixing:
    """The measure ``method`` from captured layers (an intervention such as value zeroing also needs
    ``distances`` ``[layer, q_pos, k_pos]`` from the model)."""
    measure = get_measure(method)
    maps, heads = measure.compute(layers, distances)
    return Mixing(measure.name, tuple(tokens), maps, rollout_of(measure.name, maps), heads, model, causal)


def mixing_from_record(record: Any, method: str) -> Mixing:
    """``attention`` straight from an :class:`~attnscope.records.AttentionRecord` (the other measures
    need the layers' inputs and layer norms, which a record does not hold: pass the model)."""
    method = method_name(method)
    if method != "attention":
        raise AttnscopeError(f"method {method!r} needs the model (it reads the layers' inputs and norms); "
                             "a record only gives 'attention'")
    record.require_complete("context mixing")
    attention = np.asarray(record.attention, dtype=np.float64)  # [layer, head, q_pos, k_pos]
    maps = attention.mean(axis=1)
    # learned sinks: the rollout keeps each row's sink mass on the query itself (see analysis.rollout)
    flowing = sink_on_diagonal(attention, record.sink_mass).mean(axis=1)
    return Mixing(method, tuple(record.tokens), maps, rollout_of(method, flowing), attention, record.model.name,
                  record.model.causal)


# ---- the built-in measures -------------------------------------------------------------------
def _per_head(maps: Callable[[LayerTensors], tuple[np.ndarray, np.ndarray]]) -> Compute:
    """A measure defined per head: ``maps(layer) -> (per head, layer map)``, stacked over layers."""
    def compute(layers: Sequence[LayerTensors], distances: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        pairs = [maps(layer) for layer in layers]
        return np.stack([layer_map for _, layer_map in pairs]), np.stack([per_head for per_head, _ in pairs])

    return compute


def _per_layer(layer_map: Callable[[LayerTensors], np.ndarray]) -> Compute:
    """A measure defined per layer only: ``layer_map(layer) -> [q_pos, k_pos]``, stacked over layers."""
    def compute(layers: Sequence[LayerTensors], distances: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
        return np.stack([layer_map(layer) for layer in layers]), None

    return compute


def _value_zeroing(layers: Sequence[LayerTensors], distances: np.ndarray | None) -> tuple[np.ndarray, None]:
    if distances is None:
        raise AttnscopeError("value zeroing needs the model: its distances come from re-running each layer")
    return np.stack([value_zeroing_map(d) for d in distances]), None


for _measure in (
    Measure("attention", "attention (head mean)", "attention weights, head mean", residual=False,
            compute=_per_head(attention_maps)),
    Measure("norm", "\u2016\u03b1f(x)\u2016 (head sum)", "Kobayashi et al. 2020, ||alpha f(x)||", residual=False,
            compute=_per_head(norm_maps), cited="Kobayashi et al. 2020"),
    Measure("norm_residual", "GlobEnc", "GlobEnc, Modarressi et al. 2022", residual=True,
            compute=_per_layer(globenc_map), aliases=("globenc",), cited="Modarressi et al. 2022"),
    Measure("alti", "ALTI", "ALTI, Ferrando et al. 2022", residual=True, compute=_per_layer(alti_map),
            cited="Ferrando et al. 2022"),
    Measure("value_zeroing", "value zeroing", "value zeroing, Mohebbi et al. 2023", residual=True,
            compute=_value_zeroing, intervention=True, cited="Mohebbi et al. 2023"),
):
    register_measure(_measure)

METHODS: tuple[str, ...] = tuple(m.name for m in measures())
"""The built-in measures' names, in order (``measures()`` lists every one registered now)."""
