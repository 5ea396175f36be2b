"""The one place where attnscope computes attention.

:func:`attnscope_attention` is registered with transformers' ``AttentionInterface`` under the
name ``"attnscope"`` and models are loaded with ``attn_implementation="attnscope"``, so every
architecture that dispatches through the interface runs this code. Outside
:func:`capture` and :func:`intervene` blocks it delegates to PyTorch's fused SDPA kernel (nothing
to record, nothing to change). Inside them it lets the active :class:`Intervention` objects
rewrite the probabilities or the per-head outputs (head ablation, attention corruption), and
hands what it computed to the capture's :class:`~attnscope.capture.recorders.Recorder`.

It has one path per computation, whatever records: fused (no site the recorder wants, no
intervention), fused with the last rows computed (the recorder wants none of a call's first
rows), chunked (the recorder takes rows chunk by chunk) and eager; which one runs is what the
recorder answers (:mod:`attnscope.capture.recorders`). To add a new way of recording, implement
``Recorder``; the attention function never changes.

Attention modules are recognised by the ``attnscope_site`` attribute that ``load_model`` sets
on each of them (see ``models.adapters``).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from ..errors import AttnscopeError
from ..models.adapters import (
    AttentionSite,
    attends_over_no_tokens,
    misstated_window,
    selected_key_blocks,
    unknown_causality,
    unlisted_attention,
)
from .gates import gates_heard, returned
from .kv_budget import BudgetedStates
from .plan import CapturePlan
from .recorders import (
    AttentionCall,
    CallInputs,
    ChunkCollector,
    PerSite,
    Recorder,
    Sink,
    built_in_recorder,
    expand_kv_heads,
    hand_inputs,
    hand_output,
    wants_inputs,
)
from .rows import BatchFacts
from .running import ATTN_IMPLEMENTATION, call_heard, calls_heard, check_attention_function


class Intervention:
    """One change to attention at some sites; subclasses override what they change.

    * ``applies_to(site)`` selects the sites (by ``site.kind`` and ``site.layer``);
    * ``modify_probs(site, probs, allowed)``: ``probs`` ``[batch, head, q_pos, k_pos]`` float32,
      ``allowed`` bool ``[batch or 1, 1, q_pos, k_pos]`` = the keys the mask lets each query see
      (padding and, for causal attention, the future are False; ``[batch or 1, head, q_pos, k_pos]`` where a
      ``key_mask`` restricted some heads); returns new probabilities;
    * ``modify_output(site, output)``: the per-head output ``[batch, q_pos, head, d_head]``,
      before the output projection; returns a new one;
    * ``key_mask(site, n_heads, q_len, k_len, device)``: bool ``[batch or 1, head or 1, q_pos, k_pos]``, the keys
      each query may still see (True = kept), or None for all; applied with the model's own mask, before the
      softmax, so a kept row is the softmax over the kept keys (and a learned sink) exactly. Keys are positions
      of the call (a cache's slots); the queries are the last ``q_len`` of them.

    Activate with :func:`intervene`; several compose in the order given (key masks first, all of them).
    """

    def applies_to(self, site: AttentionSite) -> bool:
        return True

    def key_mask(self, site: AttentionSite, n_heads: int, q_len: int, k_len: int,
                 device: torch.device) -> torch.Tensor | None:
        return None

    def modify_probs(self, site: AttentionSite, probs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        return probs

    def modify_output(self, site: AttentionSite, output: torch.Tensor) -> torch.Tensor:
        return output


@dataclass
class CaptureSession:
    """An active capture: its sites and its :class:`~attnscope.capture.recorders.Recorder`.

    ``captured`` and :meth:`layers` are the recorder's, for the recorders that keep one capture per
    ``(kind, layer)`` (the full and planned records, :class:`~attnscope.capture.recorders.PerSite`).
    """

    sites: Mapping[nn.Module, AttentionSite]
    recorder: Recorder

    @property
    def captured(self) -> dict[tuple[str, int], Any]:
        """What the recorder kept per ``(kind, layer)``: ``SiteCapture`` or ``RowCapture``."""
        return cast(PerSite, self.recorder).captured

    def layers(self, kind: str) -> list[Any]:
        """Captures of ``kind``, ordered by layer."""
        return cast(PerSite, self.recorder).layers(kind)


_ACTIVE_RECORDER: ContextVar[Recorder | None] = ContextVar("attnscope_recorder", default=None)
_ACTIVE_INTERVENTIONS: ContextVar[tuple[Intervention, ...]] = ContextVar("attnscope_interventions", default=())


@contextmanager
def intervene(*interventions: Intervention) -> Iterator[None]:
    """Apply ``interventions`` to every forward pass inside the block (nested blocks add up).

    Local to the current thread / async task, and always removed on exit, even after an error. A block in which
    no call reached attnscope's attention function changed nothing: it is refused when it ends
    (:func:`~attnscope.capture.running.calls_heard`).
    """
    token = _ACTIVE_INTERVENTIONS.set(_ACTIVE_INTERVENTIONS.get() + interventions)
    try:
        with calls_heard(None, "intervene"):
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
    recorder: Recorder | None = None,
) -> Iterator[CaptureSession]:
    """Activate a capture session for the forward passes run inside the block.

    The session is local to the current thread / async task (a ``ContextVar``) and is always
    removed on exit, whatever happens inside. With ``stop_when_complete`` the forward pass raises
    :class:`~attnscope.capture.recorders.CaptureComplete` right after the last attention site is
    recorded; catch it around the call (only useful when the model's outputs are not needed).

    Without a ``plan``, every site's :class:`~attnscope.capture.recorders.SiteCapture` is kept
    (``qkv``: with the queries, keys and values; ``norms``: with the norm-weighted attention). With
    a ``plan`` (and the batch's ``facts``), the input side's chosen layers are computed in query
    chunks and kept as :class:`~attnscope.capture.rows.RowCapture`; other sites run fused. A ``sink``
    receives each site's results as soon as they are computed (streaming to disk). ``record=False``
    keeps nothing (interventions still apply).

    A ``recorder`` (:class:`~attnscope.capture.recorders.Recorder`) records its own way instead
    (generation's :class:`~attnscope.capture.generate.StepRows`); the options above then do not apply.

    A model whose attention no longer runs attnscope's function is refused on entry where its config says so,
    and on exit where a site's module ran but no call arrived (:mod:`attnscope.capture.running`).
    """
    if recorder is None:
        recorder = built_in_recorder(sites, record=record, qkv=qkv, norms=norms,
                                     stop_when_complete=stop_when_complete, plan=plan, facts=facts, sink=sink)
    elif not record or qkv or norms or stop_when_complete or plan is not None or facts is not None or sink is not None:
        raise ValueError("capture takes either a recorder or the options of the built-in records, not both")
    check_attention_function(sites)
    token = _ACTIVE_RECORDER.set(recorder)
    try:
        with calls_heard(sites, "capture"), gates_heard(sites, recorder):
            yield CaptureSession(sites, recorder)
    finally:
        _ACTIVE_RECORDER.reset(token)


def interventions_active() -> bool:
    """Whether any intervention is active in this thread / task (``intervene``)."""
    return bool(_ACTIVE_INTERVENTIONS.get())


def grouped_matmul(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``left`` ``[batch, head, rows, x]`` times ``right`` ``[batch, kv_head, x, y]``, where query head h uses kv
    head h // group: ``[batch, head, rows, y]``. The heads of a group share one product with their kv head,
    so keys and values are never copied once per query head (each decoding step would copy the whole cache)."""
    batch, n_heads, n_rows, width = left.shape
    n_kv_heads = right.shape[1]
    if n_kv_heads == n_heads:
        return torch.matmul(left, right)
    # [batch, kv_head, group * rows, x]: a group's heads are consecutive, so this is a view of left's rows
    stacked = left.reshape(batch, n_kv_heads, (n_heads // n_kv_heads) * n_rows, width)
    return torch.matmul(stacked, right).view(batch, n_heads, n_rows, right.shape[-1])


def attention_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    position_bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q k^T * scaling (+ softcap, bias, mask): the logits of attention, ``[batch, head, q_pos, k_pos]``.

    ``query``: ``[batch, head, q_pos, d_head]``; ``key``: ``[batch, kv_head, k_pos, d_head]``, grouped (see
    :func:`grouped_matmul`) or expanded to ``head``;
    ``attention_mask``: additive float or boolean (True = keep), broadcastable to
    ``[batch, head, q_pos, k_pos]``. Masked logits are the dtype's minimum (finite, so that
    ``0 * logit`` stays 0).
    """
    scores = grouped_matmul(query, key.transpose(2, 3))  # [batch, head, q_pos, k_pos]
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
    site: AttentionSite | None = getattr(module, "attnscope_site", None)  # on the nn.Module: set by load_model
    if site is not None:
        call_heard()  # the blocks open in this context know the function ran
    recorder = _ACTIVE_RECORDER.get()
    if site is None and recorder is not None and not attends_over_no_tokens(module):
        raise unlisted_attention(module)  # attention the adapter did not find: a record would miss it
    if site is None or (recorder is not None and not recorder.wants(site)):
        recorder = None
    if recorder is not None and (misstated := misstated_window(module, cast(AttentionSite, site), kwargs)):
        raise misstated  # the record would state another window than the one this call slides by
    interventions = tuple(i for i in _ACTIVE_INTERVENTIONS.get() if site is not None and i.applies_to(site))
    if isinstance(key, BudgetedStates):  # a budgeted cache's layer: full and streaming KV heads apart
        if interventions:
            raise AttnscopeError("interventions do not run with a budgeted KV cache; mask the same keys on a full "
                                 "cache instead (SinkWindow)")
        scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        output, probs = budgeted_attention(site, recorder, query, key, attention_mask, scaling, kwargs)
        return delivered(recorder, site, output), probs
    selection = selected_keys(module, attention_mask, kwargs, call_causal(site, kwargs), query.shape[2],
                              key.shape[2])
    if recorder is None or interventions or wants_inputs(recorder):  # paths that take a whole mask
        attention_mask, selection = whole_mask(attention_mask, selection, query.shape[2]), None
    if interventions:  # their key masks restrict the keys seen before anything reads the mask, a recorder included
        assert site is not None
        attention_mask = restricted_mask(interventions, site, rows_mask(
            attention_mask, call_causal(site, kwargs), query.shape[2], key.shape[2], 0, query.device),
            query.shape[1], query.shape[2], key.shape[2], query.device)
    if recorder is not None:
        assert site is not None
        hand_inputs(recorder, site, CallInputs(query, key, value, attention_mask,
                                               query.shape[-1] ** -0.5 if scaling is None else float(scaling),
                                               call_causal(site, kwargs), kwargs.get("softcap"), sink_logits(kwargs),
                                               kwargs.get("position_bias")))
    # SDPA has no logit softcapping (Gemma 2) and no learned sinks (gpt-oss): such calls always take the eager path
    sdpa_exact = kwargs.get("softcap") is None and sink_logits(kwargs) is None
    if (site is None or (recorder is None and not interventions)) and sdpa_exact:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    # an intervention changes every row, so only a recorder alone may skip rows or take them in chunks
    only = None if interventions else recorder
    if site is not None and attention_mask is None and selection is None and call_causal(site, kwargs) is None \
            and query.shape[2] > 1:
        raise unknown_causality(module)  # no mask and a module that does not say: which keys are seen is unknown
    n_queries = query.shape[2]
    unwanted = 0 if only is None or site is None else min(only.rows_not_wanted(site, n_queries), n_queries)
    if unwanted and sdpa_exact:
        assert only is not None and site is not None
        output, _ = _fused_with_last_rows(module, only, site, query, key, value,
                                          whole_mask(attention_mask, selection, n_queries), scaling, unwanted, kwargs)
        return delivered(only, site, output), None
    scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    n_heads, n_keys = query.shape[1], key.shape[2]
    causal = call_causal(site, kwargs)
    collector = None if only is None or site is None else only.row_collector(site, value, n_heads=n_heads,
                                                                               n_keys=n_keys)
    if collector is not None:
        assert only is not None and site is not None
        output = chunked_attention(collector, causal, query, expand_kv_heads(key, n_heads),
                                   expand_kv_heads(value, n_heads), attention_mask, scaling, kwargs, selection)
        only.keep_rows(site, collector.finish(n_heads=n_heads, n_kv_heads=key.shape[1], d_head=query.shape[-1],
                                              scaling=scaling))
        return delivered(only, site, output), None
    attention_mask = whole_mask(attention_mask, selection, n_queries)
    if site is not None:  # (a no-op where interventions already made it whole above)
        attention_mask = rows_mask(attention_mask, causal, query.shape[2], n_keys, 0, query.device)
    scores = attention_scores(query, key, attention_mask, scaling, kwargs.get("position_bias"), kwargs.get("softcap"))
    probs, sink_mass = softmax_with_sinks(scores.float(), sink_logits(kwargs))  # [batch, head, q_pos, k_pos]
    if interventions:
        assert site is not None
        allowed = allowed_keys(attention_mask, query.shape[2], n_keys, query.device)
        for intervention in interventions:
            probs = intervention.modify_probs(site, probs, allowed)
        if sink_mass is not None:  # a new pattern leaves to the sink what its rows do not spend
            sink_mass = (1.0 - probs.sum(-1)).clamp_min(0.0)
    if recorder is not None and unwanted < n_queries:
        assert site is not None
        recorder.keep(site, AttentionCall(query, key, value, probs, scaling, sink_mass=sink_mass))
    # dropout of 0 (every inference) returns its input, but costs a call per layer and step
    mixing = (probs if dropout == 0.0 or not module.training else nn.functional.dropout(probs, p=dropout)).to(value.dtype)
    output = grouped_matmul(mixing, value).transpose(1, 2)  # [batch, q_pos, head, d_head]
    for intervention in interventions:
        assert site is not None  # interventions only ever apply to a known site
        output = intervention.modify_output(site, output)
    output = output.contiguous()
    return delivered(recorder, site, output), probs.to(query.dtype)


def restricted_mask(interventions: Sequence[Intervention], site: AttentionSite, attention_mask: torch.Tensor | None,
                    n_heads: int, q_len: int, k_len: int, device: torch.device) -> torch.Tensor | None:
    """The call's mask with every intervention's :meth:`~Intervention.key_mask` taken out: bool ``[batch or 1,
    head or 1, q_pos, k_pos]`` where some intervention restricts keys, else ``attention_mask`` as it was (so a run
    without such an intervention computes exactly what it did before)."""
    masks = [mask for intervention in interventions
             if (mask := intervention.key_mask(site, n_heads, q_len, k_len, device)) is not None]
    if not masks:
        return attention_mask
    allowed = allowed_keys(attention_mask, q_len, k_len, device)
    for mask in masks:
        allowed = allowed & mask.to(device)
    return allowed


def budgeted_attention(site: AttentionSite | None, recorder: Recorder | None, query: torch.Tensor,
                       states: BudgetedStates, attention_mask: torch.Tensor | None, scaling: float,
                       kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of a budgeted cache's layer (:class:`~attnscope.capture.kv_budget.BudgetedStates`): the query heads
    of full KV heads over every key, those of streaming KV heads over their kept keys, with the mask's columns at
    the kept positions and each query's sink + window rule. Returns the output ``[batch, q_pos, head, d_head]`` and,
    where a recorder wants every row, the probabilities over the whole key axis ``[batch, head, q_pos, k_pos]`` (0 at
    evicted keys); the recorder is handed the rows it wants as any eager call's. Rows no one wants run fused
    (SDPA) where that is exact (no softcap, no learned sinks), as on the other paths."""
    if kwargs.get("position_bias") is not None or kwargs.get("indices") is not None:
        raise AttnscopeError("a budgeted KV cache takes attention without position biases or selected keys")
    n_heads, q_len, n_keys = query.shape[1], query.shape[2], states.n_keys
    causal = call_causal(site, kwargs)
    seen = allowed_keys(rows_mask(attention_mask, causal, q_len, n_keys, 0, query.device), q_len, n_keys,
                        query.device)  # [batch or 1, 1, q_pos, k_pos]
    first = None if recorder is None or site is None else min(recorder.rows_not_wanted(site, q_len), q_len)
    if recorder is not None and site is not None and wants_inputs(recorder):
        hand_inputs(recorder, site, CallInputs(query, states.dense("keys"), states.dense("values"),
                                               states.dense_mask(seen, n_heads), scaling, causal, kwargs.get("softcap"),
                                               sink_logits(kwargs)))
    group = n_heads // states.n_kv_heads
    output = query.new_empty((query.shape[0], q_len, n_heads, states.full_values.shape[-1]))
    wanted = None if first is None or first == q_len else first  # the first row whose probabilities are kept
    probs = None if wanted is None else \
        query.new_zeros((query.shape[0], n_heads, q_len - wanted, n_keys), dtype=torch.float32)
    sink_mass = None if probs is None or sink_logits(kwargs) is None else probs.new_zeros(probs.shape[:3])
    parts: list[tuple[tuple[int, ...], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = [
        (states.full_heads, states.full_keys, states.full_values, seen, None)]
    parts += [(part.heads, part.keys, part.values, seen[..., part.positions] & states.stream_mask(part, q_len),
               part.positions) for part in states.streams]
    for kv_heads, keys, values, mask, columns in parts:
        if not kv_heads:
            continue
        heads = [h for kv in kv_heads for h in range(kv * group, (kv + 1) * group)]  # their query heads
        part_probs, part_mass, output[:, :, heads] = part_attention(query[:, heads], keys, values, mask, scaling,
                                                                    kwargs, heads, wanted)
        if probs is not None and part_probs is not None:
            probs[:, heads] = part_probs if columns is None else \
                part_probs.new_zeros((*part_probs.shape[:3], n_keys)).index_copy_(-1, columns, part_probs)
        if sink_mass is not None and part_mass is not None:
            sink_mass[:, heads] = part_mass
    if probs is None:
        return output, None
    assert recorder is not None and site is not None and wanted is not None
    recorder.keep(site, AttentionCall(query[:, :, wanted:], states.dense("keys"), states.dense("values"), probs,
                                      scaling, first_query=wanted, sink_mass=sink_mass))
    return output, probs.to(query.dtype) if wanted == 0 else None


def part_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float,
                   kwargs: Mapping[str, Any], heads: Sequence[int], wanted: int | None
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """One part of a budgeted call: ``query`` ``[batch, head, q_pos, d_head]`` (the part's query heads ``heads``,
    grouped over ``keys``/``values`` ``[batch, kv_head, k, d_head]``), ``mask`` bool ``[batch or 1, 1, q_pos, k]``.
    Returns the probabilities of rows ``wanted..`` ``[batch, head, q_pos - wanted, k]`` float32 and their sink mass
    (None where ``wanted`` is None, or without sinks) and the output ``[batch, q_pos, head, d_head]``: by SDPA where it
    is exact (no softcap, no learned sinks) and not every row is wanted, eagerly otherwise."""
    sinks = sink_logits(kwargs)
    if sinks is not None:
        sinks = sinks[:, heads] if sinks.dim() == 4 else sinks[heads]
    softcap = kwargs.get("softcap")
    if sinks is None and softcap is None and wanted != 0:
        output = nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling,
                                                            enable_gqa=True).transpose(1, 2)
        if wanted is None:
            return None, None, output
        rows = mask[..., wanted:, :] if mask.shape[-2] == query.shape[2] else mask
        return torch.softmax(attention_scores(query[:, :, wanted:], keys, rows, scaling).float(), dim=-1), None, output
    scores = attention_scores(query, keys, mask, scaling, None, softcap)
    probs, sink_mass = softmax_with_sinks(scores.float(), sinks)
    output = grouped_matmul(probs.to(values.dtype), values).transpose(1, 2)
    if wanted is None:
        return None, None, output
    return probs[:, :, wanted:], None if sink_mass is None else sink_mass[:, :, wanted:], output


def delivered(recorder: Recorder | None, site: AttentionSite | None, output: torch.Tensor) -> torch.Tensor:
    """``output`` (``[batch, q_pos, head, d_head]``) of a call ``recorder`` recorded: handed to it where it wants
    head outputs (:func:`~attnscope.capture.recorders.hand_output`), noted for the output gate's reading
    (:func:`~attnscope.capture.gates.returned`)."""
    if recorder is None or site is None:
        return output
    return returned(site, hand_output(recorder, site, output))


def _fused_with_last_rows(module: nn.Module, recorder: Recorder, site: AttentionSite, query: torch.Tensor,
                          key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
                          scaling: float | None, unwanted: int, kwargs: Mapping[str, Any]) -> tuple[torch.Tensor, None]:
    """A call whose first ``unwanted`` query rows the recorder does not want (a long prompt in
    generation): the output by PyTorch's fused SDPA, as without capture, and the probabilities of
    the other rows only, computed as the eager path computes them (none when ``unwanted`` is every row:
    a recorder of head outputs). Memory: one ``[head, q - unwanted, k]`` block, not ``[head, q, k]``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    output, _ = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    if unwanted == query.shape[2]:  # no row at all: the recorder wants the output only
        return output, None
    scaling = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    n_queries = query.shape[2]
    mask = rows_mask(attention_mask, call_causal(site, kwargs), n_queries, key.shape[2], unwanted, query.device)
    wanted = query[:, :, unwanted:]
    probs = torch.softmax(attention_scores(wanted, key, mask, scaling).float(), dim=-1)
    recorder.keep(site, AttentionCall(wanted, key, value, probs, scaling, first_query=unwanted))
    return output, None


@dataclass(frozen=True)
class SelectedKeys:
    """The keys a sparse-attention indexer selected, where the model hands the attention function its selection
    instead of folding it into the mask (DeepSeek sparse attention's ``indices`` ``[batch, q_pos, top_k]``, -1 for
    none), over the call's ``mask`` (``[batch, 1, q_pos or 1, k_pos]``, or None: then every key, or the causal ones
    where ``causal``). Its bool mask is built for the rows asked (:meth:`rows`), so chunked attention holds one
    chunk's ``[chunk, k_pos]``, never the whole ``[q_pos, k_pos]``."""

    indices: torch.Tensor
    mask: torch.Tensor | None
    causal: bool | None
    n_queries: int
    n_keys: int

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Bool ``[batch, 1, end - start, k_pos]``: the keys queries ``start..end-1`` see (True = seen)."""
        indices = self.indices[:, start:end]
        slots = indices.long().masked_fill(indices < 0, self.n_keys)  # -1 lands in a column dropped below
        selected = torch.zeros((*indices.shape[:2], self.n_keys + 1), dtype=torch.bool, device=indices.device)
        selected = selected.scatter_(-1, slots, True)[..., :self.n_keys].unsqueeze(1)  # [batch, 1, rows, k_pos]
        if self.mask is None and self.causal:
            first = self.n_keys - self.n_queries + start  # the position of query start
            return causal_mask(end - start, first, self.n_keys, indices.device) & selected
        mask = self.mask if self.mask is None or self.mask.shape[-2] == 1 else self.mask[:, :, start:end]
        return allowed_keys(mask, end - start, self.n_keys, indices.device) & selected


def selected_keys(module: nn.Module, attention_mask: torch.Tensor | None, kwargs: dict[str, Any],
                  causal: bool | None, n_queries: int, n_keys: int) -> SelectedKeys | None:
    """The keys a sparse-attention indexer selected for this call (:class:`SelectedKeys`: transformers folds DeepSeek
    sparse attention's ``indices`` into the mask for its eager and SDPA implementations only, and passes them to
    any other, a sparse kernel's), or None without a selection; takes ``indices`` out of ``kwargs``. Selected key
    blocks (MiniMax M3's ``block_indices``) are refused: the call does not carry their size."""
    if kwargs.get("block_indices") is not None:
        raise selected_key_blocks(module)
    indices = kwargs.pop("indices", None)
    return None if indices is None else SelectedKeys(indices, attention_mask, causal, n_queries, n_keys)


def whole_mask(attention_mask: torch.Tensor | None, selection: SelectedKeys | None,
               n_queries: int) -> torch.Tensor | None:
    """The call's mask for a path that takes it whole: with a selection, its every row (``[batch, 1, q_pos,
    k_pos]``)."""
    return attention_mask if selection is None else selection.rows(0, n_queries)


def sink_logits(kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """A call's sink logits: gpt-oss's learned ``s_aux`` (one per head) or the ``sinks`` a model computes per query
    (Inkling 2: ``[batch, head, q_pos, 1]``); None without sinks."""
    learned = kwargs.get("s_aux")
    return learned if learned is not None else kwargs.get("sinks")


def _rows(sinks: torch.Tensor | None, start: int, end: int) -> torch.Tensor | None:
    """The sink logits of query rows ``start..end-1``: per-query sinks sliced, per-head ones as they are."""
    return sinks[:, :, start:end] if sinks is not None and sinks.dim() == 4 else sinks


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The softmax of ``scores`` ``[batch, head, q_pos, k_pos]`` and, with sinks (``sinks``: one logit per head,
    gpt-oss's ``s_aux``, or one per query, ``[batch, head, q_pos, 1]``), its sink mass ``[batch, head, q_pos]``.

    A sink is one more logit in each row's denominator with no value behind it: the weights over the real keys
    sum to 1 - sink mass, and the head's output is the sum of those weights times the values, as in the model.
    The sink mass is the softmax's own sink column, not 1 minus a sum (which would lose small masses).
    """
    if sinks is None:
        return torch.softmax(scores, dim=-1), None
    column = sinks.to(scores.device, scores.dtype)
    column = (column if column.dim() == 4 else column.view(1, -1, 1, 1)).expand(*scores.shape[:-1], 1)
    combined = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)  # [batch, head, q_pos, k_pos + 1]
    return combined[..., :-1], combined[..., -1]


def call_causal(site: AttentionSite | None, kwargs: Mapping[str, Any]) -> bool | None:
    """Whether a call with no mask is causal: its ``is_causal`` argument when the model passes one, else its
    site's (the module's own ``is_causal``), as transformers' SDPA path decides; None when neither says."""
    given = kwargs.get("is_causal")
    if given is not None:
        return bool(given)
    return None if site is not None and not site.causal_known else site is not None and site.causal


def rows_mask(attention_mask: torch.Tensor | None, causal: bool | None, n_queries: int, n_keys: int, first: int,
              device: torch.device) -> torch.Tensor | None:
    """The mask of a call's queries ``first..n_queries-1``: the given mask's rows, or, where the lazy
    mask left causality to us (None at a ``causal`` call, a square one), the causal mask of those rows."""
    if attention_mask is not None and attention_mask.shape[-2] == n_queries:
        return attention_mask[..., first:, :]
    if attention_mask is None and causal and n_queries == n_keys > 1:
        return causal_mask(n_queries - first, first, n_keys, device)
    return attention_mask


def causal_mask(q_len: int, start: int, k_len: int, device: torch.device | None = None) -> torch.Tensor:
    """Bool ``[1, 1, q_len, k_len]`` on ``device``: query ``start + i`` may see keys at or before it."""
    queries = torch.arange(start, start + q_len, device=device)[:, None]
    return (torch.arange(k_len, device=device)[None, :] <= queries)[None, None]


def chunked_attention(collector: ChunkCollector, causal: bool | None, query: torch.Tensor, keys: torch.Tensor,
                      values: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float,
                      kwargs: Mapping[str, Any], selection: SelectedKeys | None = None) -> torch.Tensor:
    """Attention of one site ``collector.chunk`` queries at a time, each chunk handed to the
    ``collector``; returns the output ``[batch, q_pos, head, d_head]``. ``causal``: the call's (:func:`call_causal`);
    ``selection``: the keys an indexer selected, over ``attention_mask``, whose mask is built one chunk at a time.

    ``keys``/``values`` are expanded to the query heads. Each chunk computes only the keys some of its
    queries may see: up to its last query for causal attention without a mask, and within the mask's
    span otherwise, so a sliding-window layer costs O(chunk x window), not O(chunk x k_pos), per chunk.
    """
    batch, n_heads, q_len, _ = query.shape
    k_len = keys.shape[2]
    implicit_causal = attention_mask is None and selection is None and causal and q_len == k_len
    output = query.new_empty((batch, q_len, n_heads, values.shape[-1]))
    bias = kwargs.get("position_bias")
    takes_window = "first_key" in inspect.signature(collector.add).parameters
    for start in range(0, q_len, collector.chunk):
        end = min(start + collector.chunk, q_len)
        mask = selection.rows(start, end) if selection is not None else \
            None if attention_mask is None else attention_mask[:, :, start:end]
        first, k_seen = (0, end) if implicit_causal else seen_keys(mask, k_len)
        mask = None if mask is None else mask[..., first:k_seen]
        scores = attention_scores(query[:, :, start:end] * scaling, keys[:, :, first:k_seen], mask, 1.0,
                                  None if bias is None else bias[:, :, start:end, first:k_seen],
                                  kwargs.get("softcap")).float()
        if implicit_causal:  # only the chunk's own square holds future keys
            future = ~causal_mask(end - start, 0, end - start, scores.device)[0, 0]
            scores[..., start:end].masked_fill_(future, torch.finfo(scores.dtype).min)
        probs, sink_mass = softmax_with_sinks(scores, _rows(sink_logits(kwargs), start, end))
        sinks: dict[str, Any] = {} if sink_mass is None else {"sink_mass": sink_mass}  # none for older collectors
        logits = scores if collector.wants_logits else None
        if first and not takes_window:  # a collector written before windows gets every key from 0
            probs, logits, first = *from_key_zero(first, probs, logits), 0
        window: dict[str, Any] = {"first_key": first} if first else {}  # first_key only past key 0, likewise
        collector.add(start, probs, logits, **window, **sinks)
        del logits
        del scores
        output[:, start:end] = torch.matmul(probs.to(values.dtype), values[:, :, first:k_seen]).transpose(1, 2)
    return output


def seen_keys(mask: torch.Tensor | None, k_len: int) -> tuple[int, int]:
    """The keys ``first..k_seen-1`` that the queries of a chunk may see, from the chunk's mask ``[batch, 1 or
    head, chunk, k_pos]`` (every key without a mask). A chunk with a row that sees no key at all keeps every key,
    so that such a row's softmax is spread over every key, as without chunks."""
    if mask is None:
        return 0, k_len
    allowed = allowed_keys(mask, mask.shape[-2], k_len)
    if not bool(allowed.any(-1).all()):
        return 0, k_len
    seen = allowed.flatten(0, 2).any(0).nonzero()[:, 0]  # [k]: keys some query sees
    return int(seen[0]), int(seen[-1]) + 1


def from_key_zero(first: int, probs: torch.Tensor,
                  logits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``probs`` and ``logits`` of keys ``first..`` ``[batch, head, chunk, k]`` widened to start at key 0 (weight 0,
    logit the dtype's minimum)."""
    widened = nn.functional.pad(probs, (first, 0))
    if logits is None:
        return widened, None
    return widened, nn.functional.pad(logits, (first, 0), value=torch.finfo(logits.dtype).min)


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

    recorder = _ACTIVE_RECORDER.get()
    if recorder is not None and recorder.lazy_mask:
        return sdpa_mask(*args, **kwargs)
    return eager_mask(*args, **kwargs)
