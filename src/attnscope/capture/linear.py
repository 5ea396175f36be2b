"""Float32 linear layers through oneDNN with prepacked weights, for capture's forward passes.

About three quarters of a capture's time is the model's own float32 linear layers. PyTorch runs
them with MKL's sgemm, which on the AMD EPYC (AVX-512) this was measured on reached about
110 GFLOP/s per core; oneDNN's linear with weights reordered once into its blocked layout reached
about 250 (``benchmarks/extract.py``). :class:`OneDNNLinear` is a ``TorchFunctionMode`` that sends
``F.linear`` calls with float32 CPU tensors to ``torch.ops.mkldnn._linear_pointwise`` (the op
that ``torch.compile`` uses for frozen linear layers) and everything else through unchanged. The
model's modules and classes are not touched, and a mode is local to the thread that enters it.

The result is the same product summed in another order: attention differs from the MKL path by
float32 rounding (a few 1e-6 on MiniLM), as two BLAS libraries do.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def onednn_linear_available() -> bool:
    """True when this torch build has oneDNN and its prepacked linear op."""
    mkldnn_ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available()
            and hasattr(mkldnn_ops, "_linear_pointwise") and hasattr(mkldnn_ops, "_reorder_linear_weight"))


class PackedWeights:
    """oneDNN-layout copies of weight matrices, made on first use and kept while the weight lives.

    A weight changed in place (its version counter moved on) is packed again. Safe to share
    between threads (concurrent batches pack each weight once).
    """

    def __init__(self) -> None:
        self._packed: dict[int, tuple[weakref.ref[torch.Tensor], int | None, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        version = _version(weight)
        with self._lock:
            entry = self._packed.get(id(weight))
            if entry is None or entry[0]() is not weight or version is None or entry[1] != version:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
                entry = (weakref.ref(weight), version, packed)
                self._packed[id(weight)] = entry
            return entry[2]


def _version(tensor: torch.Tensor) -> int | None:
    """The in-place version counter; None for inference tensors, which have none (pack every call)."""
    try:
        return int(tensor._version)
    except RuntimeError:
        return None


class OneDNNLinear(TorchFunctionMode):
    """Within the block, float32 CPU ``F.linear`` calls without autograd run on oneDNN (see module doc)."""

    def __init__(self, packed: PackedWeights) -> None:
        super().__init__()
        self.packed = packed

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and _suits_onednn(*args, **kwargs):
            inputs, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return torch.ops.mkldnn._linear_pointwise(inputs, self.packed.get(weight), bias, "none", [], "")
        return func(*args, **kwargs)


ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def _suits_onednn(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    tensors = (inputs, weight) if bias is None else (inputs, weight, bias)
    return (inputs.dtype in ONEDNN_DTYPES
            and all(t.dtype == inputs.dtype and t.device.type == "cpu" and t.layout == torch.strided for t in tensors)
            and inputs.dim() >= 2 and weight.dim() == 2
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))
