"""Context-mixing measures: how much each token's representation after a layer draws on each input
token of that layer, and the same aggregated across layers.

Every measure here works on tensors of one input (:class:`LayerTensors`, captured by
``attnscope.experiments.mixing``), never on a model. Per layer ``l`` the map ``M[l][i, j]`` says how
much query (output) position ``i`` takes from key (input) position ``j``:

* ``attention``: the attention weights ``A^h[i, j]``; the layer map is their mean over heads.
* ``norm`` (Kobayashi et al. 2020): ``||A^h[i, j] f^h(x_j)||`` per head, where
  ``f^h(x_j) = v_j^h W_O^h`` is token j's value transformed by head h's slice of the output
  projection; the layer map is ``||sum_h A^h[i, j] f^h(x_j)||``. Not normalised (as in the paper).
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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import AttnscopeError
from .rollout import attention_rollout

METHODS = ("attention", "norm", "norm_residual", "alti", "value_zeroing")
METHOD_ALIASES = {"globenc": "norm_residual"}
ROLLOUT_RESIDUAL = {"attention": 0.5, "norm": 0.5, "norm_residual": 0.0, "alti": 0.0, "value_zeroing": 0.0}
REFERENCES = {
    "attention": "attention weights, head mean",
    "norm": "Kobayashi et al. 2020, ||alpha f(x)||",
    "norm_residual": "GlobEnc, Modarressi et al. 2022",
    "alti": "ALTI, Ferrando et al. 2022",
    "value_zeroing": "value zeroing, Mohebbi et al. 2023",
}


def method_name(method: str) -> str:
    """The canonical name of a measure (``globenc`` is ``norm_residual``), or a clear error."""
    name = METHOD_ALIASES.get(method, method)
    if name not in METHODS:
        raise AttnscopeError(f"unknown mixing method {method!r}; choose one of {', '.join(METHODS)} (or globenc)")
    return name


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
    ``after_attention``/``after_ffn``: the post-LN layer norms (None in pre-LN layers).
    """

    attention: np.ndarray
    transformed: np.ndarray
    out_bias: np.ndarray
    residual: np.ndarray
    after_attention: NormFacts | None = None
    after_ffn: NormFacts | None = None


def attention_maps(layer: LayerTensors) -> tuple[np.ndarray, np.ndarray]:
    """Per head ``[head, q_pos, k_pos]`` and the layer's head mean ``[q_pos, k_pos]``."""
    return layer.attention, layer.attention.mean(axis=0)


def head_terms(layer: LayerTensors) -> np.ndarray:
    """``A^h[i, j] f^h(x_j)`` for every head: ``[head, q_pos, k_pos, d_model]``."""
    return layer.attention[..., None] * layer.transformed[:, None, :, :]


def norm_maps(layer: LayerTensors) -> tuple[np.ndarray, np.ndarray]:
    """Kobayashi et al.'s norms: per head ``[head, q_pos, k_pos]`` and of the head sum ``[q_pos, k_pos]``."""
    per_head = layer.attention * np.linalg.norm(layer.transformed, axis=-1)[:, None, :]
    summed = np.einsum("hqk,hkm->qkm", layer.attention, layer.transformed)  # [q_pos, k_pos, d_model]
    return per_head, np.linalg.norm(summed, axis=-1)


def _split_norm(terms: np.ndarray, fixed: np.ndarray, norm: NormFacts) -> tuple[np.ndarray, np.ndarray]:
    """A LayerNorm of ``sum_j terms[:, j] + fixed`` split into per-token terms and what no token owns.

    ``terms`` ``[q_pos, k_pos, d_model]``, ``fixed`` ``[q_pos, d_model]``; each term is centred and
    divided by the scale of the whole sum; the norm's bias goes to the fixed part.
    """
    scale = norm.scale[:, None, None]
    split = norm.weight * (terms - terms.mean(-1, keepdims=True)) / scale
    rest = norm.weight * (fixed - fixed.mean(-1, keepdims=True)) / scale[:, 0] + norm.bias
    return split, rest


def block_terms(layer: LayerTensors) -> tuple[np.ndarray, np.ndarray]:
    """The attention block's output decomposed per input token (ALTI's ``T_i(x_j)``).

    Returns the terms ``[q_pos, k_pos, d_model]`` (sum over heads of ``A^h[i, j] f^h(x_j)``, plus
    ``x_i`` on the diagonal) and the part no token owns ``[q_pos, d_model]`` (output bias, and the
    LayerNorm's bias in post-LN layers). ``terms.sum(1) + rest`` is the block's output: after the
    first LayerNorm in post-LN layers, residual + attention in pre-LN layers.
    """
    terms = np.einsum("hqk,hkm->qkm", layer.attention, layer.transformed)
    n = terms.shape[0]
    terms[np.arange(n), np.arange(n)] += layer.residual
    rest = np.broadcast_to(layer.out_bias, layer.residual.shape).copy()
    if layer.after_attention is not None:
        terms, rest = _split_norm(terms, rest, layer.after_attention)
    return terms, rest


def normalise_rows(matrix: np.ndarray) -> np.ndarray:
    """Rows scaled to sum to 1 (an all-zero row stays 0): ``[..., q_pos, k_pos]``."""
    totals = matrix.sum(axis=-1, keepdims=True)
    return np.divide(matrix, totals, out=np.zeros_like(matrix), where=totals > 0)


def globenc_map(layer: LayerTensors) -> np.ndarray:
    """GlobEnc's per-layer map ``[q_pos, k_pos]``, rows summing to 1 (see the module docstring)."""
    terms, rest = block_terms(layer)
    if layer.after_ffn is not None:  # second residual and LayerNorm, bypassing the feed-forward sublayer
        terms, _ = _split_norm(terms, rest, layer.after_ffn)
    return normalise_rows(np.linalg.norm(terms, axis=-1))


def alti_map(layer: LayerTensors) -> np.ndarray:
    """ALTI's per-layer contributions ``[q_pos, k_pos]``, rows summing to 1 (see the module docstring)."""
    terms, rest = block_terms(layer)
    output = terms.sum(axis=1) + rest  # y_i, [q_pos, d_model]
    closeness = np.abs(output).sum(-1)[:, None] - np.abs(output[:, None, :] - terms).sum(-1)
    return normalise_rows(np.maximum(closeness, 0.0))


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
    return attention_rollout(normalise_rows(layer_maps), residual=ROLLOUT_RESIDUAL[method]).matrix


def mixing_from_tensors(method: str, layers: Sequence[LayerTensors], tokens: Sequence[str], model: str = "",
                        distances: np.ndarray | None = None, causal: bool = False) -> Mixing:
    """The measure ``method`` from captured layers (value zeroing also needs ``distances``
    ``[layer, q_pos, k_pos]`` from the model)."""
    method = method_name(method)
    heads = None
    if method in ("attention", "norm"):
        pairs = [(attention_maps if method == "attention" else norm_maps)(layer) for layer in layers]
        heads = np.stack([per_head for per_head, _ in pairs])
        maps = np.stack([layer_map for _, layer_map in pairs])
    elif method == "value_zeroing":
        if distances is None:
            raise AttnscopeError("value zeroing needs the model: its distances come from re-running each layer")
        maps = np.stack([value_zeroing_map(d) for d in distances])
    else:
        measure = globenc_map if method == "norm_residual" else alti_map
        maps = np.stack([measure(layer) for layer in layers])
    return Mixing(method, tuple(tokens), maps, rollout_of(method, maps), heads, model, causal)


def mixing_from_record(record: Any, method: str) -> Mixing:
    """``attention`` straight from an :class:`~attnscope.record.AttentionRecord` (the other measures
    need the layers' inputs and layer norms, which a record does not hold: pass the model)."""
    method = method_name(method)
    if method != "attention":
        raise AttnscopeError(f"method {method!r} needs the model (it reads the layers' inputs and norms); "
                             "a record only gives 'attention'")
    record.require_complete("context mixing")
    attention = np.asarray(record.attention, dtype=np.float64)  # [layer, head, q_pos, k_pos]
    maps = attention.mean(axis=1)
    return Mixing(method, tuple(record.tokens), maps, rollout_of(method, maps), attention, record.model.name,
                  record.model.causal)
