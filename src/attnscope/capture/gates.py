"""Output gates: what a model puts between the attention function's output and the output projection.

Qwen3-Next (and other gated-attention models) multiply the heads' output by a gate computed from the
query's hidden state before the output projection, so head h adds ``a_ij (g_i * v_j) W_O^h`` for key j at
query i, not ``a_ij v_j W_O^h``. The attention function never sees the gate; :func:`gates_heard` hears it:
while a recorder asks for gates (``hears_gates``), the attention function notes what it returned for each
wanted site (:func:`returned`), a forward hook on the site's output projection reads what that projection
was given, and the recorder is told the gate, the one over the other
(:func:`~attnscope.capture.recorders.read_output_gate`; None for a model without one).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from ..models.adapters import AttentionSite
from .hooks import local_hooks
from .recorders import Recorder, read_output_gate

# per site, the output the attention function last returned, while the recorder hears output gates
_RETURNED: ContextVar[dict[AttentionSite, torch.Tensor] | None] = ContextVar("attnscope_returned", default=None)


@contextmanager
def gates_heard(sites: Mapping[nn.Module, AttentionSite], recorder: Recorder) -> Iterator[None]:
    """Inside the block, a recorder that hears output gates (``hears_gates``) is told, each time a wanted site's
    output projection runs, the gate the model put between the attention function's output and that projection
    (:func:`~attnscope.capture.recorders.read_output_gate`; None for most models)."""
    hears = getattr(recorder, "hears_gates", False)  # a recorder written before gates (not subclassing Recorder)
    projections = {site.out_proj: site for site in sites.values()
                   if site.out_proj is not None and hears and recorder.wants(site)}
    if not projections:
        yield
        return
    outputs: dict[AttentionSite, torch.Tensor] = {}

    def hear(module: nn.Module, inputs: tuple[Any, ...], _output: Any) -> None:
        site = projections[module]
        output = outputs.pop(site, None)
        # output: [batch, q_pos, head, d_head], as the attention function returned it; a recorder may stop
        # listening part way (a generation, once each site's first pass showed no gate)
        if output is not None and recorder.hears_gates:
            recorder.output_gate(site, read_output_gate(inputs[0], output))

    token = _RETURNED.set(outputs)
    try:
        with local_hooks(projections, hear):
            yield
    finally:
        _RETURNED.reset(token)


def returned(site: AttentionSite | None, output: torch.Tensor) -> torch.Tensor:
    """``output`` of a recorded call, noted for the output gate's reading when the recorder hears gates."""
    outputs = _RETURNED.get()
    if outputs is not None and site is not None:
        outputs[site] = output
    return output
