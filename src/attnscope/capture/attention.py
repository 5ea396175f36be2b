"""The one place where attnscope computes attention.

:func:`attnscope_attention` is registered with transformers' ``AttentionInterface`` under the
name ``"attnscope"`` and models are loaded with ``attn_implementation="attnscope"``, so every
architecture that dispatches through the interface runs this code. Outside
:func:`capture` and :func:`intervene` blocks it delegates to PyTorch's fused SDPA kernel (nothing
to record, nothing to change). Inside them it computes attention eagerly, lets the active
:class:`Intervention` objects rewrite the probabilities or the per-head outputs (head ablation,
attention corruption), and records what the capture session asked for.

Attention modules are recognised by the ``attnscope_site`` attribute that ``load_model`` sets
on each of them (see ``models.adapters``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import nn

from ..errors import AttnscopeError
from ..models.adapters import AttentionSite
from .plan import CapturePlan
from .rows import Allocate, BatchFacts, RowCapture, RowCollector

ATTN_IMPLEMENTATION = "attnscope"


class Intervention:
    """One change to attention at some sites; subclasses override what they change.

    * ``applies_to(site)`` selects the sites (by ``site.kind`` and ``site.layer``);
    * ``modify_probs(site, probs, allowed)``: ``probs`` ``[batch, head, q_pos, k_pos]`` float32,
      ``allowed`` bool ``[batch or 1, 1, q_pos, k_pos]`` = the keys the mask lets each query see
      (padding and, for causal attention, the future are False); returns new probabilities;
    * ``modify_output(site, output)``: the per-head output ``[batch, q_pos, head, d_head]``,
      before the output projection; returns a new one.

    Activate with :func:`intervene`; several compose in the order given.
    """

    def applies_to(self, site: AttentionSite) -> bool:
        return True

    def modify_probs(self, site: AttentionSite, probs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        return probs

    def modify_output(self, site: AttentionSite, output: torch.Tensor) -> torch.Tensor:
        return output


@dataclass
class SiteCapture:
    """What one attention module produced in one forward pass (batched tensors, float32).

    ``attention``/``norms``: ``[batch, head, q_pos, k_pos]``; ``queries``/``keys``/``values``:
    ``[batch, head, pos, d_head]`` with keys and values expanded to the query heads.
    """

    attention: torch.Tensor
    n_kv_heads: int
    d_head: int
    scaling: float
    queries: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    norms: torch.Tensor | None = None
    new_value_norms: torch.Tensor | None = None  # [batch, head, q_pos]: ||v W_O|| of the keys this call added
    first_query: int = 0  # the call's queries before this one have no row here (a step sink did not want them)

    @property
    def n_heads(self) -> int:
        return int(self.attention.shape[1])


@dataclass
class CaptureSession:
    """Collects :class:`SiteCapture` per ``(kind, layer)`` while it is active."""

    sites: Mapping[nn.Module, AttentionSite]
    record: bool = True
    qkv: bool = False
    norms: bool = False
    stop_after: frozenset[tuple[str, int]] | None = None
    plan: CapturePlan | None = None
    facts: BatchFacts | None = None
    sink: Sink | None = None
    step_sink: Callable[[AttentionSite, SiteCapture], None] | None = None
    captured: dict[tuple[str, int], SiteCapture | RowCapture] = field(default_factory=dict)

    def layers(self, kind: str) -> list[Any]:
        """Captures of ``kind``, ordered by layer."""
        return [self.captured[key] for key in sorted(k for k in self.captured if k[0] == kind)]

    def collector(self, site: AttentionSite, values: torch.Tensor, *, n_heads: int, n_keys: int) -> RowCollector:
        """The :class:`RowCollector` of a planned capture at ``site`` (``values``: ``[batch, head, k_pos,
        d_head]``, for norms); with a sink, its large fields are views of the file being written."""
        assert self.plan is not None and self.facts is not None, "a planned capture needs the batch's facts"
        norms = value_norms(values, site) if self.norms else None
        return RowCollector(self.plan, self.facts, n_heads=n_heads, n_keys=n_keys, causal=site.causal,
                            value_norms=norms, allocate=None if self.sink is None else self.sink.allocate(site),
                            device=values.device)

    def records_site(self, site: AttentionSite) -> bool:
        """Whether this session keeps anything of ``site`` (a plan keeps its layers of the input side)."""
        return self.record and (self.plan is None or (site.kind == main_kind(self.sites.values())
                                                      and self.plan.wants_layer(site.layer)))


def main_kind(sites: Iterable[AttentionSite]) -> str:
    """The input side's kind of attention: ``encoder`` for encoder-decoders, else ``self``."""
    return "encoder" if any(site.kind == "encoder" for site in sites) else "self"


class Sink(Protocol):
    """Where a streaming capture puts each site's results as they are produced (``records.format``)."""

    def allocate(self, site: AttentionSite) -> Allocate: ...

    def finish(self, site: AttentionSite, captured: RowCapture) -> RowCapture: ...


class CaptureComplete(Exception):
    """Raised once every site in ``stop_after`` is recorded: the rest of the forward pass (the last
    feed-forward block, final norm, pooler) cannot change what was captured, so it is skipped."""


_ACTIVE_SESSION: ContextVar[CaptureSession | None] = ContextVar("attnscope_session", default=None)
_ACTIVE_INTERVENTIONS: ContextVar[tuple[Intervention, ...]] = ContextVar("attnscope_interventions", default=())


@contextmanager
def intervene(*interventions: Intervention) -> Iterator[None]:
    """Apply ``interventions`` to every forward pass inside the block (nested blocks add up).

    Local to the current thread / async task, and always removed on exit, even after an error.
    """
    token = _ACTIVE_INTERVENTIONS.set(_ACTIVE_INTERVENTIONS.get() + interventions)
    try:
        yield
    finally:
        _ACTIVE_INTERVENTIONS.reset(token)


@contextmanager
def capture(
    sites: Mapping[nn.Module, AttentionSite],
    *,
    record: bool = True,
    qkv: bool = False,
    norms: bool = False,
    stop_when_complete: bool = False,
    plan: CapturePlan | None = None,
    facts: BatchFacts | None = None,
    sink: Sink | None = None,
    step_sink: Callable[[AttentionSite, SiteCapture], None] | None = None,
) -> Iterator[CaptureSession]:
    """Activate a capture session for the forward passes run inside the block.

    The session is local to the current thread / async task (a ``ContextVar``) and is always
    removed on exit, whatever happens inside. With ``stop_when_complete`` the forward pass raises
    :class:`CaptureComplete` right after the last attention site is recorded; catch it around the
    call (only useful when the model's outputs are not needed).

    With a ``plan`` (and the batch's ``facts``), the input side's chosen layers are computed in
    query chunks and kept as :class:`~attnscope.capture.rows.RowCapture`; other sites run fused.
    A ``sink`` receives each site's results as soon as they are computed (streaming to disk).
    A ``step_sink`` receives every call's :class:`SiteCapture` instead of the session keeping the
    last one per site (generation: one call per site and step; with ``norms``, only the norms of the
    values each call adds are computed, as ``new_value_norms``).
    """
    session = CaptureSession(sites, record=record, qkv=qkv, norms=norms, plan=plan, facts=facts, sink=sink,
                             step_sink=step_sink)
    if stop_when_complete:
        session.stop_after = frozenset((s.kind, s.layer) for s in sites.values() if session.records_site(s))
    token = _ACTIVE_SESSION.set(session)
    try:
        yield session
    finally:
        _ACTIVE_SESSION.reset(token)


def interventions_active() -> bool:
    """Whether any intervention is active in this thread / task (``intervene``)."""
    return bool(_ACTIVE_INTERVENTIONS.get())


def expand_kv_heads(states: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``[batch, kv_head, pos, d_head]`` -> ``[batch, head, pos, d_head]``; query head h uses kv head h // group."""
    group = n_heads // states.shape[1]
    return states if group == 1 else states.repeat_interleave(group, dim=1)


def attention_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    position_bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q k^T * scaling (+ softcap, bias, mask): the logits of attention, ``[batch, head, q_pos, k_pos]``.

    ``query``: ``[batch, head, q_pos, d_head]``; ``key`` already expanded to ``head``;
    ``attention_mask``: additive float or boolean (True = keep), broadcastable to
    ``[batch, head, q_pos, k_pos]``. Masked logits are the dtype's minimum (finite, so that
    ``0 * logit`` stays 0).
    """
    scores = torch.matmul(query, key.transpose(2, 3))  # [batch, head, q_pos, k_pos]
    if scaling != 1.0:
        scores = scores * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is not None:
        mask = attention_mask[:, :, :, : key.shape[-2]]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    return scores


def allowed_keys(attention_mask: torch.Tensor | None, q_len: int, k_len: int,
                 device: torch.device | None = None) -> torch.Tensor:
    """Bool ``[batch or 1, 1, q_pos, k_pos]``: True where the mask lets a query see a key (on the mask's
    device, or on ``device`` without a mask)."""
    if attention_mask is None:
        return torch.ones((1, 1, q_len, k_len), dtype=torch.bool, device=device)
    mask = attention_mask[:, :, :, :k_len]
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2  # additive masks hold 0 or the dtype's minimum


def value_norms(values: torch.Tensor, site: AttentionSite) -> torch.Tensor:
    """||v_j W_O^h|| for every head h and key j: ``[batch, head, k_pos, d_head]`` -> ``[batch, head, k_pos]``.

    ``W_O^h`` is head h's slice of the output projection (Kobayashi et al. 2020, without the
    output bias, which is added once after the heads are summed).
    """
    return transformed_values(values, site).norm(dim=-1)


def transformed_values(values: torch.Tensor, site: AttentionSite) -> torch.Tensor:
    """Kobayashi et al.'s f^h(x_j) = v_j^h W_O^h: ``[batch, head, k_pos, d_head]`` -> ``[batch, head, k_pos, d_model]``
    (float32, without the output bias)."""
    if site.out_proj is None:
        raise AttnscopeError(f"no output projection found for {site.name}; norms are unavailable for this model")
    weight = cast(torch.Tensor, site.out_proj.weight).float()
    if site.conv1d:
        weight = weight.t()  # Conv1D stores [in, out]; make it [out, in] like nn.Linear
    n_heads, d_head = values.shape[1], values.shape[-1]
    per_head = weight.view(weight.shape[0], n_heads, d_head).permute(1, 2, 0)  # [head, d_head, d_model]
    return torch.matmul(values.float(), per_head)  # [batch, head, k_pos, d_model]; batched matmul beats einsum here


def attnscope_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention function registered as ``"attnscope"``.

    ``query``: ``[batch, head, q_pos, d_head]``; ``key``/``value``: ``[batch, kv_head, k_pos, d_head]``.
    Returns the output ``[batch, q_pos, head, d_head]`` and the probabilities
    ``[batch, head, q_pos, k_pos]`` (None on the fused path).
    """
    site: AttentionSite | None = getattr(module, "attnscope_site", None)
    session = _ACTIVE_SESSION.get()
    recording = session is not None and site is not None and session.records_site(site)
    interventions = tuple(i for i in _ACTIVE_INTERVENTIONS.get() if site is not None and i.applies_to(site))
    # SDPA has no logit softcapping (Gemma 2): such models always take the eager path below
    if (site is None or not (recording or interventions)) and kwargs.get("softcap") is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("s_aux") is not None:
        raise AttnscopeError("attention sinks (s_aux) are not supported by attnscope's capture yet")
    unwanted = _rows_not_wanted(session, site, query.shape[2]) if recording and not interventions else 0
    if unwanted and kwargs.get("softcap") is None:
        assert session is not None and site is not None
        return _fused_with_last_rows(module, session, site, query, key, value, attention_mask, scaling, unwanted,
                                     kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    n_heads = query.shape[1]
    keys = expand_kv_heads(key, n_heads)
    values = expand_kv_heads(value, n_heads)
    if recording and session is not None and site is not None and session.plan is not None and not interventions:
        output = chunked_attention(session, site, query, keys, values, attention_mask, scaling, key.shape[1], kwargs)
        return output, None
    if site is not None:
        attention_mask = rows_mask(attention_mask, site, query.shape[2], keys.shape[2], 0, query.device)
    scores = attention_scores(query, keys, attention_mask, scaling, kwargs.get("position_bias"), kwargs.get("softcap"))
    probs = torch.softmax(scores.float(), dim=-1)  # [batch, head, q_pos, k_pos]
    if interventions:
        assert site is not None
        allowed = allowed_keys(attention_mask, query.shape[2], keys.shape[2], query.device)
        for intervention in interventions:
            probs = intervention.modify_probs(site, probs, allowed)
    if recording:
        assert session is not None and site is not None
        _keep(session, site, _site_capture(session, site, query, keys, values, probs, key.shape[1], scaling))
    mixing = nn.functional.dropout(probs, p=dropout, training=module.training).to(value.dtype)
    output = torch.matmul(mixing, values).transpose(1, 2)  # [batch, q_pos, head, d_head]
    for intervention in interventions:
        assert site is not None  # interventions only ever apply to a known site
        output = intervention.modify_output(site, output)
    output = output.contiguous()
    return output, probs.to(query.dtype)


def _rows_not_wanted(session: CaptureSession | None, site: AttentionSite | None, n_queries: int) -> int:
    """How many of this call's first queries the step sink wants no row of (0 without such a sink)."""
    ask = getattr(session.step_sink, "rows_not_wanted", None) if session is not None else None
    return 0 if ask is None or site is None else min(int(ask(site, n_queries)), n_queries - 1)


def _fused_with_last_rows(module: nn.Module, session: CaptureSession, site: AttentionSite, query: torch.Tensor,
                          key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                          scaling: float | None, unwanted: int, kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, None]:
    """A call whose first ``unwanted`` query rows nobody keeps (a long prompt in generation): the
    output by PyTorch's fused SDPA, as without capture, and the probabilities of the other rows
    only, computed as the eager path computes them. Memory: one ``[head, q - unwanted, k]`` block,
    not ``[head, q, k]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    output, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    n_queries, n_heads = query.shape[2], query.shape[1]
    keys, values = expand_kv_heads(key, n_heads), expand_kv_heads(value, n_heads)
    mask = rows_mask(attention_mask, site, n_queries, keys.shape[2], unwanted, query.device)
    wanted = query[:, :, unwanted:]
    probs = torch.softmax(attention_scores(wanted, keys, mask, scaling).float(), dim=-1)
    _keep(session, site, _site_capture(session, site, wanted, keys, values, probs, key.shape[1], scaling, unwanted))
    return output, None


def _keep(session: CaptureSession, site: AttentionSite, captured: SiteCapture | RowCapture) -> None:
    """Store what was captured at ``site`` (after the sink took it); stop the forward once every wanted site is in."""
    if session.step_sink is not None and isinstance(captured, SiteCapture):
        session.step_sink(site, captured)
        return
    if session.sink is not None and isinstance(captured, RowCapture):
        captured = session.sink.finish(site, captured)
    session.captured[(site.kind, site.layer)] = captured
    if session.stop_after is not None and session.stop_after <= session.captured.keys():
        raise CaptureComplete


def rows_mask(attention_mask: torch.Tensor | None, site: AttentionSite, n_queries: int, n_keys: int, first: int,
              device: torch.device) -> torch.Tensor | None:
    """The mask of a call's queries ``first..n_queries-1``: the given mask's rows, or, where the lazy
    mask left causality to us (None at a causal site, a square call), the causal mask of those rows."""
    if attention_mask is not None and attention_mask.shape[-2] == n_queries:
        return attention_mask[..., first:, :]
    if attention_mask is None and site.causal and n_queries == n_keys > 1:
        return causal_mask(n_queries - first, first, n_keys, device)
    return attention_mask


def causal_mask(q_len: int, start: int, k_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Bool ``[1, 1, q_len, k_len]`` on ``device``: query ``start + i`` may see keys at or before it."""
    queries = torch.arange(start, start + q_len, device=device)[:, None]
    return (torch.arange(k_len, device=device)[None, :] <= queries)[None, None]


def chunked_attention(session: CaptureSession, site: AttentionSite, query: torch.Tensor, keys: torch.Tensor,
                      values: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float, n_kv_heads: int,
                      kwargs: Mapping[str, Any]) -> torch.Tensor:
    """Attention of one site ``plan.chunk`` queries at a time, each chunk handed to a
    :class:`RowCollector`; returns the output ``[batch, q_pos, head, d_head]``.

    ``keys``/``values`` are expanded to the query heads. Without a mask, causal attention only
    computes the keys up to each chunk's last query (the rest would get weight 0).
    """
    plan = session.plan
    assert plan is not None
    batch, n_heads, q_len, _ = query.shape
    k_len = keys.shape[2]
    implicit_causal = attention_mask is None and site.causal and q_len == k_len
    collector = session.collector(site, values, n_heads=n_heads, n_keys=k_len)
    output = query.new_empty((batch, q_len, n_heads, values.shape[-1]))
    bias = kwargs.get("position_bias")
    for start in range(0, q_len, plan.chunk):
        end = min(start + plan.chunk, q_len)
        k_seen = end if implicit_causal else k_len
        mask = None if attention_mask is None else attention_mask[:, :, start:end, :k_seen]
        scores = attention_scores(query[:, :, start:end] * scaling, keys[:, :, :k_seen], mask, 1.0,
                                  None if bias is None else bias[:, :, start:end, :k_seen], kwargs.get("softcap")).float()
        if implicit_causal:  # only the chunk's own square holds future keys
            future = ~causal_mask(end - start, 0, end - start, scores.device)[0, 0]
            scores[..., start:end].masked_fill_(future, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1)
        collector.add(start, probs, scores if plan.statistics else None)
        del scores
        output[:, start:end] = torch.matmul(probs.to(values.dtype), values[:, :, :k_seen]).transpose(1, 2)
    _keep(session, site, collector.finish(n_heads=n_heads, n_kv_heads=n_kv_heads, d_head=query.shape[-1],
                                          scaling=scaling))
    return output


def _site_capture(session: CaptureSession, site: AttentionSite, query: torch.Tensor, keys: torch.Tensor,
                  values: torch.Tensor, probs: torch.Tensor, n_kv_heads: int,
                  scaling: float, first_query: int = 0) -> SiteCapture | RowCapture:
    """``first_query``: the call's queries before it have no row in ``query``/``probs`` (a step sink
    did not want them); the values they added still get their norms."""
    if session.plan is not None:  # a plan under interventions: the full matrix, then kept chunk by chunk
        collector = session.collector(site, values.detach(), n_heads=probs.shape[1], n_keys=probs.shape[-1])
        for start in range(0, probs.shape[2], session.plan.chunk):
            collector.add(start, probs[:, :, start : start + session.plan.chunk].detach())
        return collector.finish(n_heads=probs.shape[1], n_kv_heads=n_kv_heads, d_head=query.shape[-1],
                                scaling=scaling)
    result = SiteCapture(attention=probs.detach(), n_kv_heads=n_kv_heads, d_head=query.shape[-1], scaling=scaling,
                         first_query=first_query)
    if session.qkv:
        result.queries, result.keys, result.values = (t.detach().float() for t in (query, keys, values))
    if session.norms and session.step_sink is not None:  # the earlier keys' norms came with earlier calls
        result.new_value_norms = value_norms(values[:, :, -(first_query + query.shape[2]):].detach(), site)
    elif session.norms:
        result.norms = probs.detach() * value_norms(values.detach(), site)[:, :, None, :]
    return result


capture_attention = capture  # the public name: ``attnscope.capture`` is this subpackage


def register_attention_function() -> None:
    """Register :func:`attnscope_attention` and its mask builder with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, attnscope_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, attnscope_mask)


def attnscope_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask builder registered with transformers.

    Usually transformers' eager mask: additive float ``[batch, 1, q_pos, k_pos]``, 0 to keep and
    the dtype's minimum to drop. During a planned capture, SDPA's lazy mask instead: None where no
    key is masked but the causal ones (chunked attention then masks causally itself, so a long
    input never builds a ``[q_pos, k_pos]`` mask), else a bool mask (True = keep).
    """
    from transformers.masking_utils import eager_mask, sdpa_mask

    session = _ACTIVE_SESSION.get()
    if session is not None and session.plan is not None:
        return sdpa_mask(*args, **kwargs)
    return eager_mask(*args, **kwargs)
