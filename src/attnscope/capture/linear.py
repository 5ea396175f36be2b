"""Linear layers through oneDNN with prepacked weights, for capture's forward passes.

About three quarters of a float32 capture's time is the model's own linear layers. PyTorch runs
them with MKL's sgemm, which on the AMD EPYC (AVX-512) of ``benchmarks/extract.py`` reached about
110 GFLOP/s per core on MiniLM's shapes (960x384 by 384x1536); oneDNN's linear with the weight
reordered once into its blocked layout reached about 250. :class:`OneDNNLinear` is a
``TorchFunctionMode`` that sends ``F.linear`` calls on float32 or bfloat16 CPU tensors to
``torch.ops.mkldnn._linear_pointwise`` (the op ``torch.compile`` uses for frozen linear layers)
and lets every other call through unchanged. The model's modules and classes are not touched,
and a mode is local to the thread that enters it.

In float32 the result is the same product summed in another order: attention differs from the
MKL path by float32 rounding (a few 1e-6 on MiniLM), as any two BLAS libraries do. bfloat16
already runs on oneDNN; prepacking only saves the per-call weight reorder (results are identical).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from functools import cache
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

    A weight changed in place (its version counter moved on) or replaced is packed again. Safe
    to share between threads (concurrent batches pack each weight once).
    """

    def __init__(self) -> None:
        self._packed: dict[int, tuple[weakref.ref[torch.Tensor], int, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of ``weight`` (not an inference tensor: those have no version counter)."""
        version = weight._version
        with self._lock:
            entry = self._packed.get(id(weight))
            if entry is None or entry[0]() is not weight or entry[1] != version:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
                entry = (weakref.ref(weight), version, packed)
                self._packed[id(weight)] = entry
            return entry[2]


class OneDNNLinear(TorchFunctionMode):
    """Within the block, float32 and bfloat16 CPU ``F.linear`` calls without autograd run on oneDNN."""

    def __init__(self, packed: PackedWeights) -> None:
        super().__init__()
        self.packed = packed

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            inputs, weight, bias = _linear_arguments(*args, **kwargs)
            if _suits_onednn(inputs, weight, bias):
                return torch.ops.mkldnn._linear_pointwise(inputs, self.packed.get(weight), bias, "none", [], "")
        return func(*args, **kwargs)


def _linear_arguments(input: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``F.linear``'s arguments by its own names, however they were passed."""
    return input, weight, bias


@cache
def onednn_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes oneDNN's packed linear runs on this CPU: float32, and bfloat16 where the CPU has the
    instructions oneDNN's bf16 path needs (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU has not, and
    packing a bf16 weight there raises)."""
    return (torch.float32, torch.bfloat16) if torch.ops.mkldnn._is_mkldnn_bf16_supported() else (torch.float32,)


def _suits_onednn(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Same supported dtype on the CPU, a plain 2-D weight with a version counter, no autograd."""
    tensors = (inputs, weight) if bias is None else (inputs, weight, bias)
    return (inputs.dtype in onednn_dtypes()
            and all(t.dtype == inputs.dtype and t.device.type == "cpu" and t.layout == torch.strided for t in tensors)
            and inputs.dim() >= 2 and weight.dim() == 2 and not weight.is_inference()
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))
