"""Capture and interventions follow the device of the tensors they are given.

This machine has no GPU, so the device-following checks work by inspection: while a forward pass
runs, :class:`FactoryDevices` (a ``TorchFunctionMode``) sees every tensor factory
(``torch.arange``, ``zeros``, ``tensor``, ...) that attnscope's own code calls. A factory called
without ``device=`` makes its tensor on torch's default device, the CPU, whatever the model runs
on: on a GPU that tensor would meet the model's and fail, or copy every call. So each factory must
name the input's device, and every tensor attnscope's code produces must be on it. On a machine
with CUDA, ``pytest -m gpu`` runs the same checks on ``cuda`` (see docs/gpu.md).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._pytree import tree_leaves

import attnscope
from attnscope import extract, load_model
from attnscope.capture.attention import capture, causal_mask, intervene
from attnscope.capture.extract import encode_window, model_info, model_inputs
from attnscope.capture.plan import CapturePlan, QuerySelection
from attnscope.capture.planned import StreamingSink, batch_facts, planned_records
from attnscope.cli import main
from attnscope.errors import AttnscopeError
from attnscope.experiments.interventions import (
    HeadAblation,
    HeadGates,
    ablation_modes,
    head_output_means,
    n_heads_per_kind,
)
from attnscope.records.attention import AttentionRecord
from tests.conftest import SENTENCES

SOURCE = str(Path(attnscope.__file__).parent)
TORCH = str(Path(torch.__file__).parent)
FACTORIES = _device_constructors()
MOVES = {torch.Tensor.to, torch.Tensor.cpu}  # explicit moves: a streamed record's buffers live on the CPU

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]


def attnscope_caller() -> str | None:
    """``file:line`` of the attnscope code that made the current torch call, or None for anyone else's."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(TORCH):
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(SOURCE):
        return None
    return f"{Path(frame.f_code.co_filename).relative_to(SOURCE)}:{frame.f_lineno}"


class FactoryDevices(TorchFunctionMode):
    """Inside the block, records every factory attnscope's code calls without ``device=`` or with
    another device than ``expected``, and every tensor its code produces elsewhere (in ``wrong``)."""

    def __init__(self, expected: torch.device) -> None:
        super().__init__()
        self.expected = expected
        self.factories = 0
        self.checked = 0  # calls from attnscope's code the checker looked at (factories and the rest)
        self.wrong: list[str] = []

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        caller = attnscope_caller()
        if caller is None:
            return result
        name = getattr(func, "__name__", str(func))
        self.checked += 1
        if func in FACTORIES:
            self.factories += 1
            device = kwargs.get("device")
            if device is None or torch.device(device) != self.expected:
                self.wrong.append(f"{caller}: torch.{name}(device={device})")
        elif func not in MOVES:
            for tensor in tree_leaves(result):
                if isinstance(tensor, torch.Tensor) and tensor.device != self.expected:
                    self.wrong.append(f"{caller}: {name} gave a tensor on {tensor.device}")
        return result


@contextmanager
def watched(device: torch.device) -> Iterator[FactoryDevices]:
    """``FactoryDevices`` around a block that fails the test, naming the calls, if any was wrong."""
    with FactoryDevices(device) as mode:
        yield mode
    assert not mode.wrong, "tensors made off the input's device:\n" + "\n".join(sorted(set(mode.wrong)))


def test_the_checker_catches_a_factory_without_a_device():
    with FactoryDevices(torch.device("cpu")) as mode:
        causal_mask(3, 0, 3)
    assert mode.factories == 2 and len(mode.wrong) == 2 and "attention.py" in mode.wrong[0]
    with FactoryDevices(torch.device("cpu")) as mode:
        causal_mask(3, 0, 3, torch.device("cpu"))
    assert mode.factories == 2 and not mode.wrong


@pytest.fixture(scope="module", params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def models(tiny_model_dir, device: str) -> dict[str, Any]:
    """Tiny BERT, Llama (grouped key/value heads, causal) and BART (encoder-decoder) on ``device``."""
    return {kind: load_model(str(tiny_model_dir(kind)), device=device) for kind in ("bert", "llama", "bart")}


def forward(loaded: Any, plan: CapturePlan | None = None, sink: Any = None, texts: list[str] | None = None,
            changes: AbstractContextManager[Any] | None = None, **options: Any) -> tuple[Any, FactoryDevices]:
    """One captured forward pass of the base model over ``texts``, the checker active only around it."""
    items = texts or SENTENCES[:3]
    if loaded.is_encoder_decoder:  # a given target: no greedy decoding to make one
        items = [(text, SENTENCES[0]) for text in items]
    encoded = encode_window(loaded, list(enumerate(items)), loaded.max_length)
    inputs = model_inputs(loaded, encoded)
    facts = None if plan is None else batch_facts(encoded, plan)
    with ExitStack() as stack:
        stack.enter_context(torch.inference_mode())
        session = stack.enter_context(capture(loaded.sites, plan=plan, facts=facts, sink=sink, **options))
        if changes is not None:
            stack.enter_context(changes)
        mode = stack.enter_context(watched(loaded.input_device))
        loaded.model.base_model(**inputs)
    return (session, encoded), mode


@pytest.mark.parametrize("kind", ["bert", "llama", "bart"])
def test_full_capture_with_qkv_and_norms_follows_the_device(models, kind):
    (session, _), _ = forward(models[kind], qkv=True, norms=True)
    captured = [field for site in session.captured.values()
                for field in (site.attention, site.queries, site.keys, site.values, site.norms)]
    assert captured and {tensor.device for tensor in captured} == {models[kind].input_device}


PLAN = CapturePlan(heads=(0, 2), queries=QuerySelection.parse("1,3,5,-1"), statistics=True, top_k=3, overview=2,
                   chunk=2)


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_planned_capture_follows_the_device_and_its_records_land_on_the_cpu(models, kind):
    loaded = models[kind]
    (session, encoded), mode = forward(loaded, PLAN, norms=True)
    assert mode.factories > 10  # the row collector's factories were seen, and each named the device
    layers = session.layers("self")
    assert {layer.attention.device for layer in layers} == {loaded.input_device}
    records = planned_records(model_info(loaded, session), encoded, layers, PLAN)
    expected = [extract(loaded, text, plan=PLAN, norms=True) for text in SENTENCES[:3]]
    for record, alone in zip(records, expected):
        assert record.arrays.keys() == alone.arrays.keys()
        for name, values in alone.arrays.items():
            np.testing.assert_allclose(record.arrays[name], values, atol=1e-5, err_msg=name)


def test_streamed_capture_writes_from_the_device_into_the_file(models, tmp_path):
    loaded = models["llama"]
    encoded = encode_window(loaded, [(0, SENTENCES[2])], loaded.max_length)
    sink = StreamingSink(tmp_path / "one.safetensors", encoded[0], PLAN, kind="self", n_layers=3, norms=False,
                         float16=True)
    (session, _), _ = forward(loaded, PLAN, sink=sink, texts=[SENTENCES[2]])
    sink.close(model_info(loaded, session))
    streamed = AttentionRecord.open(tmp_path / "one.safetensors")
    alone = extract(loaded, SENTENCES[2], plan=PLAN)
    for name in ("self.attention", "self.stat_entropy", "self.topk_weights", "self.overview"):
        np.testing.assert_allclose(streamed.arrays[name], alone.arrays[name], atol=1e-3, err_msg=name)  # float16


@pytest.mark.parametrize("kind", ["bert", "llama", "bart"])
def test_every_ablation_mode_and_head_gates_follow_the_device(models, kind):
    loaded = models[kind]
    items = [(text, SENTENCES[0]) for text in SENTENCES[:2]]
    encoded = encode_window(loaded, list(enumerate(items)), loaded.max_length)
    inputs = {name: value for name, value in model_inputs(loaded, encoded).items() if name != "use_cache"}
    with watched(loaded.input_device) as checker:
        means = head_output_means(loaded, [inputs])
    seen = [checker]
    gates = {kind: torch.rand(shape, device=loaded.input_device) for kind, shape in n_heads_per_kind(loaded).items()}
    changes = [HeadAblation(mode, heads=[0, 1], means=means) for mode in ablation_modes()] + [HeadGates(gates)]
    for change in changes:
        seen.append(forward(loaded, changes=intervene(change))[1])
    seen.append(forward(loaded, PLAN if kind != "bart" else None, changes=intervene(changes[2]))[1])  # planned
    # every block ran attnscope's code under the checker, and none of it made a tensor off the device
    assert len(seen) == len(ablation_modes()) + 3 and all(checker.checked > 0 for checker in seen)
    assert [checker.wrong for checker in seen] == [[] for _ in seen]


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_physical_pruning_follows_the_device(models, kind, tmp_path):
    from attnscope.experiments.importance import prune_heads, save_pruned

    loaded = models[kind]
    with watched(loaded.input_device) as mode:
        pruned = prune_heads(loaded, {"self": {0: [1, 2]}})
        save_pruned(loaded, {"self": {1: [0]}}, tmp_path)
    assert mode.factories == 5  # four slices of layer 0, one index for the saved zeros
    (session, _), _ = forward(pruned)
    assert session.layers("self")[0].attention.shape[1] < session.layers("self")[1].attention.shape[1]


def test_generation_with_capture_follows_the_device(models):
    loaded = models["llama"]
    with watched(loaded.input_device) as mode, intervene(HeadAblation("uniform", heads=[1])):
        record = attnscope.generate(loaded, SENTENCES[0], max_new_tokens=3, candidates=2)
    assert mode.factories >= 3 and record.arrays["candidate_ids"].shape == (3, 2)


def test_the_step_debugger_follows_the_device(models):
    from attnscope.capture.decode import _source_ids, step_forward

    loaded = models["bart"]
    source = _source_ids(loaded, SENTENCES[0])
    with watched(loaded.input_device):
        logits, cross = step_forward(loaded, source, [loaded.config.decoder_start_token_id, 2000])
    assert logits.device.type == "cpu" and cross.shape == (2, 4, source.shape[1])


# ---- what can be checked without a GPU -------------------------------------------------------------
def test_device_auto_on_the_cpu_captures_the_same_attention(minilm):
    auto = load_model("minilm", device="auto")
    assert auto.device == "auto" and auto.input_device == torch.device("cpu")
    for plan in (None, PLAN):
        expected = extract(minilm, *SENTENCES[:2], plan=plan)
        got = extract(auto, *SENTENCES[:2], plan=plan)
        np.testing.assert_array_equal(got.arrays["self.attention"], expected.arrays["self.attention"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("command", [["report", "--device", "cuda", "text"],
                                     ["report", "--device", "cuda:1", "text"],
                                     ["serve", "--device", "cuda", "--port", "0"],
                                     ["generate", "--device", "cuda", "hello"],
                                     ["toy", "translate", "--device", "cuda", "hello"],
                                     ["report", "--device", "gpu", "text"]])
def test_a_device_this_machine_lacks_is_one_error_line(command, capsys):
    assert main(command) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnscope: error: ") and "device" in lines[0]
    assert "Traceback" not in captured.err


def test_every_command_that_takes_a_model_takes_a_device_and_float16():
    from attnscope.cli import all_commands, build_parser

    from .cli_parsers import parsers

    seen = []
    for command in all_commands():
        for name, parser in parsers(build_parser(command.name)):
            options = {option: action for action in parser._actions for option in action.option_strings}
            if name.startswith(command.name) and "--model" in options:
                seen.append(name)
                assert "--device" in options and "float16" in options["--dtype"].choices, name
    assert {"report", "extract", "serve", "generate", "toy translate", "ablate"} <= set(seen)


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has an Apple GPU")
def test_mps_without_an_apple_gpu_is_refused_before_loading():
    with pytest.raises(AttnscopeError, match="no Apple GPU"):
        load_model("no-such-model", device="mps")  # refused before the model name is even looked at


def test_float16_capture_stays_close_to_float32(minilm):
    half = extract(load_model("minilm", dtype="float16"), *SENTENCES[:2])
    full = extract(minilm, *SENTENCES[:2])
    assert half.attention.dtype == np.float32 and half.model.dtype == "float16"
    assert np.abs(half.attention - full.attention).max() < 0.02


# ---- on a GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@CUDA
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_minilm_on_cuda_matches_the_cpu(minilm, dtype):
    on_gpu = load_model("minilm", device="cuda", dtype=dtype)
    for plan in (None, PLAN):
        expected = extract(minilm, *SENTENCES[:2], plan=plan, norms=True).arrays
        got = extract(on_gpu, *SENTENCES[:2], plan=plan, norms=True).arrays
        for name in ("self.attention", "self.norms"):
            np.testing.assert_allclose(got[name], expected[name], rtol=0.05, atol=1e-4 if dtype == "float32" else 2e-2)


@pytest.mark.parametrize("method", ["alti", "value_zeroing"])
def test_context_mixing_and_its_evaluation_follow_the_device(models, method):
    """Single-text ``mixing --device cuda`` built its inputs on the CPU (and read its arrays back with ``.numpy()``,
    which a CUDA tensor refuses); the faithfulness evaluation's erasure and gradient runs did the same."""
    from attnscope.experiments.faithfulness import prepare_case, sentence_correlations
    from attnscope.experiments.mixing import mixing

    loaded = models["llama"]
    case = prepare_case(loaded, SENTENCES[0])
    assert case is not None
    with watched(loaded.input_device) as mode:  # one sentence on this thread (evaluate_model's workers are unwatched)
        mix = mixing(loaded, SENTENCES[0], method=method)
        row = sentence_correlations(loaded, case, seed=0, methods=[method])
    assert mode.factories >= 3 and mix.rollout.shape[-1] == len(mix.tokens) and method in row
