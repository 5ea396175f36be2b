"""Why a head attends where it does: QK attribution of one attention score.

Head h of layer L scores key j for query i as ``s_ij = scale · q_i · k_j`` before its softmax, with
``q_i = R_i(G_q ⊙ (W_Q^h N(x_i) + b_Q))``: ``x_i`` the residual stream entering the layer, ``N`` its
pre-attention norm, ``G_q`` the per-head query norm of Gemma 3 and Qwen 3 (absent elsewhere) and ``R_i`` the
rotary embedding of position i (Su et al. 2021, "RoFormer"), a rotation, so linear in its input; ``k_j`` alike
with key/value head ``h // group``. With every norm's scale frozen at the run's (as direct logit attribution
does, :mod:`attnscope.attribution.terms`), ``q_i`` is linear in ``x_i`` plus a constant, and ``x_i`` is the sum
of its components: the embeddings, each earlier head's output through its slice of ``W_O`` (and the
post-attention norm of Gemma 2/3), each earlier MLP, and biases. So the score is the sum of a
``[query component, key component]`` table: ``scale · Q(c_i) · K(c'_j)``, the "bias" row and column holding the
query/key projections' biases (and any norm bias); a model without any (Llama, SmolLM2, Gemma) has no "bias"
component, which would be zeros. This is the QK circuit of Elhage et al. 2021 ("A
Mathematical Framework for Transformer Circuits") read on one (i, j) of a real model.

What the softmax sees is ``log a_ij = s_ij − LSE_i``. With ``w`` the row's weights over its keys (``a_i``,
renormalised to sum to 1 where a learned sink takes a share),
``log a_ij = (s_ij − Σ_j' w_j' s_ij') + (Σ_j' w_j' s_ij' − LSE_i)``: the first part is bilinear again (query
components × the key components at j minus their ``w``-weighted mean over the keys: :attr:`QKAttribution.centred`),
the second is one number per row (:attr:`QKAttribution.row_term`: ``−H(a_i)``, the row's negative entropy, when
there is no sink). A key's share therefore rises with what its components add over the average key's.

Handled or refused, each in one line:

* grouped key/value heads: the key side reads kv head ``h // group``;
* sliding windows and chunks (Llama 4's chunked layers): a key outside the query's window or chunk is masked (it
  has no score) and refused before the forward pass; the centred table averages over the keys it sees only;
* learned sinks (gpt-oss): the sink logit is no key, so the score table is unchanged; it enters the LSE only,
  so :attr:`QKAttribution.row_term` includes it;
* Gemma 2's logit softcapping (``cap · tanh(s / cap)``): the table splits the score *before* the cap, which is
  bilinear, and :attr:`QKAttribution.capped_score` reports the capped one beside it; there is no centred table
  (``centred`` and ``row_term`` are None), since the cap is not linear and any split of it would be a choice,
  not a fact of the model.

One forward pass, stopped after layer L's attention: every earlier head's output (fused,
:class:`~attnscope.capture.recorders.HeadOutputs`), layer L's query row, keys and probabilities, and the residual
pieces of the keys the query sees. Layers, heads and positions are 0-indexed.

>>> qk = qk_attribution("smollm2", "The cat sat on the mat. The cat", layer=17, head=4, query=-1, key=2)  # doctest: +SKIP
>>> qk.top_pairs(5)     # [(query component, key component, term), ...]   # doctest: +SKIP
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from ..capture.attention import capture
from ..capture.extract import as_loaded
from ..capture.hooks import local_hooks
from ..capture.recorders import AttentionCall, CaptureComplete, HeadOutputs, Recorder, RecorderGroup
from ..capture.tokens import readable_tokens
from ..errors import AttnscopeError
from ..models.adapters import AttentionSite
from ..models.loading import LoadedModel
from .dla import _ids_of, _resolve_position
from .terms import (
    RESIDUAL_TOLERANCE,
    FrozenNorm,
    blocks_by_layer,
    freeze_norm_rows,
    layer_input_components,
    residual_parts,
    unembedding,
)

BIAS = "bias"  # the component holding the query/key projections' biases (and any norm's), where there are any


@dataclass(frozen=True, eq=False)
class QKAttribution:
    """One attention score of head ``head`` of layer ``layer``, query ``query``, key ``key``, split into pairs.

    ``scores`` ``[query component, key component]`` float64: ``scale · Q(c_i) · K(c'_j)``; it sums to
    :attr:`score`, the model's own pre-softmax score (before any softcapping). ``centred``: the same query
    components times each key component at j minus its attention-weighted mean over the row's keys; it sums, plus
    :attr:`row_term`, to :attr:`log_attention`, the model's ``log a_ij`` (None under softcapping).
    ``query_components`` and ``key_components`` name the rows and columns (the same residual components on both
    sides: ``"embedding"``, ``"L3H2 (head)"``, ``"L3 attention bias"``, ``"L5 MLP"``, and ``"bias"`` where the
    query/key path has a bias, e.g. Qwen2's projections). ``tokens``: the text's tokens, each decoded on its own
    (:func:`~attnscope.capture.tokens.readable_tokens`: WordPiece pieces as they are, ``##berries``; a byte-level
    piece of a character split over tokens shows as ``"�"``), so joining them need not give the text back.
    ``capped_score``: Gemma 2's ``cap · tanh(score / cap)``, what its softmax sees (None without a cap).
    ``sink_mass``: the share of the row a learned sink took (0 without one).
    """

    model: str
    tokens: tuple[str, ...]
    layer: int
    head: int
    query: int
    key: int
    query_components: tuple[str, ...]
    key_components: tuple[str, ...]
    scores: np.ndarray
    score: float
    capped_score: float | None
    centred: np.ndarray | None
    row_term: float | None
    log_attention: float
    sink_mass: float

    def total(self) -> float:
        """The score table's sum (equals :attr:`score` to float round-off)."""
        return float(self.scores.sum())

    def softmax_total(self) -> float | None:
        """The centred table's sum plus :attr:`row_term` (equals :attr:`log_attention`); None under softcapping."""
        return None if self.centred is None or self.row_term is None else float(self.centred.sum() + self.row_term)

    def _table(self, table: str) -> np.ndarray:
        if table == "score":
            return self.scores
        if table == "centred" and self.centred is not None:
            return self.centred
        raise AttnscopeError(f"no {table!r} table here (tables: score"
                             + (", centred)" if self.centred is not None else "; none centred under softcapping)"))

    def top_pairs(self, k: int = 10, table: str = "score") -> list[tuple[str, str, float]]:
        """The ``k`` largest terms by size, signed: ``[(query component, key component, term), ...]`` of the
        ``"score"`` table or the ``"centred"`` one."""
        values = self._table(table)
        order = np.argsort(-np.abs(values), axis=None)[:k]
        return [(self.query_components[q], self.key_components[c], float(values[q, c]))
                for q, c in zip(*np.unravel_index(order, values.shape))]

    def to_frame(self) -> Any:
        """A long pandas DataFrame: one row per (query component, key component), with the score's term and the
        centred one (NaN under softcapping)."""
        import pandas as pd

        q, k = np.indices(self.scores.shape)
        centred = self.centred if self.centred is not None else np.full(self.scores.shape, np.nan)
        return pd.DataFrame({"query_component": np.array(self.query_components, dtype=object)[q.ravel()],
                             "key_component": np.array(self.key_components, dtype=object)[k.ravel()],
                             "score_term": self.scores.ravel(), "centred_term": centred.ravel()})

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field, tables as nested lists."""
        plain = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return {name: value.round(7).tolist() if isinstance(value, np.ndarray) else
                list(value) if isinstance(value, tuple) else value for name, value in plain.items()}

    def plot(self, k: int = 12, table: str = "score") -> Any:
        """A heatmap of the table over the ``k`` query and ``k`` key components with the largest terms (by the sum
        of their row's or column's sizes), red positive, blue negative."""
        from ..analysis.figures import pyplot

        values = self._table(table)
        rows = np.argsort(-np.abs(values).sum(1))[:k]
        columns = np.argsort(-np.abs(values).sum(0))[:k]
        shown = values[np.ix_(rows, columns)]
        limit = float(np.abs(shown).max()) or 1.0
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(2.5 + 0.45 * len(columns), 1.5 + 0.35 * len(rows)))
        image = ax.imshow(shown, cmap="RdBu_r", vmin=-limit, vmax=limit)
        ax.set_xticks(range(len(columns)), [self.key_components[c] for c in columns], rotation=60, ha="right")
        ax.set_yticks(range(len(rows)), [self.query_components[r] for r in rows])
        ax.set_xlabel(f"key side (key {self.key}: {self.tokens[self.key]!r})")
        ax.set_ylabel(f"query side (query {self.query}: {self.tokens[self.query]!r})")
        ax.set_title(f"L{self.layer}H{self.head} {table} terms (0-indexed)")
        fig.colorbar(image, ax=ax)
        fig.tight_layout()
        return fig


@dataclass
class _QueryRow(Recorder):
    """Keeps layer ``layer``'s call for query ``query``: its query vector ``[d_head]``, the keys of ``head``'s kv head
    ``[k_pos, d_head]``, its probability row ``[k_pos]`` and the sink's share, then ends the forward pass."""

    layer: int
    head: int
    query: int
    call: dict[str, Any] | None = None

    def wants(self, site: AttentionSite) -> bool:
        return site.kind == "self" and site.layer == self.layer

    def rows_not_wanted(self, site: AttentionSite, n_queries: int) -> int:
        return self.query

    def keep(self, site: AttentionSite, call: AttentionCall) -> None:
        row = self.query - call.first_query
        kv_head = self.head // (call.probs.shape[1] // call.n_kv_heads)
        self.call = {"query": call.query[0, self.head, row].double(), "keys": call.key[0, kv_head].double(),
                     "probs": call.probs[0, self.head, row].double(), "scaling": float(call.scaling),
                     "sink_mass": 0.0 if call.sink_mass is None else float(call.sink_mass[0, self.head, row])}
        raise CaptureComplete  # the later layers cannot change this score


@dataclass(frozen=True)
class _Head:
    """Where one head's query and key come from: the layer's modules and the head's slices of ``W_Q``/``W_K``."""

    site: AttentionSite
    attention: nn.Module
    block: nn.Module
    norm: nn.Module
    head: int
    d_head: int
    kv_head: int


def _head(loaded: LoadedModel, layer: int, head: int) -> _Head:
    """The layer's attention module and what its query/key path needs, or one line saying what is missing."""
    if loaded.is_encoder_decoder or not loaded.causal:
        raise AttnscopeError(f"model {loaded.name!r} is not a decoder-only language model; QK attribution reads "
                             "rotary decoders (e.g. --model smollm2)")
    unembedding(loaded)  # residual_parts reads the residual's pieces where the adapter says the logits see them
    if loaded.dtype != "float32":  # each frozen norm is checked against the model's own to float32 round-off
        raise AttnscopeError(f"QK attribution needs the model in float32 (it is {loaded.dtype}): its tables must add up "
                             "to the model's score, which half-precision norms do not allow; use --dtype float32")
    sites = {site.layer: (module, site) for module, site in loaded.sites.items() if site.kind == "self"}
    if not 0 <= layer < len(sites):
        raise AttnscopeError(f"layer {layer} is outside {loaded.name}'s {len(sites)} layers (0..{len(sites) - 1})")
    attention, site = sites[layer]
    q_proj, k_proj = getattr(attention, "q_proj", None), getattr(attention, "k_proj", None)
    block = blocks_by_layer(loaded)[layer]
    norm = getattr(block, "input_layernorm", None)
    if not isinstance(q_proj, nn.Linear) or not isinstance(k_proj, nn.Linear) or norm is None:
        raise AttnscopeError(f"QK attribution reads a pre-norm layer with q_proj/k_proj projections (Llama, Mistral, "
                             f"Qwen, Gemma); {loaded.config.model_type!r} layers are not of that form")
    d_head = int(getattr(attention, "head_dim", 0) or q_proj.out_features // loaded.config.num_attention_heads)
    n_heads, n_kv_heads = q_proj.out_features // d_head, k_proj.out_features // d_head
    if not 0 <= head < n_heads:
        raise AttnscopeError(f"head {head} is outside layer {layer}'s {n_heads} heads (0..{n_heads - 1})")
    return _Head(site, attention, block, norm, head, d_head, head // (n_heads // n_kv_heads))


def _visible_keys(site: AttentionSite, query: int, key: int) -> int:
    """The first key query ``query`` sees (the window's or the chunk's start, or 0); a key it does not see is
    refused."""
    if not site.window:
        first = 0
    else:
        first = (query // site.window) * site.window if site.chunked else max(0, query - site.window + 1)
    if key > query:
        raise AttnscopeError(f"key {key} is after query {query}: layer {site.layer} is causal, so that key is masked "
                             f"and has no score (keys 0..{query})")
    if key < first:
        band = "chunks" if site.chunked else "sliding window"
        raise AttnscopeError(f"key {key} is outside layer {site.layer}'s {band} of {site.window} keys: query "
                             f"{query} sees keys {first}..{query} only; the others are masked and have no score")
    return first


def _rotary(attention: nn.Module) -> Callable[..., Any]:
    """The modeling module's own ``apply_rotary_pos_emb`` (rotary embeddings are linear in q and k)."""
    rotate = getattr(sys.modules[type(attention).__module__], "apply_rotary_pos_emb", None)
    if rotate is None:
        raise AttnscopeError(f"{type(attention).__name__} has no rotary embedding function attnscope can read; QK "
                             "attribution covers rotary decoders (Llama, Mistral, Qwen, Gemma)")
    return cast(Callable[..., Any], rotate)


def _bias(linear: nn.Linear, rows: slice, norm_bias: torch.Tensor | None) -> torch.Tensor:
    """What a head's query (or key) gets whatever the residual: the projection's bias of ``rows`` plus the input norm's
    bias through the projection, ``[d_head]`` float64."""
    weight = cast(torch.Tensor, linear.weight)[rows].double()
    bias = torch.zeros(weight.shape[0], dtype=torch.float64, device=weight.device) if linear.bias is None \
        else cast(torch.Tensor, linear.bias)[rows].double()
    return bias if norm_bias is None else bias + weight @ norm_bias


def _head_norm(attention: nn.Module, name: str, side: torch.Tensor, actual: torch.Tensor) -> torch.Tensor:
    """``side`` ``[component, position, d_head]`` through the per-head norm ``name`` (Gemma 3's, Qwen 3's
    ``q_norm``/``k_norm``) frozen at ``actual`` ``[position, d_head]`` (the bias component gets any norm bias)."""
    norm = getattr(attention, name, None)
    if norm is None:
        return side
    weight = cast(torch.Tensor | None, getattr(norm, "weight", None))
    if weight is not None and weight.numel() != side.shape[-1]:
        raise AttnscopeError(f"{type(attention).__name__}.{name} normalises all heads together, not each head; QK "
                             "attribution cannot split it by head")
    unit, scales = freeze_norm_rows(norm, actual)
    out = _apply(unit, side) * scales[None, :, None]
    if unit.bias is not None:
        out[-1] += unit.bias
    return out


def _apply(unit: FrozenNorm, states: torch.Tensor) -> torch.Tensor:
    """A frozen norm's linear part on the last dimension (no bias)."""
    return unit.gain * (states - states.mean(-1, keepdim=True) if unit.centred else states)


def _check_vector(loaded: LoadedModel, rebuilt: torch.Tensor, actual: torch.Tensor, what: str) -> None:
    error = float((rebuilt - actual).abs().max())
    if error > RESIDUAL_TOLERANCE * max(1.0, float(actual.abs().max())):
        raise AttnscopeError(f"the components of {loaded.name!r} do not add up to the {what} its attention was given "
                             f"(off by {error:.3g}): its query/key path is not norm, projection, per-head norm, rotary "
                             "embedding, so QK attribution would be wrong")


def qk_attribution(model: LoadedModel | str, text: str | Sequence[int], layer: int, head: int, query: int,
                   key: int) -> QKAttribution:
    """Split head ``head`` of layer ``layer``'s score of key ``key`` for query ``query`` into
    ``[query component, key component]`` pairs (:class:`QKAttribution`; see the module's notes).

    ``text``: a text, or token ids. Positions are 0-indexed; negative ones count from the end. Layer, head,
    query and key are checked against the model and the text before the forward pass.
    """
    loaded = as_loaded(model)
    found = _head(loaded, layer, head)
    ids = _ids_of(loaded, text)
    i, j = _resolve_position(query, len(ids)), _resolve_position(key, len(ids))
    first = _visible_keys(found.site, i, j)
    positions = list(range(first, i + 1))  # the keys the query sees; the query is the last

    row, heads, layer_input = _QueryRow(layer, head, i), HeadOutputs(), {}

    def keep_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        layer_input["x"] = (args[0] if args else kwargs["hidden_states"])[0, positions].detach()
        layer_input["rotary"] = kwargs.get("position_embeddings")

    input_ids = torch.tensor([ids], device=loaded.input_device)
    with (torch.inference_mode(), capture(loaded.sites, recorder=RecorderGroup(heads, row)),
          residual_parts(loaded, positions) as parts, local_hooks([found.block], keep_input, pre=True)):
        try:
            loaded.model(input_ids=input_ids, use_cache=False)
        except CaptureComplete:
            pass  # layer `layer`'s attention ran: the rest cannot change the score
    if row.call is None:
        raise AttnscopeError(f"model {loaded.name!r} ran without calling attnscope's attention function at layer {layer}")
    if layer_input.get("rotary") is None:
        raise AttnscopeError(f"layer {layer} of {loaded.name!r} was given no rotary embeddings; QK attribution covers "
                             "rotary decoders (Llama, Mistral, Qwen, Gemma)")
    with torch.inference_mode():
        tables = _tables(loaded, found, parts, heads, layer_input, row.call, positions, j - first)
    return QKAttribution(model=loaded.name, tokens=readable_tokens(loaded.tokenizer, ids), layer=layer, head=head,
                         query=i, key=j, **tables)


def _sides(loaded: LoadedModel, found: _Head, parts: Any, heads: HeadOutputs, layer_input: dict[str, Any],
           positions: list[int]) -> tuple[tuple[str, ...], torch.Tensor, torch.Tensor]:
    """The component names, each component's query ``[component, d_head]`` at the last of ``positions`` and its
    keys ``[component, position, d_head]`` at each of them, after the per-head norms and the rotation."""
    x, attention, d = layer_input["x"], found.attention, found.d_head  # x: [position, d_model]
    q_proj, k_proj = cast(nn.Linear, attention.q_proj), cast(nn.Linear, attention.k_proj)
    q_rows, k_rows = slice(found.head * d, (found.head + 1) * d), slice(found.kv_head * d, (found.kv_head + 1) * d)
    unit, scales = freeze_norm_rows(found.norm, x)
    readout = unit.pull_back(torch.cat([q_proj.weight[q_rows], k_proj.weight[k_rows]]).double().T)  # [d_model, 2 d]
    outputs = {layer: output[0, positions] for layer, output in heads.of_kind("self").items()}
    split = layer_input_components(loaded, parts, outputs, found.site.layer, readout, x)
    values = split.values * scales[None, :, None]  # [component, position, 2 d_head]: the input norm's scales
    queries, keys, names = values[:, -1:, :d], values[:, :, d:], split.names
    if _has_qk_bias(attention, unit.bias):  # else the bias component would be zeros: left out of every table
        queries = torch.cat([queries, _bias(q_proj, q_rows, unit.bias).expand(1, 1, d)])
        keys = torch.cat([keys, _bias(k_proj, k_rows, unit.bias).expand(1, len(positions), d)])
        names = (*names, BIAS)
    normed = found.norm(x)
    queries = _head_norm(attention, "q_norm", queries, q_proj(normed[-1:])[:, q_rows])
    keys = _head_norm(attention, "k_norm", keys, k_proj(normed)[:, k_rows])
    cos, sin = (part[:, positions].double() for part in layer_input["rotary"])  # [1, position, d_rotary]
    rotate = _rotary(attention)
    queries = rotate(queries[:, None], queries[:, None], cos[:, -1:], sin[:, -1:])[0][:, 0, 0]
    keys = rotate(keys[:, None], keys[:, None], cos, sin)[0][:, 0]
    return names, queries, keys


def _has_qk_bias(attention: nn.Module, norm_bias: torch.Tensor | None) -> bool:
    """Whether anything on the query/key path adds a constant: the projections' biases (Qwen2's), the input norm's
    or a per-head norm's bias. Without any, the ``bias`` component is zero in every table (SmolLM2, Gemma)."""
    parts = [attention.q_proj, attention.k_proj, getattr(attention, "q_norm", None), getattr(attention, "k_norm", None)]
    return norm_bias is not None or any(getattr(part, "bias", None) is not None for part in parts)


def _tables(loaded: LoadedModel, found: _Head, parts: Any, heads: HeadOutputs, layer_input: dict[str, Any],
            call: dict[str, Any], positions: list[int], key: int) -> dict[str, Any]:
    """The :class:`QKAttribution` fields after the tokens (``key``: the key's index in ``positions``)."""
    names, queries, keys = _sides(loaded, found, parts, heads, layer_input, positions)
    name = f"L{found.site.layer}H{found.head}"
    _check_vector(loaded, queries.sum(0), call["query"], f"query of {name}")
    model_keys = call["keys"][positions]  # [position, d_head]
    _check_vector(loaded, keys.sum(0), model_keys, f"keys of {name}")
    scaling = call["scaling"]
    scores = scaling * queries @ keys[:, key].T  # [query component, key component]
    model_scores = scaling * model_keys @ call["query"]  # [position]
    score = float(model_scores[key])
    probs = call["probs"][positions]
    cap = getattr(found.attention, "attn_logit_softcapping", None)
    centred, row_term = None, None
    if not cap:
        weights = probs / probs.sum()
        mean_keys = torch.einsum("p,cpd->cd", weights, keys)
        centred = (scaling * queries @ (keys[:, key] - mean_keys).T).cpu().numpy()
        lse = float(torch.logsumexp(model_scores, 0)) - math.log1p(-call["sink_mass"])  # a sink's share is no key's
        row_term = float(weights @ model_scores) - lse
    return {"query_components": names, "key_components": names, "scores": scores.cpu().numpy(), "score": score,
            "capped_score": float(cap * np.tanh(score / cap)) if cap else None, "centred": centred,
            "row_term": row_term, "log_attention": float(torch.log(probs[key])), "sink_mass": call["sink_mass"]}
