"""Recorders: what a capture keeps of each attention call.

The one attention function (:func:`attnscope.capture.attention.attnscope_attention`) computes
attention and asks the active capture's :class:`Recorder` what to record; it never asks which kind
of recorder it talks to. A recorder says

* which sites it wants (:meth:`~Recorder.wants`); the others run on PyTorch's fused kernel;
* how many of a call's first query rows it does not need (:meth:`~Recorder.rows_not_wanted`, 0 for
  most): those rows run fused, and only the others' probabilities are computed;
* whether it takes a call's rows chunk by chunk (:meth:`~Recorder.row_collector` returns a
  :class:`ChunkCollector`): the call is then computed in query chunks, so no ``[q_pos, k_pos]``
  block exists, and what the collector finishes with goes to :meth:`~Recorder.keep_rows`;
* whether the mask builder should give SDPA's lazy mask (``lazy_mask``: None where only causality
  masks, so a long input builds no ``[q_pos, k_pos]`` mask; chunked computation masks causally itself);
* what to keep of an eager call (:meth:`~Recorder.keep`, given the call's tensors as an
  :class:`AttentionCall`);
* whether it wants each call's per-head output (``wants_head_outputs``: then :meth:`~Recorder.keep_output`
  gets ``[batch, q_pos, head, d_head]``, on every path, fused included; a recorder that does not ask costs
  nothing more);
* whether it wants what each call was given (``wants_inputs``: then :meth:`~Recorder.keep_inputs` gets a
  :class:`CallInputs`, the queries, keys, values and mask, before the call runs on whichever path).

A recorder raises :class:`CaptureComplete` itself once it has everything it wants.

The recorders: :class:`FullRecord` (everything, a :class:`SiteCapture` per ``(kind, layer)``) and
:class:`PlannedRecord` (what a :class:`~attnscope.capture.plan.CapturePlan` asks for, a
:class:`~attnscope.capture.rows.RowCapture` per layer of the input side), which
:func:`~attnscope.capture.attention.capture` builds from its options;
:class:`~attnscope.capture.generate.StepRows` (generation, every call's rows as they come),
``capture.decode``'s newest cross-attention rows and :class:`HeadOutputs` (each site's per-head output, no
rows: activation patching's clean run, mean ablation's references), passed as ``capture(sites, recorder=...)``;
:class:`RecorderGroup` hands every call to several recorders (a generation's rows and its attribution).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import nn

from ..errors import AttnscopeError
from ..models.adapters import AttentionSite
from .plan import CapturePlan
from .rows import Allocate, BatchFacts, RowCapture, RowCollector


class CaptureComplete(Exception):
    """Raised by a recorder once it has every site it wants: the rest of the forward pass (the last
    feed-forward block, final norm, pooler) cannot change what was captured, so it is skipped."""


@dataclass(slots=True)
class AttentionCall:
    """The tensors of one eagerly computed attention call, as a recorder receives them.

    ``query``: ``[batch, head, q_row, d_head]``, the rows whose probabilities were computed: the
    call's queries ``first_query..`` (the earlier ones were not wanted, see
    :meth:`Recorder.rows_not_wanted`); ``key``/``value``: ``[batch, kv_head, k_pos, d_head]``, every
    key of the call as the model gave them (grouped: query head h reads kv head h // group), and
    :attr:`keys`/:attr:`values` the same expanded to the query heads (a copy, made when asked);
    ``probs``: ``[batch, head, q_row, k_pos]`` float32, after any intervention; ``sink_mass``:
    ``[batch, head, q_row]``, what a model with learned sinks (gpt-oss) gives its sink logit, so that
    each row of ``probs`` sums to 1 minus it (None without sinks).
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    probs: torch.Tensor
    scaling: float
    first_query: int = 0
    sink_mass: torch.Tensor | None = None

    @property
    def d_head(self) -> int:
        return int(self.query.shape[-1])

    @property
    def n_kv_heads(self) -> int:
        return int(self.key.shape[1])

    @property
    def keys(self) -> torch.Tensor:
        """``[batch, head, k_pos, d_head]``: the keys expanded to the query heads."""
        return expand_kv_heads(self.key, self.probs.shape[1])

    @property
    def values(self) -> torch.Tensor:
        """``[batch, head, k_pos, d_head]``: the values expanded to the query heads."""
        return expand_kv_heads(self.value, self.probs.shape[1])

    def last_values(self, n_keys: int) -> torch.Tensor:
        """The values of the call's last ``n_keys`` keys, expanded to the query heads: ``[batch, head, n_keys,
        d_head]`` (only those are copied: a generation step adds one key)."""
        return expand_kv_heads(self.value[:, :, self.value.shape[2] - n_keys :], self.probs.shape[1])


@dataclass(slots=True)
class CallInputs:
    """What the attention function was given for one call, before it computed anything (handed to a recorder that
    sets ``wants_inputs``, on every path, fused included).

    ``query``: ``[batch, head, q_pos, d_head]`` and ``key``/``value``: ``[batch, kv_head, k_pos, d_head]``, as the model
    gave them (after rotary embeddings and any query/key norms; grouped); ``attention_mask``: the call's mask (None,
    bool with True = seen, or additive), any sparse selection already folded in; ``scaling``: the factor of ``q k^T``;
    ``causal``: whether a call without a mask is causal (None: it does not say); ``softcap``, ``sinks`` (learned sink
    logits, per head or per query) and ``position_bias`` as the model passed them (None without)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attention_mask: torch.Tensor | None
    scaling: float
    causal: bool | None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    position_bias: torch.Tensor | None = None


def expand_kv_heads(states: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``[batch, kv_head, pos, d_head]`` -> ``[batch, head, pos, d_head]``; query head h uses kv head h // group."""
    group = n_heads // states.shape[1]
    return states if group == 1 else states.repeat_interleave(group, dim=1)


class ChunkCollector(Protocol):
    """Takes one site's probabilities a query chunk at a time (:class:`~attnscope.capture.rows.RowCollector`)."""

    chunk: int  # queries per chunk
    wants_logits: bool  # whether :meth:`add` should also get the logits (they make the entropy cheaper)

    def add(self, start: int, probs: torch.Tensor, logits: torch.Tensor | None = None, *,
            sink_mass: torch.Tensor | None = None, first_key: int = 0) -> None:
        """Probabilities of queries ``start..`` over keys ``first_key..``: ``[batch, head, chunk, k]`` float32 (the
        other keys are 0), and with learned sinks their sink mass ``[batch, head, chunk]``."""

    def finish(self, *, n_heads: int, n_kv_heads: int, d_head: int, scaling: float) -> Any:
        """What was collected, handed to :meth:`Recorder.keep_rows`."""


class Recorder(Protocol):
    """What the attention function asks of a capture (see the module docstring).

    Subclass it to inherit the defaults: every site, every row, eager calls, the eager mask.
    """

    lazy_mask: bool = False  # True: the mask builder gives SDPA's lazy mask (for chunked calls)
    hears_gates: bool = False  # True: :meth:`output_gate` hears each wanted call's output gate (or None)
    wants_head_outputs: bool = False  # True: :meth:`keep_output` gets each wanted call's per-head output
    wants_inputs: bool = False  # True: :meth:`keep_inputs` gets each wanted call's queries, keys, values and mask

    def wants(self, site: AttentionSite) -> bool:
        """Whether to record ``site``; the attention function runs the others fused (without interventions)."""
        return True

    def rows_not_wanted(self, site: AttentionSite, n_queries: int) -> int:
        """How many of a call's first queries need no row: they run fused, the others' rows are
        computed (asked without interventions only). ``n_queries`` (or more): no row at all, the whole call
        runs fused and :meth:`keep` is not called (a recorder of head outputs only)."""
        return 0

    def row_collector(self, site: AttentionSite, values: torch.Tensor, *, n_heads: int,
                      n_keys: int) -> ChunkCollector | None:
        """A collector for a call computed in query chunks (``values``: ``[batch, kv_head, k_pos, d_head]``, as
        the model gave them; :func:`expand_kv_heads` widens them to the query heads), or None for an eager call
        (asked without interventions only)."""
        return None

    def keep(self, site: AttentionSite, call: AttentionCall) -> None:
        """Keep what is wanted of an eager call."""
        return  # the defaults do nothing; a body, so type checkers do not take them for abstract methods

    def keep_rows(self, site: AttentionSite, collected: Any) -> None:
        """Keep what the collector of a chunked call finished with."""
        raise TypeError(f"{type(self).__name__} gives a row collector, so it must keep its rows (keep_rows)")

    def keep_output(self, site: AttentionSite, output: torch.Tensor) -> None:
        """The call's per-head output ``[batch, q_pos, head, d_head]``: what the model hands its output projection
        (before it: ``W_O`` and any output gate not applied), after any intervention, on whichever path the call ran
        (asked when :attr:`wants_head_outputs`, after :meth:`keep` or :meth:`keep_rows`). Before the projection
        because that is what its consumers read (a head's output patched or mean-ablated is replaced there; a
        head's direct logit term is it times ``W_O^h``), and it is ``head`` times smaller than its ``[head, d_model]`` image."""
        return

    def keep_inputs(self, site: AttentionSite, inputs: CallInputs) -> None:
        """What a wanted call was given (asked when :attr:`wants_inputs`, before anything is computed, on whichever
        path the call then runs): the route walk recomputes only the rows it reaches from them."""
        return

    def output_gate(self, site: AttentionSite, gate: torch.Tensor | None) -> None:
        """The gate ``[batch, head, q_pos, d_head]`` by which the model multiplied the output of ``site``'s call
        just kept before its output projection (Qwen3-Next), or None (asked when :attr:`hears_gates`, once the
        projection ran; see :func:`read_output_gate`)."""
        return


def hand_output(recorder: Recorder, site: AttentionSite, output: torch.Tensor) -> torch.Tensor:
    """Give ``recorder`` a wanted call's per-head output ``[batch, q_pos, head, d_head]`` where it asks for head
    outputs (:attr:`Recorder.wants_head_outputs`; a recorder written before them has no such flag); returns it."""
    if getattr(recorder, "wants_head_outputs", False):
        recorder.keep_output(site, output)
    return output


def wants_inputs(recorder: Recorder | None) -> bool:
    """Whether ``recorder`` asks for what each wanted call was given (:attr:`Recorder.wants_inputs`; a recorder
    written before it has no such flag)."""
    return recorder is not None and bool(getattr(recorder, "wants_inputs", False))


def hand_inputs(recorder: Recorder, site: AttentionSite, inputs: CallInputs) -> None:
    """Give ``recorder`` what a wanted call was given where it asks for it (:func:`wants_inputs`)."""
    if wants_inputs(recorder):
        recorder.keep_inputs(site, inputs)


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
    sink_mass: torch.Tensor | None = None  # [batch, head, q_pos]: learned sinks' share of each row (gpt-oss)
    gate: torch.Tensor | None = None  # [batch, head, q_pos, d_head]: the model's output gate (Qwen3-Next), if heard
    first_query: int = 0  # the call's queries before this one have no row here (the recorder did not want them)

    @property
    def n_heads(self) -> int:
        return int(self.attention.shape[1])


class Sink(Protocol):
    """Where a streaming capture puts each site's results as they are produced (``records.format``)."""

    def allocate(self, site: AttentionSite) -> Allocate: ...

    def finish(self, site: AttentionSite, captured: RowCapture) -> RowCapture: ...


def main_kind(sites: Iterable[AttentionSite]) -> str:
    """The input side's kind of attention: ``encoder`` for encoder-decoders, else ``self``."""
    return "encoder" if any(site.kind == "encoder" for site in sites) else "self"


def value_norms(values: torch.Tensor, site: AttentionSite, per_head: torch.Tensor | None = None) -> torch.Tensor:
    """||v_j W_O^h|| for every head h and key j: ``[batch, head, k_pos, d_head]`` -> ``[batch, head, k_pos]``.

    ``W_O^h`` is head h's slice of the output projection (Kobayashi et al. 2020, without the
    output bias, which is added once after the heads are summed); ``per_head``: see :func:`transformed_values`.
    """
    return transformed_values(values, site, per_head).norm(dim=-1)


def transformed_values(values: torch.Tensor, site: AttentionSite, per_head: torch.Tensor | None = None) -> torch.Tensor:
    """Kobayashi et al.'s f^h(x_j) = v_j^h W_O^h: ``[batch, head, k_pos, d_head]`` -> ``[batch, head, k_pos, d_model]``
    (float32, without the output bias). ``per_head``: :func:`per_head_out_proj` made contiguous once, for a caller
    that asks many times (a generation step by step: the strided view would be copied by every product)."""
    if per_head is None:
        per_head = per_head_out_proj(site, values.shape[1], unavailable="norms")  # [head, d_head, d_model]
    return torch.matmul(values.float(), per_head)  # [batch, head, k_pos, d_model]; batched matmul beats einsum here


def per_head_out_proj(site: AttentionSite, n_heads: int, *, unavailable: str = "") -> torch.Tensor:
    """``W_O`` split by head: ``[head, d_head, d_model]``, a float32 view of the weight (no copy for a
    float32 model). Without an output projection: one error line, naming what is ``unavailable``."""
    if site.out_proj is None:
        raise AttnscopeError(f"no output projection found for {site.name}"
                             + (f"; {unavailable} are unavailable for this model" if unavailable else ""))
    weight = cast(torch.Tensor, site.out_proj.weight).detach().float()
    if site.conv1d:
        weight = weight.t()  # Conv1D stores [in, out]; make it [out, in] like nn.Linear
    return weight.view(weight.shape[0], n_heads, -1).permute(1, 2, 0)


def read_output_gate(merged: torch.Tensor, output: torch.Tensor) -> torch.Tensor | None:
    """The gate a model multiplied its heads' output by before the output projection (Qwen3-Next's gated
    attention: ``sigmoid(x W_g)`` per query, head and channel), ``[batch, head, q_pos, d_head]``: what the
    projection was given (``merged``: ``[batch, q_pos, head * d_head]``) over what the attention function
    returned (``output``: ``[batch, q_pos, head, d_head]``); None when the projection was given that output
    itself. A channel whose output is exactly 0 reads as gate 1 (its weight cannot be read).
    """
    batch, n_queries, n_heads, d_head = output.shape
    if merged.shape != (batch, n_queries, n_heads * d_head):
        raise AttnscopeError(f"the output projection was given {list(merged.shape)}, not the {n_heads} heads' output "
                             f"[{batch}, {n_queries}, {n_heads * d_head}]: what a head adds per key cannot be read")
    given = merged.float().view(batch, n_queries, n_heads, d_head)
    computed = output.float()
    gate = torch.where(computed != 0, given / torch.where(computed != 0, computed, 1.0), 1.0).transpose(1, 2)
    rounding = max(1e-5, 4 * torch.finfo(merged.dtype).eps)  # a half-precision copy of the output is no gate
    return None if bool(torch.allclose(gate, torch.ones_like(gate), rtol=0.0, atol=rounding)) else gate.contiguous()


def refuse_gated_norms(site: AttentionSite, gate: torch.Tensor | None, what: str) -> None:
    """Refuse norms ``what`` cannot hold for a model with an output gate (they would leave the gate out)."""
    if gate is not None:
        raise AttnscopeError(f"{site.name} multiplies its heads' output by a gate (gated attention), so what a head "
                             f"adds for key j depends on the query; {what} cannot hold that: capture without a plan "
                             "(attnscope extract --norms) or use attnscope mixing --method norm")


GATED_CHUNK = 1 << 22  # elements of the [head, q, k, d_head] products held at once by gated_value_norms


def gated_value_norms(values: torch.Tensor, gate: torch.Tensor, site: AttentionSite) -> torch.Tensor:
    """||(g_i * v_j) W_O^h|| for every head h, query i and key j: what head h adds for key j at query i per unit
    of weight, with the model's output gate ``g`` (``[batch, head, q_pos, d_head]``); ``values``: ``[batch, head,
    k_pos, d_head]``. Returns ``[batch, head, q_pos, k_pos]``, from the quadratic form of ``W_O^h W_O^h^T``
    (``[head, d_head, d_head]``), a few queries at a time."""
    per_head = per_head_out_proj(site, values.shape[1], unavailable="norms")  # [head, d_head, d_model]
    gram = torch.matmul(per_head, per_head.transpose(1, 2))  # [head, d_head, d_head]
    values, gate = values.float(), gate.float()
    batch, n_heads, n_keys, d_head = values.shape
    step = max(1, GATED_CHUNK // (batch * n_heads * n_keys * d_head))
    pieces = []
    for start in range(0, gate.shape[2], step):
        scaled = gate[:, :, start : start + step, None, :] * values[:, :, None]  # [batch, head, q, k_pos, d_head]
        projected = torch.einsum("bhqkd,hde->bhqke", scaled, gram)
        pieces.append((scaled * projected).sum(-1).clamp_min(0.0).sqrt())
    return torch.cat(pieces, dim=2)


class PerSite(Recorder):
    """A recorder that keeps one capture per ``(kind, layer)`` (the last call's), in ``captured``, and
    counts the calls per ``(kind, layer)`` in ``calls`` (a model that runs a layer twice in one forward
    pass has no single attention for it).

    ``stop_after``: the sites whose arrival completes the capture (:class:`CaptureComplete`), or None.
    """

    def __init__(self, stop_after: frozenset[tuple[str, int]] | None) -> None:
        self.stop_after = stop_after
        self.captured: dict[tuple[str, int], Any] = {}
        self.calls: Counter[tuple[str, int]] = Counter()

    def layers(self, kind: str) -> list[Any]:
        """Captures of ``kind``, ordered by layer."""
        return [self.captured[key] for key in sorted(k for k in self.captured if k[0] == kind)]

    def store(self, site: AttentionSite, captured: Any) -> None:
        """Keep ``captured`` as ``site``'s; stop the forward once every wanted site is in."""
        self.captured[(site.kind, site.layer)] = captured
        self.calls[(site.kind, site.layer)] += 1
        if self.stop_after is not None and self.stop_after <= self.captured.keys():
            raise CaptureComplete


def _stop_after(recorder: Recorder, sites: Mapping[nn.Module, AttentionSite],
                stop_when_complete: bool) -> frozenset[tuple[str, int]] | None:
    """Every site ``recorder`` wants, when it should stop once they are in."""
    return frozenset((s.kind, s.layer) for s in sites.values() if recorder.wants(s)) if stop_when_complete else None


class FullRecord(PerSite):
    """Everything: a :class:`SiteCapture` per ``(kind, layer)``, with ``qkv`` the queries, keys and
    values, with ``norms`` the norm-weighted attention ``||a_ij v_j W_O||`` (``record=False``: nothing).

    A model that gates its heads' output before the output projection (Qwen3-Next) adds ``a_ij (g_i * v_j) W_O``
    for key j: with ``norms`` or ``qkv`` the recorder hears the gate (:func:`read_output_gate`), keeps it
    (``SiteCapture.gate``) and puts it in the norms; a capture that stops early then waits for the last
    projection."""

    def __init__(self, sites: Mapping[nn.Module, AttentionSite], *, record: bool = True, qkv: bool = False,
                 norms: bool = False, stop_when_complete: bool = False) -> None:
        self.record, self.qkv, self.norms = record, qkv, norms
        self.hears_gates = record and (norms or qkv)
        self.pending: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}  # probs, values: gate not heard
        super().__init__(_stop_after(self, sites, stop_when_complete))

    def wants(self, site: AttentionSite) -> bool:
        return self.record

    def keep(self, site: AttentionSite, call: AttentionCall) -> None:
        result = SiteCapture(attention=call.probs.detach(), n_kv_heads=call.n_kv_heads, d_head=call.d_head,
                             scaling=call.scaling, first_query=call.first_query, sink_mass=call.sink_mass)
        if self.qkv:
            result.queries, result.keys, result.values = (t.detach().float() for t in (call.query, call.keys,
                                                                                      call.values))
        if self.norms:
            result.norms = call.probs.detach() * value_norms(call.values.detach(), site)[:, :, None, :]
        if not self.hears_gates:
            self.store(site, result)
            return
        self.captured[(site.kind, site.layer)] = result  # stored once its gate is heard (output_gate)
        self.pending[(site.kind, site.layer)] = (call.probs.detach(), call.values.detach())

    def output_gate(self, site: AttentionSite, gate: torch.Tensor | None) -> None:
        """Put the model's output gate, if any, in the norms of the call just kept."""
        key = (site.kind, site.layer)
        if key not in self.pending:
            return
        probs, values = self.pending.pop(key)
        result = self.captured.pop(key)
        result.gate = gate
        if gate is not None and self.norms:
            result.norms = probs * gated_value_norms(values, gate, site)
        self.store(site, result)


class PlannedRecord(PerSite):
    """What ``plan`` asks for, of the input side's chosen layers only: a
    :class:`~attnscope.capture.rows.RowCapture` per layer, gathered by a
    :class:`~attnscope.capture.rows.RowCollector` chunk by chunk (``facts``: the batch's).

    With a ``sink``, the collector's large fields are views of the file being written and each
    finished layer goes through ``sink.finish``. Under an intervention the attention function
    hands over the full eager probabilities, which are fed to a collector chunk by chunk.
    """

    lazy_mask = True

    def __init__(self, sites: Mapping[nn.Module, AttentionSite], plan: CapturePlan, facts: BatchFacts | None, *,
                 record: bool = True, norms: bool = False, sink: Sink | None = None,
                 stop_when_complete: bool = False) -> None:
        self.plan, self.facts, self.record, self.norms, self.sink = plan, facts, record, norms, sink
        self.hears_gates = record and norms and plan.attention  # norm-weighted rows cannot hold a gate
        self.kind = main_kind(sites.values())
        super().__init__(_stop_after(self, sites, stop_when_complete))

    def wants(self, site: AttentionSite) -> bool:
        return self.record and site.kind == self.kind and self.plan.wants_layer(site.layer)

    def row_collector(self, site: AttentionSite, values: torch.Tensor, *, n_heads: int, n_keys: int) -> RowCollector:
        """``values``: ``[batch, kv_head, k_pos, d_head]``, for the norms."""
        assert self.facts is not None, "a planned capture needs the batch's facts"
        norms = value_norms(expand_kv_heads(values, n_heads), site) if self.norms else None
        return RowCollector(self.plan, self.facts, n_heads=n_heads, n_keys=n_keys, causal=site.causal,
                            value_norms=norms, allocate=None if self.sink is None else self.sink.allocate(site),
                            device=values.device)

    def keep(self, site: AttentionSite, call: AttentionCall) -> None:
        """An eager call (under an intervention): the full matrix, kept chunk by chunk."""
        probs, chunk = call.probs, self.plan.chunk
        collector = self.row_collector(site, call.values.detach(), n_heads=probs.shape[1], n_keys=probs.shape[-1])
        for start in range(0, probs.shape[2], chunk):
            sink_mass = None if call.sink_mass is None else call.sink_mass[:, :, start : start + chunk]
            collector.add(start, probs[:, :, start : start + chunk].detach(), sink_mass=sink_mass)
        self.keep_rows(site, collector.finish(n_heads=probs.shape[1], n_kv_heads=call.n_kv_heads, d_head=call.d_head,
                                              scaling=call.scaling))

    def keep_rows(self, site: AttentionSite, collected: RowCapture) -> None:
        self.store(site, collected if self.sink is None else self.sink.finish(site, collected))

    def output_gate(self, site: AttentionSite, gate: torch.Tensor | None) -> None:
        refuse_gated_norms(site, gate, "the norm-weighted rows of a planned capture")


def built_in_recorder(sites: Mapping[nn.Module, AttentionSite], *, record: bool = True, qkv: bool = False,
                      norms: bool = False, stop_when_complete: bool = False, plan: CapturePlan | None = None,
                      facts: BatchFacts | None = None, sink: Sink | None = None) -> PerSite:
    """The recorder of :func:`~attnscope.capture.attention.capture`'s options: with a ``plan``, the
    planned record (``qkv`` does not apply), else the full record (``facts`` and ``sink`` do not apply)."""
    if plan is not None:
        return PlannedRecord(sites, plan, facts, record=record, norms=norms, sink=sink,
                             stop_when_complete=stop_when_complete)
    return FullRecord(sites, record=record, qkv=qkv, norms=norms, stop_when_complete=stop_when_complete)


class HeadOutputs(Recorder):
    """Every ``kinds`` site's per-head output of the forward passes run inside the capture, the last call's per
    ``(kind, layer)``: ``outputs[(kind, layer)]`` ``[batch, q_pos, head, d_head]``, before the output projection
    (activation patching's clean run, mean ablation's references). It wants no row, so every call runs fused
    (unless an intervention is active: then the output is the one the intervention left).

    >>> heads = HeadOutputs()
    >>> with capture(loaded.sites, recorder=heads):   # doctest: +SKIP
    ...     loaded.model(**inputs)
    >>> heads.of_kind("self")[0].shape                # [batch, q_pos, head, d_head]  # doctest: +SKIP
    """

    wants_head_outputs = True

    def __init__(self, kinds: Iterable[str] = ("self",)) -> None:
        self.kinds = frozenset(kinds)
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}

    def wants(self, site: AttentionSite) -> bool:
        return site.kind in self.kinds

    def rows_not_wanted(self, site: AttentionSite, n_queries: int) -> int:
        return n_queries

    def keep_output(self, site: AttentionSite, output: torch.Tensor) -> None:
        self.outputs[(site.kind, site.layer)] = output.detach()

    def of_kind(self, kind: str = "self") -> dict[int, torch.Tensor]:
        """``{layer: [batch, q_pos, head, d_head]}`` of attention ``kind``."""
        return {layer: output for (k, layer), output in self.outputs.items() if k == kind}


class RecorderGroup(Recorder):
    """Several recorders over one capture: each call goes to every member that wants its site.

    A call is computed for the most any member needs: the fewest unwanted rows (a member gets rows from
    ``first_query`` on and keeps those it wants, as it does under an intervention, where every row is computed),
    eagerly (no member's row collector is asked: a member that collects rows in chunks keeps an eager call
    whole) and with the eager mask unless every member asks for the lazy one. Gates and head outputs go to the
    members that ask for them.
    """

    def __init__(self, *members: Recorder) -> None:
        self.members = members
        self.lazy_mask = all(getattr(m, "lazy_mask", False) for m in members)

    def _wanting(self, site: AttentionSite) -> list[Recorder]:
        return [member for member in self.members if member.wants(site)]

    # The flags are the members': read-only (a setter that refuses, as a property without one does, so they may
    # stand for Recorder's plain attributes)
    @property
    def hears_gates(self) -> bool:  # read at each projection: a member may stop listening part way (StepRows)
        return any(getattr(m, "hears_gates", False) for m in self.members)

    @hears_gates.setter
    def hears_gates(self, value: bool) -> None:
        raise AttributeError("a recorder group hears gates where a member does")

    @property
    def wants_head_outputs(self) -> bool:
        return any(getattr(m, "wants_head_outputs", False) for m in self.members)

    @wants_head_outputs.setter
    def wants_head_outputs(self, value: bool) -> None:
        raise AttributeError("a recorder group wants head outputs where a member does")

    @property
    def wants_inputs(self) -> bool:
        return any(getattr(m, "wants_inputs", False) for m in self.members)

    @wants_inputs.setter
    def wants_inputs(self, value: bool) -> None:
        raise AttributeError("a recorder group wants inputs where a member does")

    def keep_inputs(self, site: AttentionSite, inputs: CallInputs) -> None:
        for member in self._wanting(site):
            if getattr(member, "wants_inputs", False):
                member.keep_inputs(site, inputs)

    def wants(self, site: AttentionSite) -> bool:
        return bool(self._wanting(site))

    def rows_not_wanted(self, site: AttentionSite, n_queries: int) -> int:
        return min(member.rows_not_wanted(site, n_queries) for member in self._wanting(site))

    def keep(self, site: AttentionSite, call: AttentionCall) -> None:
        for member in self._wanting(site):
            member.keep(site, call)

    def keep_output(self, site: AttentionSite, output: torch.Tensor) -> None:
        for member in self._wanting(site):
            if getattr(member, "wants_head_outputs", False):
                member.keep_output(site, output)

    def output_gate(self, site: AttentionSite, gate: torch.Tensor | None) -> None:
        for member in self._wanting(site):
            if getattr(member, "hears_gates", False):
                member.output_gate(site, gate)
