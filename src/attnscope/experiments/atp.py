"""Attribution patching: every head's activation-patching effect estimated from one clean forward pass and one
corrupted forward + backward pass per pair (AtP, Nanda 2023), and AtP* (Kramár et al. 2024, "AtP*: An efficient
and scalable method for localizing LLM behaviour to components") with its two fixes.

The patch estimated is the one :mod:`.patching` makes: the clean run's value of a node copied into the corrupted
run, on the same :class:`~.patching.PromptPair` s and metrics (``logit_diff``, ``logit``, ``prob`` at the last
position). For a node ``n`` the first-order estimate is ``(n_clean - n_corrupt) . dM/dn``, the gradient taken on
the corrupted run. Node sets (layers and heads 0-indexed):

* ``heads``: each head's output before the output projection, every position (``[batch, pos, head, d_head]``, what
  :class:`~.patching.PatchHeads` replaces); ``mlps`` (with ``mlps=True``): each MLP's output, every position.
* ``queries`` / ``keys``: each head's queries (every position) / the keys it reads (every position; with grouped
  key/value heads only this query head's view of its kv head is patched). AtP reaches them through the scores:
  ``sum(dM/dS * dS)`` with ``dS`` the exact change of the pre-softmax scores (they are linear in either side).

AtP* changes two things:

* **QK fix** (attention saturation): per the paper it applies to query and key nodes only. Their patched pattern
  is recomputed exactly (``softmax`` of the patched scores, masked as the model masked them) and the metric is
  linearised in the pattern instead of in the scores: ``sum(dM/dA * (A_patched - A_corrupt))``. A head's output
  sits after its own softmax, so its estimate is AtP's (patching it moves no softmax of its own); the
  ``heads`` and ``mlps`` node sets are the same under AtP and AtP* without GradDrop.
* **GradDrop** (cancellation between paths): the estimate is recomputed with the gradient through each layer's
  residual contribution (its attention and its MLP output) set to zero, ``I_l`` (the paper's one backward pass per
  layer; here ``1 + L`` copies of the corrupted run side by side, copy ``1 + l`` dropping layer l, one backward);
  the paper's estimate is the magnitude ``sum_l |I_l| / (L - 1)`` (the dropped layer of the node's own is zero).
  The paper ranks by that magnitude; to keep the result a signed share recovered (so that it sits in the same map
  as real patching), we give it the sign of ``sum_l I_l`` (our choice, not the paper's). A one-layer model has
  nothing to drop: its estimate is AtP's.

Per position (``positions=True``): each node patched at one position only. A head's (an MLP's) output at position
``p``: the same product summed over ``d_head`` only, so the estimates over positions sum to the node's. A query
patched at position ``i`` moves row ``i`` of the scores only: row ``i`` of the whole-query estimate (again summing to
it). A key patched at position ``j`` moves column ``j`` of every row; under AtP that is column ``j`` of the
whole-key estimate, and under the QK fix each row's new pattern has a closed form, since only one score ``s_ij``
moves, by ``d = s'_ij - s_ij``: with ``Z = 1 + A_ij (e^d - 1)``, ``A'_ij = A_ij e^d / Z`` and ``A'_ik = A_ik / Z``
for ``k != j``, so ``sum_k dM/dA_ik (A'_ik - A_ik) = (1 - 1/Z) (dM/dA_ij - sum_k A_ik dM/dA_ik)``
(:func:`single_key_estimates`, in log space from the scores, exact in saturated rows). Single-key patches do not add up to the whole-key patch (each renormalises its rows), nor do GradDrop's
magnitudes (taken per position the same way: ``sum_l |I_l| / (L - 1)`` of each position's ``I_l``) add up to the
node's. The residual stream after each layer at one position (``residual=True``, what real patching's ``residual``
patches): ``(clean - corrupt) . dM/d(block output)`` at that position, from the undropped copy (GradDrop's fix is
for component nodes; a block's output carries every path).

The estimates land in a :class:`AtPResult` (a :class:`~.patching.PatchingResult`: share recovered, intervals over
pairs, method ``atp`` / ``atp*``), so ``attnscope patch``'s maps, JSON and comparisons read them unchanged.
:func:`verify_estimates` patches the top-K estimated heads and K random heads for real (the cached method, or the
batched one where the model cannot start a run from a middle layer) and correlates estimate and real.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from ..arguments import check_seed
from ..attribution.dla import last_logits_only
from ..attribution.terms import blocks_by_layer
from ..capture.attention import Intervention, attention_scores, capture, intervene
from ..capture.extract import as_loaded
from ..capture.hooks import local_hooks
from ..capture.recorders import AttentionCall, Recorder
from ..errors import AttnscopeError
from ..models.adapters import AttentionSite, find_modules
from ..models.loading import LoadedModel
from .faithfulness import spearman
from .interventions import attention_shape
from .patching import (
    EncodedPair,
    PatchingResult,
    PromptPair,
    _recovered,
    _result,
    activation_patching,
    mean_interval,
    metric_value,
    padded,
    prepare_pairs,
)

ATP_METHODS = ("atp", "atp*")
QK_PARTS = ("queries", "keys")
BY_POSITION = "_by_position"
PATTERN_TOLERANCE = 1e-3  # recomputed vs the model's own probabilities (float32 softmax)


@dataclass(frozen=True, eq=False)
class AtPResult(PatchingResult):
    """Estimated patching effects (see the module docstring), shaped as :class:`~.patching.PatchingResult`:
    ``heads``/``heads_metric`` ``[pair, layer, head]`` estimated share recovered / estimated patched metric, ``mlps``
    ``[pair, layer]``; ``queries``/``keys`` ``[pair, layer, head]``: the estimated share recovered by patching each
    head's queries / keys (their intervals under the same names); ``residual`` ``[pair, layer, position]`` as in
    real patching. With ``positions``: ``heads_by_position``/``queries_by_position``/``keys_by_position``
    ``[pair, layer, position, head]`` and ``mlps_by_position`` ``[pair, layer, position]``, each node patched at
    one position only (NaN-padded to the longest pair). ``qk_fix``/``grad_drop``: which fixes ran."""

    queries: np.ndarray | None = None
    keys: np.ndarray | None = None
    heads_by_position: np.ndarray | None = None
    mlps_by_position: np.ndarray | None = None
    queries_by_position: np.ndarray | None = None
    keys_by_position: np.ndarray | None = None
    qk_fix: bool = False
    grad_drop: bool = False

    parts: ClassVar[tuple[str, ...]] = ("heads", "mlps", "residual", "queries", "keys", *(
        f"{name}_by_position" for name in ("heads", "mlps", "queries", "keys")))

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "estimate": {
            "qk_fix": self.qk_fix, "grad_drop": self.grad_drop,
            "what": "first-order estimates of activation patching (Nanda 2023; Kramar et al. 2024)"}}


def attribution_patching(model: LoadedModel | str, pairs: Sequence[PromptPair] | PromptPair, *,
                         metric: str | None = None, mlps: bool = False, method: str = "atp*",
                         qk_fix: bool | None = None, grad_drop: bool | None = None, positions: bool = False,
                         residual: bool = False, n_resamples: int = 1000, seed: int = 0,
                         progress: bool = False) -> AtPResult:
    """Estimate every head's (and with ``mlps`` every MLP's) patching effect on each pair; see the module docstring.

    ``method``: ``atp`` (no fix) or ``atp*`` (both fixes unless ``qk_fix`` / ``grad_drop`` say otherwise; under
    ``atp`` they stay off). ``positions``: also each node patched at one position at a time; ``residual``: the
    residual stream after each layer at each position. ``metric`` and ``n_resamples`` as in
    :func:`~.patching.activation_patching`.
    """
    if method not in ATP_METHODS:
        raise AttnscopeError(f"unknown method {method!r}; choose one of {', '.join(ATP_METHODS)}")
    check_seed(seed, "seed")
    star = method == "atp*"
    qk_fix = star if qk_fix is None else qk_fix and star
    grad_drop = star if grad_drop is None else grad_drop and star
    loaded = as_loaded(model)
    pairs = [pairs] if isinstance(pairs, PromptPair) else list(pairs)
    encoded, metric = prepare_pairs(loaded, pairs, metric)
    if getattr(loaded.config, "attn_logit_softcapping", None) is not None:
        raise AttnscopeError(f"{loaded.name} softcaps its attention scores; AtP's query and key estimates recompute "
                             "attention as softmax(q k^T * scale), which is more than softmax for this model")
    if residual and not blocks_by_layer(loaded):
        raise AttnscopeError(f"the adapter for {loaded.config.model_type!r} does not say where its blocks are, so the "
                             "residual stream after each layer cannot be estimated; leave out residual")
    from tqdm.auto import tqdm

    start = time.perf_counter()
    runs = [_attribute_pair(loaded, pair, metric, mlps=mlps, qk_fix=qk_fix, grad_drop=grad_drop, positions=positions,
                            residual=residual)
            for pair in tqdm(encoded, desc=method, unit="pair", disable=not progress, leave=False)]
    seconds = time.perf_counter() - start
    base = _result(loaded, encoded, runs, metric, method, seconds, n_resamples, seed)
    shares: dict[str, Any] = {name: np.stack([_recovered(run[name], run["clean"], run["corrupt"]) for run in runs])
                              for name in QK_PARTS}
    shares.update({name: padded([_recovered(run[name], run["clean"] - run["corrupt"], 0.0) for run in runs])
                   for name in runs[0] if name.endswith(BY_POSITION)})  # estimates, not metrics: share = estimate / gap
    intervals = {**base.intervals, **{name: mean_interval(values, n_resamples, seed) for name, values in shares.items()}}
    kept = {item.name: getattr(base, item.name) for item in fields(PatchingResult)}
    return AtPResult(**{**kept, "intervals": intervals}, **shares, qk_fix=qk_fix, grad_drop=grad_drop)


# ---- what one run keeps ----------------------------------------------------------------------------------------
class _Tap(Recorder):
    """Each ``kind`` site's call (queries ``[copies, head, pos, d_head]``, keys ``[copies, kv_head, pos, d_head]``,
    probabilities ``[copies, head, q_pos, k_pos]``) and per-head output ``[copies, pos, head, d_head]``, as the run
    computed them (in its autograd graph, if it has one). Wanting every row, every call runs eagerly."""

    wants_head_outputs = True

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.calls: dict[int, AttentionCall] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.allowed: dict[int, torch.Tensor] = {}

    def wants(self, site: AttentionSite) -> bool:
        return site.kind == self.kind

    def keep(self, site: AttentionSite, call: AttentionCall) -> None:
        self.calls[site.layer] = call

    def keep_output(self, site: AttentionSite, output: torch.Tensor) -> None:
        self.outputs[site.layer] = output

    def output_gate(self, site: AttentionSite, gate: torch.Tensor | None) -> None:
        return None  # not asked (no hears_gates); a gated model's head outputs are its patches' nodes as they are


class _Allowed(Intervention):
    """Changes nothing; notes which keys each query may see (``allowed``, bool ``[batch or 1, 1, q_pos, k_pos]``),
    what the QK fix masks its recomputed scores with."""

    def __init__(self, tap: _Tap) -> None:
        self.tap = tap

    def applies_to(self, site: AttentionSite) -> bool:
        return site.kind == self.tap.kind

    def modify_probs(self, site: AttentionSite, probs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        self.tap.allowed[site.layer] = allowed
        return probs


@dataclass
class _DropState:
    """GradDrop's copies: in batch row ``rows[l]``, layer l's residual contribution passes no gradient back."""

    rows: dict[int, int] = field(default_factory=dict)


class _Gate(torch.autograd.Function):
    """Identity forward (``tensor`` ``[batch, ...]``); backward zeroes the gradient of the batch row in which
    ``layer`` is dropped (GradDrop), passing the others'."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, layer: int, state: _DropState) -> torch.Tensor:
        ctx.layer, ctx.state = layer, state
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        row = ctx.state.rows.get(ctx.layer)
        if row is not None:
            grad = grad.clone()
            grad[row] = 0
        return grad, None, None


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _with_first(output: Any, tensor: torch.Tensor) -> Any:
    return (tensor, *output[1:]) if isinstance(output, tuple) else tensor


def _keep_outputs(layer_of: Mapping[nn.Module, int], table: dict[int, torch.Tensor]) -> Callable[..., None]:
    def keep(module: nn.Module, inputs: Any, output: Any) -> None:
        table[layer_of[module]] = _first(output)
    return keep


def _gate_outputs(layer_of: Mapping[nn.Module, int], state: _DropState) -> Callable[..., Any]:
    def gate(module: nn.Module, inputs: Any, output: Any) -> Any:
        return _with_first(output, _Gate.apply(_first(output), layer_of[module], state))
    return gate


@dataclass
class _Run:
    """One run of a prompt: its metric ``[copies]``, what the tap kept and the kept modules' outputs
    ``kept[name][layer]`` ``[copies, pos, d]`` (``mlps``: each MLP's; ``residual``: each block's)."""

    metric: torch.Tensor
    tap: _Tap
    kept: dict[str, dict[int, torch.Tensor]]


def _run(loaded: LoadedModel, pair: EncodedPair, ids: torch.Tensor, metric: str, kind: str,
         keep: Mapping[str, Mapping[int, nn.Module]], *, state: _DropState | None = None,
         gated: Mapping[nn.Module, int] | None = None, copies: int = 1) -> _Run:
    """Run ``ids`` (``copies`` times, side by side) keeping what the estimates need (``keep[name]``: the modules,
    by layer, whose outputs to keep); with ``state`` (a corrupted run), differentiably from the input embeddings
    (no weight gradients), the ``gated`` modules' outputs (each layer's attention and MLP: ``module -> layer``)
    passing no gradient back in the row where their layer is dropped."""
    tap = _Tap(kind)
    kept: dict[str, dict[int, torch.Tensor]] = {name: {} for name in keep}
    with ExitStack() as stack:
        stack.enter_context(capture(loaded.sites, recorder=tap))
        stack.enter_context(intervene(_Allowed(tap)))
        for name, modules in keep.items():
            if modules:
                layer_of = {module: layer for layer, module in modules.items()}
                stack.enter_context(local_hooks(list(layer_of), _keep_outputs(layer_of, kept[name])))
        embeds = loaded.model.get_input_embeddings()(ids.repeat(copies, 1)).detach()  # [copies, pos, d_model]
        if state is not None:
            if gated:  # after the keeping hooks: a kept MLP output is the gate's input, upstream of it
                stack.enter_context(local_hooks(list(gated), _gate_outputs(gated, state)))
            embeds.requires_grad_(True)
        out = loaded.model(inputs_embeds=embeds, use_cache=False, **last_logits_only(loaded))
    return _Run(metric_value(out.logits[:, -1], metric, pair.target, pair.other), tap, kept)


# ---- one pair ------------------------------------------------------------------------------------------------
def _attribute_pair(loaded: LoadedModel, pair: EncodedPair, metric: str, *, mlps: bool, qk_fix: bool,
                    grad_drop: bool, positions: bool = False, residual: bool = False) -> dict[str, Any]:
    """The clean and corrupted metrics, every node's estimated patched metric (corrupted + estimate) and, per
    position (``*_by_position``), the estimates themselves ``[layer, position, (head)]``."""
    kind, n_layers, _ = attention_shape(loaded, "self")
    ffn = {layer: module for (k, layer), module in find_modules(loaded.model, loaded.adapter.ffn).items() if k == kind}
    keep = {"mlps": ffn if mlps else {}, "residual": dict(enumerate(blocks_by_layer(loaded))) if residual else {}}
    gated = {**{module: site.layer for module, site in loaded.sites.items() if site.kind == kind},
             **{module: layer for layer, module in ffn.items()}}
    with torch.no_grad():
        clean = _run(loaded, pair, pair.clean, metric, kind, keep)
    # GradDrop: row 0 drops nothing, row 1 + l drops layer l; one backward pass over the copies side by side
    dropping = grad_drop and n_layers > 1
    state = _DropState({layer: layer + 1 for layer in range(n_layers)} if dropping else {})
    copies = 1 + n_layers if dropping else 1
    with torch.enable_grad():
        corrupt = _run(loaded, pair, pair.corrupt, metric, kind, keep, state=state,
                       gated=gated if dropping else None, copies=copies)
        layers = sorted(corrupt.tap.calls)
        with torch.no_grad():
            deltas = _deltas(clean, corrupt, layers, qk_fix, single_keys=positions and qk_fix)
        tensors = [corrupt.tap.outputs[layer] for layer in layers] + [corrupt.tap.calls[layer].probs for layer in layers]
        kept = [(name, layer) for name in ("mlps", "residual") for layer in sorted(corrupt.kept[name])]
        tensors += [corrupt.kept[name][layer] for name, layer in kept]
        grads = torch.autograd.grad(corrupt.metric.sum(), tensors, allow_unused=True)  # rows are independent
    grads = tuple(torch.zeros_like(t) if g is None else g for t, g in zip(tensors, grads))
    n = len(layers)
    by_layer = {name: {layer: grads[2 * n + i] for i, (k, layer) in enumerate(kept) if k == name}
                for name in ("mlps", "residual")}
    with torch.no_grad():
        estimates = [_estimates(deltas, grads[:n], grads[n:2 * n], by_layer["mlps"], row, layers, qk_fix, positions)
                     for row in range(copies)]
        combined = _grad_drop(estimates) if len(estimates) > 1 else estimates[0]
        if residual:  # the undropped copy's gradient: see the module docstring
            combined["residual"] = _along_last(deltas["residual"], by_layer["residual"], 0)
    base = float(corrupt.metric[0].detach())
    out: dict[str, Any] = {"clean": float(clean.metric[0]), "corrupt": base}
    for name, values in combined.items():
        out[name] = values if name.endswith(BY_POSITION) else base + values
    return out


def _scores(query: torch.Tensor, key: torch.Tensor, scaling: float, allowed: torch.Tensor) -> torch.Tensor:
    """``[1, head, q_pos, k_pos]`` pre-softmax scores (float32) of queries ``[1, head, q_pos, d]`` and keys
    ``[1, kv_head, k_pos, d]``, masked keys at the float32 minimum. Computed as the attention function computes
    them, in the model's dtype, then widened: in bfloat16 a score rounds by up to 2^-8 of itself, several hundredths
    of a probability where scores reach tens, so a float32 recomputation would not be the model's pattern."""
    scores = attention_scores(query, key, None, scaling).float()
    return scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)


def _deltas(clean: _Run, corrupt: _Run, layers: list[int], qk_fix: bool, single_keys: bool = False
            ) -> dict[str, Any]:
    """The patched-minus-corrupted change of every node, per layer: head outputs ``[pos, head, d_head]``, MLP and
    block outputs ``[pos, d]``, and for queries / keys the change of the scores ``[head, q_pos, k_pos]`` (AtP) or,
    with ``qk_fix``, of the recomputed pattern (and with ``single_keys``, for the per-key closed form, ``key_scores``:
    the keys' change of the scores, and ``scores``: the corrupted run's, -inf where masked)."""
    out: dict[str, Any] = {"heads": {}, "queries": {}, "keys": {}, "key_scores": {}, "scores": {}, "probs": {}}
    for layer in layers:  # the corrupted run's first copy (they are equal)
        c, r = clean.tap.calls[layer], corrupt.tap.calls[layer]
        allowed = corrupt.tap.allowed[layer][:1]
        base = _scores(r.query[:1], r.key[:1], r.scaling, allowed)
        probs = r.probs[:1].detach().float()
        if r.sink_mass is not None or (torch.softmax(base, -1) - probs).abs().max() > PATTERN_TOLERANCE:
            precision = "" if r.query.dtype == torch.float32 else f", scores recomputed in {r.query.dtype} as it runs"
            raise AttnscopeError(f"layer {layer}'s attention is more than softmax(q k^T * scale) (softcapping, a "
                                 f"position bias or sinks{precision}); query and key estimates cannot be recomputed "
                                 "for this model")
        out["heads"][layer] = (clean.tap.outputs[layer] - corrupt.tap.outputs[layer][:1].detach()).float()[0]
        for name, patched in (("queries", _scores(c.query, r.key[:1], r.scaling, allowed)),
                              ("keys", _scores(r.query[:1], c.key, r.scaling, allowed))):
            change = torch.where(allowed, patched - base, 0.0)[0]
            out[name][layer] = (torch.softmax(patched, -1) - probs)[0] if qk_fix else change
            if name == "keys" and single_keys:
                out["key_scores"][layer] = change
                out["scores"][layer] = base.masked_fill(~allowed, float("-inf"))[0]
        out["probs"][layer] = probs[0]
    for name, values in clean.kept.items():
        out[name] = {layer: (value - corrupt.kept[name][layer][:1].detach()).float()[0]
                     for layer, value in values.items()}
    return out


def _along_last(deltas: Mapping[int, torch.Tensor], grads: Mapping[int, torch.Tensor], row: int) -> np.ndarray:
    """``[layer, pos]``: each kept module's output change ``[pos, d]`` times batch row ``row`` of its gradient
    ``[copies, pos, d]``, summed over ``d`` (one position patched at a time)."""
    return torch.stack([(deltas[layer] * grads[layer][row].float()).sum(-1)
                        for layer in sorted(grads)]).double().cpu().numpy()


def single_key_estimates(scores: torch.Tensor, score_change: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The QK fix's estimate of patching each key alone: ``[head, k_pos]`` from the corrupted run's pre-softmax
    ``scores`` (-inf where masked), the key patch's change of the scores ``score_change`` (0 where masked) and
    ``grad`` = dM/dA (each ``[head, q_pos, k_pos]``). Key ``j``'s patch moves one score per row, ``s_ij`` by ``d``;
    the row's new pattern is ``A'_ij = A_ij e^d / Z``, ``A'_ik = A_ik / Z`` (``Z = 1 + A_ij (e^d - 1)``), so the row
    contributes ``(1 - 1/Z) (g_ij - sum_k A_ik g_ik) = (1 - 1/Z) (1 - A_ij) (g_ij - m_ij)``, ``m_ij`` the mean of
    ``g`` over the row's other keys, weighted by their share of ``1 - A_ij``. In float64 and log space from the
    scores, not the probabilities, in that second form: ``1 - A_ij`` and ``m_ij`` of a row's largest score are taken
    over the other keys, so that a row saturated beyond float precision (``1 - A_ij`` lost next to 1) stays exact."""
    s, d, g = scores.double(), score_change.double(), grad.double()
    lse = torch.logsumexp(s, -1, keepdim=True)
    log_a = s - lse
    top = s.argmax(-1, keepdim=True)
    others = s.scatter(-1, top, float("-inf"))  # the row without its largest score
    log_rest = torch.log(-torch.expm1(log_a))  # log(1 - A_ij): accurate except at a row's largest score
    log_rest = log_rest.scatter(-1, top, torch.logsumexp(others, -1, keepdim=True) - lse)
    a = log_a.exp()
    mean = ((a * g).sum(-1, keepdim=True) - a * g) / log_rest.exp()  # m_ij where A_ij <= 1/2
    mean = mean.scatter(-1, top, torch.nan_to_num((torch.softmax(others, -1) * g).sum(-1, keepdim=True)))
    log_z = torch.logaddexp(log_rest, log_a + d)  # log(1 - A_ij + A_ij e^d)
    # (1 - 1/Z) (1 - A_ij) = sign(log Z) exp(log(1 - A_ij) + max(0, -log Z) + log(1 - e^-|log Z|)), where
    # log(1 - A_ij) - log Z <= 0 (Z >= 1 - A_ij): no overflow where Z is tiny
    size = torch.exp(log_rest + torch.relu(-log_z) + torch.log(-torch.expm1(-log_z.abs())))
    return (torch.sign(log_z) * size * (g - mean)).sum(-2)  # over queries


def _estimates(deltas: dict[str, Any], g_outputs: Sequence[torch.Tensor], g_probs: Sequence[torch.Tensor],
               g_mlps: Mapping[int, torch.Tensor], row: int, layers: list[int], qk_fix: bool,
               positions: bool) -> dict[str, np.ndarray]:
    """Every node's first-order estimate from the gradients of batch row ``row`` (head outputs ``[copies, pos,
    head, d]`` and probabilities ``[copies, head, q, k]`` in ``layers`` order; MLP outputs by layer):
    ``heads``/``queries``/``keys`` ``[layer, head]``, ``mlps`` ``[layer]``, and with ``positions`` the same per
    position, ``*_by_position`` ``[layer, pos, head]`` / ``[layer, pos]``. Where patching every position is the sum
    of patching each (outputs, queries, keys under AtP) the totals are the positions' sums (float64)."""
    per: dict[str, list[torch.Tensor]] = {"heads": [], "queries": [], "keys": []}  # each [pos, head]
    keys_total = []
    for index, layer in enumerate(layers):
        g_out, g_pattern = g_outputs[index][row].float(), g_probs[index][row].float()  # [pos, head, d], [head, q, k]
        per["heads"].append((deltas["heads"][layer] * g_out).sum(-1))
        if qk_fix:  # linear in the pattern
            along = g_pattern
        else:  # through the softmax: dM/dS = A * (dM/dA - sum_k A dM/dA)
            probs = deltas["probs"][layer]
            along = probs * (g_pattern - (probs * g_pattern).sum(-1, keepdim=True))
        per["queries"].append((deltas["queries"][layer] * along).sum(-1).T)  # query i moves row i only
        if not qk_fix:
            per["keys"].append((deltas["keys"][layer] * along).sum(-2).T)  # key j moves column j only
            continue
        keys_total.append((deltas["keys"][layer] * along).sum(dim=(1, 2)))
        if positions:
            per["keys"].append(single_key_estimates(deltas["scores"][layer], deltas["key_scores"][layer], g_pattern).T)
    out = {name: torch.stack(values).double().cpu().numpy() for name, values in per.items() if values}
    if g_mlps:
        out["mlps"] = _along_last(deltas["mlps"], g_mlps, row)
    totals = {name: values.sum(1) for name, values in out.items()}
    if qk_fix:
        totals["keys"] = torch.stack(keys_total).double().cpu().numpy()
    return {**totals, **({f"{name}{BY_POSITION}": values for name, values in out.items()} if positions else {})}


def _grad_drop(estimates: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """GradDrop from ``estimates[0]`` (no layer dropped) and ``estimates[1 + l]`` (layer l dropped):
    ``sum_l |I_l| / (L - 1)``, signed as ``sum_l I_l`` (see the module docstring)."""
    dropped = estimates[1:]
    out = {}
    for name in estimates[0]:
        stacked = np.stack([e[name] for e in dropped])  # [dropped layer, ...]
        magnitude = np.abs(stacked).sum(0) / (len(dropped) - 1)
        out[name] = np.where(stacked.sum(0) < 0, -magnitude, magnitude)
    return out


# ---- estimate vs real ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Verification:
    """Estimated and real (cached patching) mean share recovered of the top-K estimated heads and K random others.

    ``cells``: ``(layer, head, chosen as "top" or "random")``; ``estimate``/``real`` ``[2K]``; ``spearman``
    over all of them; ``method``: the real patching's (``cached``, or ``batched`` where the model cannot start a
    run from a middle layer)."""

    cells: tuple[tuple[int, int, str], ...]
    estimate: np.ndarray
    real: np.ndarray
    spearman: float
    seconds: float
    method: str = "cached"

    def to_dict(self) -> dict[str, Any]:
        return {"spearman": round(self.spearman, 4), "seconds": round(self.seconds, 3),
                "method": f"{self.method} activation patching of the chosen heads",
                "heads": [{"layer": layer, "head": head, "chosen": chosen, "estimate": _number(e), "real": _number(r)}
                          for (layer, head, chosen), e, r in zip(self.cells, self.estimate, self.real)]}


def _number(value: float) -> float | None:
    return None if not np.isfinite(value) else round(float(value), 6)


def check_verify(k: int, n_layers: int, n_heads: int) -> None:
    """Refuse a ``--verify`` K below 1 or above the number of heads (one line), before any slow work."""
    total = n_layers * n_heads
    if not 1 <= k <= total:
        raise AttnscopeError(f"--verify {k}: choose K from 1 to {total} (this model's heads)")


def verify_estimates(model: LoadedModel | str, pairs: Sequence[PromptPair], result: PatchingResult, k: int, *,
                     seed: int = 0) -> Verification:
    """Patch for real (cached, or batched where the model cannot start a run from a middle layer) the ``k`` heads
    with the largest estimated mean share (by magnitude) and ``k`` others drawn at random (seeded), over the
    same pairs; Spearman of estimate vs real over the ``2k`` (fewer random ones where the model has fewer heads)."""
    check_seed(seed, "seed")
    loaded = as_loaded(model)
    mean = result.intervals["heads"][0]
    check_verify(k, *mean.shape)
    order = np.argsort(-np.nan_to_num(np.abs(mean), nan=-1.0), axis=None)
    top = [tuple(int(i) for i in np.unravel_index(index, mean.shape)) for index in order[:k]]
    rest = [tuple(int(i) for i in np.unravel_index(index, mean.shape)) for index in order[k:]]
    draws = np.random.default_rng(seed).permutation(len(rest))[:k]
    cells = [(*cell, "top") for cell in top] + [(*rest[i], "random") for i in sorted(draws)]
    start = time.perf_counter()
    real = activation_patching(loaded, pairs, metric=result.metric, n_resamples=0,
                               heads=[(layer, head) for layer, head, _ in cells])
    seconds = time.perf_counter() - start
    real_mean = real.intervals["heads"][0]
    estimate = np.array([mean[layer, head] for layer, head, _ in cells])
    measured = np.array([real_mean[layer, head] for layer, head, _ in cells])
    finite = np.isfinite(estimate) & np.isfinite(measured)
    rho = spearman(estimate[finite], measured[finite]) if finite.sum() > 1 else float("nan")
    return Verification(tuple(cells), estimate, measured, rho, seconds, real.method)
