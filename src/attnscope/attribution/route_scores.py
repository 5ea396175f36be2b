"""Scores read off an information-flow route (:mod:`.routes`): how much of one prediction each head and each input
token carries, for comparing routes with patching and erasure (``attnscope routes --evaluate``).

**Head score** (kept edges, :func:`head_scores`): head h of layer l gets the sum, over the route's kept attention
edges at layer l, of h's share of the edge (``Edge.heads[h]``; an edge's shares sum to its importance). This reads
the paper's graph per head as the authors' tool splits its edges; an edge counts whatever share of the prediction
reaches its query.

**Token score** (kept edges, :func:`token_scores`): the importance that flows from the output node (the last
residual stream at the chosen position) down to token j's layer-0 residual node. A mass of 1 starts at the output
node; nodes are visited top-down (by layer; within a layer the stream entering the next layer, then the
feed-forward node, then the attention node, then the stream entering the layer); each node hands its mass to the
sources of its kept incoming edges, ``mass × importance`` each, except the feed-forward node, whose one input (the
stream after attention at its position) takes all of its mass. The mass that reaches ``(0, j, residual)`` is
token j's score. It is attention rollout (Abnar & Zuidema 2020) with the paper's proximity in place of attention
weights and each row's own residual share in place of a fixed half, restricted to the kept edges; the scores sum to
at most 1 (exactly 1, up to rounding, when every edge is kept).

**Unpruned** (:func:`route_flow`): the same flow over every edge, computed as matrices from
:meth:`~.routes.RouteTensors.importance` rows. With ``A_l[i, j] = Σ_h heads_l[i, j, h] + [i = j] residual_l[i]``
and ``f_l[i] = ffn_l[i] + ffn_residual_l[i]`` (1 up to rounding), the mass at layer l's attention nodes is
``m_l = r_{l+1} ⊙ f_l`` and ``r_l = m_l A_l``, from ``r_L = e_position``; the token scores are ``r_0``, and the
*flow* head score of head h at layer l is ``Σ_i m_l[i] Σ_j heads_l[i, j, h]``, the share of the prediction's mass
that passes through h (with the residual shares ``Σ_i m_l[i] residual_l[i]``, each layer's add up to 1). Only rows
with mass are computed, but a causal prompt reaches nearly every row after a layer or two: ``[pos, pos, head]`` per
layer, meant for prompts of tens to hundreds of tokens.

>>> scores = route_scores("smollm2", "When Mary and John went to the store, John gave a drink to")  # doctest: +SKIP
>>> scores.tokens.argmax(), scores.flow_heads.shape                                                 # doctest: +SKIP

Layers, heads and positions are 0-indexed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..models.loading import LoadedModel
from .routes import TAU, Edge, Node, Routes, RouteTensors, routes_and_tensors

HEIGHT = {"residual": 0, "attention": 1, "ffn": 2}  # order of a layer's nodes, bottom up


def _height(node: Node) -> tuple[int, int]:
    return node.layer, HEIGHT[node.kind]


def kept_flow(edges: Iterable[Edge], output: Node) -> dict[Node, float]:
    """The mass each node of the graph receives from ``output`` (1) along the kept ``edges`` (see the module
    docstring): ``{node: mass}``."""
    into: dict[Node, list[Edge]] = {}
    for edge in edges:
        into.setdefault(edge.target, []).append(edge)
    mass = {output: 1.0}
    for node in sorted(into, key=_height, reverse=True):  # every edge goes up: a node's mass is complete here
        given = mass.get(node, 0.0)
        for edge in into[node] if given else ():
            share = 1.0 if node.kind == "ffn" else edge.importance  # the feed-forward node reads only its input
            mass[edge.source] = mass.get(edge.source, 0.0) + given * share
    return mass


def token_scores(graph: Routes) -> np.ndarray:
    """Each input token's score ``[pos]``: the mass reaching its layer-0 residual node along the kept edges."""
    scores = np.zeros(len(graph.tokens))
    for node, mass in kept_flow(graph.edges, graph.output).items():
        if node.layer == 0 and node.kind == "residual":
            scores[node.position] += mass
    return scores


def head_scores(graph: Routes) -> np.ndarray:
    """Each head's score ``[layer, head]``: the sum of its shares of the kept attention edges of its layer."""
    scores = np.zeros((graph.n_layers, graph.n_heads))
    for edge in graph.edges:
        if edge.via == "attention":
            scores[edge.target.layer] += edge.heads
    return scores


@torch.inference_mode()
def route_flow(tensors: RouteTensors, position: int) -> tuple[np.ndarray, np.ndarray]:
    """The flow over the unpruned graph (see the module docstring): token scores ``[pos]`` and flow head scores
    ``[layer, head]`` (float64)."""
    mass = torch.zeros(tensors.residuals[0].shape[0], dtype=torch.float64)  # r_{l+1}: [pos]
    mass[position] = 1.0
    through: list[torch.Tensor] = []
    for layer in reversed(range(tensors.n_layers)):
        rows = mass.nonzero()[:, 0].tolist()
        found = tensors.importance(layer, rows)
        at_attention = mass[rows] * (found.ffn + found.ffn_residual).double()  # m_l: [row]
        heads = found.heads.double()  # [row, source_pos, head]
        through.append(at_attention @ heads.sum(1))  # [head]
        mass = torch.einsum("r,rsh->s", at_attention, heads)
        mass[rows] += at_attention * found.residual.double()
    return mass.numpy(), torch.stack(through[::-1]).numpy()


@dataclass(frozen=True, eq=False)
class RouteScores:
    """One prediction's route (``graph``) and the scores read off it: ``tokens`` ``[pos]`` and ``heads`` ``[layer,
    head]`` over the kept edges, ``flow_tokens`` and ``flow_heads`` over the unpruned graph."""

    graph: Routes
    tokens: np.ndarray
    heads: np.ndarray
    flow_tokens: np.ndarray
    flow_heads: np.ndarray


def route_scores(model: LoadedModel | str, text: str | Sequence[int], position: int = -1,
                 tau: float = TAU) -> RouteScores:
    """The route of the prediction at ``position`` of ``text`` (as :func:`~.routes.routes`) with its scores."""
    graph, tensors = routes_and_tensors(model, text, position, tau)
    flow_tokens, flow_heads = route_flow(tensors, graph.position)
    return RouteScores(graph, token_scores(graph), head_scores(graph), flow_tokens, flow_heads)
