"""Capture's oneDNN linear layers: same records as PyTorch's default GEMM, and no side effects."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnscope import extract_corpus, load_model
from attnscope.capture.linear import OneDNNLinear, PackedWeights, onednn_linear_available

from .conftest import SENTENCES, TINY_ARCHITECTURES

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear")

ITEMS = [(SENTENCES[0], SENTENCES[1]), SENTENCES[2], SENTENCES[3], SENTENCES[4]]


def mode_stack_depth() -> int:
    return torch._C._len_torch_function_stack()


@pytest.mark.parametrize("kind", TINY_ARCHITECTURES)
def test_onednn_records_equal_default_gemm_records(kind, tiny_model_dir):
    loaded = load_model(str(tiny_model_dir(kind)))
    options = {"batch_size": 2, "qkv": True, "norms": True, "progress": False}
    fast = list(extract_corpus(loaded, ITEMS, onednn=True, **options))
    default = list(extract_corpus(loaded, ITEMS, onednn=False, **options))
    for a, b in zip(fast, default, strict=True):
        assert a.tokens == b.tokens and a.arrays.keys() == b.arrays.keys()
        for key in a.arrays:
            np.testing.assert_allclose(a.arrays[key], b.arrays[key], atol=1e-5, rtol=0, err_msg=f"{kind}/{key}")
        np.testing.assert_allclose(a.attention, b.attention, atol=1e-6, rtol=0, err_msg=kind)


def test_onednn_on_the_default_model_matches_default_gemm(minilm):
    fast = list(extract_corpus(minilm, SENTENCES, batch_size=3, progress=False))
    default = list(extract_corpus(minilm, SENTENCES, batch_size=3, progress=False, onednn=False))
    for a, b in zip(fast, default, strict=True):
        np.testing.assert_allclose(a.attention, b.attention, atol=1e-5, rtol=0)


def test_bfloat16_capture_runs_on_every_cpu():
    """oneDNN's bfloat16 linear needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; on an AVX2-only CPU packing a bf16 weight
    raised, so extract --dtype bfloat16 over several batches failed. There bf16 linears keep PyTorch's path."""
    loaded = load_model("minilm", dtype="bfloat16")
    fast = list(extract_corpus(loaded, SENTENCES, batch_size=2, progress=False, onednn=True))
    default = list(extract_corpus(loaded, SENTENCES, batch_size=2, progress=False, onednn=False))
    for a, b in zip(fast, default, strict=True):
        np.testing.assert_allclose(a.attention, b.attention, atol=2e-2, rtol=0)  # bfloat16's own rounding


def test_by_default_one_batch_keeps_the_default_gemm(minilm):
    default = list(extract_corpus(minilm, SENTENCES[:3], batch_size=3, progress=False, onednn=False))
    auto = list(extract_corpus(minilm, SENTENCES[:3], batch_size=3, progress=False))
    for a, b in zip(auto, default, strict=True):
        np.testing.assert_array_equal(a.attention, b.attention)


def test_the_mode_is_not_active_between_yields(minilm):
    before = mode_stack_depth()
    records = extract_corpus(minilm, SENTENCES, batch_size=2, progress=False, onednn=True)
    next(records)
    assert mode_stack_depth() == before
    records.close()


def test_a_weight_changed_in_place_is_packed_again():
    layer = torch.nn.Linear(4, 3)
    inputs = torch.randn(2, 5, 4)
    packed = PackedWeights()
    with torch.inference_mode():
        with OneDNNLinear(packed):
            layer(inputs)
        layer.weight.mul_(2.0)
        with OneDNNLinear(packed):
            got = layer(inputs)
        expected = layer(inputs)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_autograd_and_other_dtypes_take_the_default_path():
    layer = torch.nn.Linear(4, 3)
    with OneDNNLinear(PackedWeights()):
        output = layer(torch.randn(2, 4))
        half = torch.nn.functional.linear(torch.randn(2, 4, dtype=torch.bfloat16), layer.weight.bfloat16())
    assert output.requires_grad and output.grad_fn is not None
    assert half.dtype == torch.bfloat16


def test_keyword_arguments_and_inference_tensor_weights_work():
    inputs, weight, bias = torch.randn(2, 4), torch.randn(3, 4), torch.randn(3)
    with torch.inference_mode():
        frozen_weight = torch.randn(3, 4)  # an inference tensor has no version counter: default path
        with OneDNNLinear(PackedWeights()):
            by_name = torch.nn.functional.linear(input=inputs, weight=weight, bias=bias)
            frozen = torch.nn.functional.linear(inputs, frozen_weight)
        torch.testing.assert_close(by_name, torch.nn.functional.linear(inputs, weight, bias))
        torch.testing.assert_close(frozen, torch.nn.functional.linear(inputs, frozen_weight))
