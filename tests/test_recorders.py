"""The Recorder protocol: a recorder written here, knowing nothing of attention.py's insides, gets
the same probabilities as the full record through each of the attention function's paths (eager,
fused with the last rows, chunked), and the attention function never asks which recorder it has."""

from __future__ import annotations

import ast
import inspect
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from attnscope import load_model
from attnscope.capture import attention
from attnscope.capture.attention import capture
from attnscope.capture.decode import _source_ids, step_forward
from attnscope.capture.recorders import AttentionCall, CaptureComplete, HeadOutputs, Recorder, RecorderGroup
from attnscope.models.adapters import AttentionSite

from .conftest import SENTENCES

KINDS = ["llama", "bert", "bart"]


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    return {kind: load_model(str(tiny_model_dir(kind))) for kind in KINDS}


def inputs_of(loaded: Any) -> dict[str, torch.Tensor]:
    ids = torch.tensor([loaded.tokenizer(SENTENCES[2])["input_ids"]])
    if loaded.is_encoder_decoder:
        return {"input_ids": ids, "decoder_input_ids": ids[:, :7]}
    return {"input_ids": ids}


def full_record(loaded: Any) -> dict[tuple[str, int], torch.Tensor]:
    """Every site's probabilities ``[batch, head, q_pos, k_pos]`` from the built-in full record."""
    with torch.inference_mode(), capture(loaded.sites) as session:
        loaded.model(**inputs_of(loaded), use_cache=False)
    return {key: site.attention for key, site in session.captured.items()}


class MaxWeight:
    """Keeps the largest attention weight of each ``(kind, layer)``, per head: ``[batch, head]``.
    Not a subclass of Recorder: the protocol is structural."""

    lazy_mask = False

    def __init__(self) -> None:
        self.largest: dict[tuple[str, int], torch.Tensor] = {}

    def wants(self, site: AttentionSite) -> bool:
        return True

    def rows_not_wanted(self, site: AttentionSite, n_queries: int) -> int:
        return 0

    def row_collector(self, site: AttentionSite, values: torch.Tensor, *, n_heads: int, n_keys: int) -> None:
        return None

    def keep(self, site: AttentionSite, call: AttentionCall) -> None:
        self.largest[(site.kind, site.layer)] = call.probs.amax(dim=(-2, -1))

    def keep_rows(self, site: AttentionSite, collected: Any) -> None:
        raise AssertionError("no chunked call was asked for")


@pytest.mark.parametrize("kind", KINDS)
def test_a_recorder_written_here_gets_the_full_records_probabilities(models, kind):
    loaded = models[kind]
    expected = full_record(loaded)
    recorder = MaxWeight()
    with torch.inference_mode(), capture(loaded.sites, recorder=recorder) as session:
        loaded.model(**inputs_of(loaded), use_cache=False)
    assert session.recorder is recorder
    assert recorder.largest.keys() == expected.keys() and len(expected) == len(loaded.sites)
    for key, probs in expected.items():
        assert torch.equal(recorder.largest[key], probs.amax(dim=(-2, -1))), key  # the same eager computation


class ChunkMax:
    """Row maxima ``[batch, head, q_pos]`` gathered two queries at a time."""

    chunk, wants_logits = 2, False

    def __init__(self, batch: int, n_heads: int, n_queries: int) -> None:
        self.rows = torch.full((batch, n_heads, n_queries), float("nan"))
        self.starts: list[int] = []

    def add(self, start: int, probs: torch.Tensor, logits: torch.Tensor | None = None) -> None:
        self.starts.append(start)
        self.rows[:, :, start : start + probs.shape[2]] = probs.amax(-1)

    def finish(self, *, n_heads: int, n_kv_heads: int, d_head: int, scaling: float) -> torch.Tensor:
        return self.rows


class RowMaxima(Recorder):
    """Self-attention only, every call in query chunks, with SDPA's lazy mask (as planned capture does)."""

    lazy_mask = True

    def __init__(self, n_queries: int) -> None:
        self.n_queries, self.maxima, self.collectors = n_queries, {}, []

    def wants(self, site: AttentionSite) -> bool:
        return site.kind == "self"

    def row_collector(self, site: AttentionSite, values: torch.Tensor, *, n_heads: int, n_keys: int) -> ChunkMax:
        self.collectors.append(ChunkMax(values.shape[0], n_heads, self.n_queries))
        return self.collectors[-1]

    def keep_rows(self, site: AttentionSite, collected: torch.Tensor) -> None:
        self.maxima[site.layer] = collected


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_a_chunked_recorder_written_here_gets_every_row(models, kind):
    loaded = models[kind]
    expected = full_record(loaded)
    n_queries = inputs_of(loaded)["input_ids"].shape[1]
    recorder = RowMaxima(n_queries)
    with torch.inference_mode(), capture(loaded.sites, recorder=recorder):
        loaded.model(**inputs_of(loaded), use_cache=False)
    assert sorted(recorder.maxima) == sorted(layer for kind_, layer in expected if kind_ == "self")
    assert all(c.starts == list(range(0, n_queries, 2)) for c in recorder.collectors)
    for layer, maxima in recorder.maxima.items():  # chunked sums in another order: equal to float32 rounding
        np.testing.assert_allclose(maxima, expected[("self", layer)].amax(-1), atol=1e-6)


class LastRow(Recorder):
    """Only each call's last query row; stops the forward once the first ``stop_after`` layers are in."""

    def __init__(self, stop_after: int) -> None:
        self.stop_after, self.rows, self.first_queries = stop_after, {}, []

    def rows_not_wanted(self, site: AttentionSite, n_queries: int) -> int:
        return n_queries - 1

    def keep(self, site: AttentionSite, call: AttentionCall) -> None:
        self.rows[site.layer] = call.probs[:, :, -1]  # [batch, head, k_pos]
        self.first_queries.append(call.first_query)
        if len(self.rows) == self.stop_after:
            raise CaptureComplete


def test_a_recorder_that_wants_the_last_row_only_and_stops_early(models):
    loaded = models["llama"]
    expected = full_record(loaded)
    n_queries = inputs_of(loaded)["input_ids"].shape[1]
    recorder = LastRow(stop_after=2)
    with torch.inference_mode(), capture(loaded.sites, recorder=recorder), pytest.raises(CaptureComplete):
        loaded.model(**inputs_of(loaded), use_cache=False)
    assert sorted(recorder.rows) == [0, 1] and recorder.first_queries == [n_queries - 1] * 2  # layer 2 never ran
    for layer, row in recorder.rows.items():  # the rows before ran fused: equal to float32 rounding
        np.testing.assert_allclose(row, expected[("self", layer)][:, :, -1], atol=1e-6)


def test_the_step_debuggers_recorder_keeps_the_full_records_newest_cross_rows(models):
    loaded = models["bart"]
    source = _source_ids(loaded, SENTENCES[2])
    prefix = [loaded.config.decoder_start_token_id, 2000, 2001]
    _, cross = step_forward(loaded, source, prefix)  # [layer, head, source_pos]
    with torch.inference_mode(), capture(loaded.sites) as session:
        loaded.model(input_ids=source, decoder_input_ids=torch.tensor([prefix]), use_cache=False)
    expected = np.stack([layer.attention[0, :, -1].numpy() for layer in session.layers("cross")])
    # the encoder's and decoder's self-attention now run fused, not eagerly: float32 rounding apart
    np.testing.assert_allclose(cross, expected, atol=1e-6)


def test_a_recorder_excludes_the_built_in_records_options(models):
    with pytest.raises(ValueError, match="either a recorder or"), capture(models["llama"].sites, recorder=MaxWeight(),
                                                                          norms=True):
        pass


EXEMPT = {("getattr", "module", "attnscope_site"),  # the nn.Module's site, set by load_model: not the recorder
          ("isinstance", "key", "BudgetedStates")}  # the key states a budgeted KV cache's layer returns: not the recorder
ASKING_THE_TYPE = {"isinstance", "getattr", "hasattr", "type"}
THE_COMPUTATION = ("attnscope_attention", "_fused_with_last_rows", "chunked_attention", "attnscope_mask")
CONCRETE = {"FullRecord", "PlannedRecord", "PerSite", "StepRows", "NewestCrossRows", "RowCollector", "CapturePlan",
            "Sink", "BatchFacts"}


def test_the_attention_function_never_asks_which_recorder_it_has():
    tree = ast.parse(Path(inspect.getfile(attention)).read_text(encoding="utf-8"))
    asked = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ASKING_THE_TYPE:
            args = tuple(a.id if isinstance(a, ast.Name) else a.value if isinstance(a, ast.Constant) else None
                         for a in node.args[:2])
            if (node.func.id, *args) not in EXEMPT:
                asked.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert asked == []
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in THE_COMPUTATION]
    assert len(functions) == len(THE_COMPUTATION)
    named = {(f.name, n.id) for f in functions for n in ast.walk(f) if isinstance(n, ast.Name) and n.id in CONCRETE}
    named |= {(f.name, n.attr) for f in functions for n in ast.walk(f)
              if isinstance(n, ast.Attribute) and n.attr in {"plan", "sink", "step_sink", "qkv", "norms", "captured"}}
    assert named == set(), "the computation names a kind of recorder or its options"


@pytest.mark.parametrize("n_heads, n_kv_heads", [(9, 3), (4, 1), (6, 6)])
def test_grouped_products_equal_products_with_the_heads_expanded(n_heads, n_kv_heads):
    """What the attention function computes without copying the cache per query head equals the product with
    keys and values expanded (query head h reads kv head h // group), and AttentionCall expands the same way."""
    from attnscope.capture.attention import grouped_matmul
    from attnscope.capture.recorders import expand_kv_heads

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, n_heads, 3, 8, generator=generator)  # [batch, head, q_pos, d_head]
    key = torch.randn(2, n_kv_heads, 5, 8, generator=generator)  # [batch, kv_head, k_pos, d_head]
    group = n_heads // n_kv_heads
    by_head = torch.stack([query[:, h] @ key[:, h // group].transpose(1, 2) for h in range(n_heads)], dim=1)
    torch.testing.assert_close(grouped_matmul(query, key.transpose(2, 3)), by_head, rtol=1e-6, atol=1e-6)
    probs = torch.softmax(by_head, dim=-1)
    call = AttentionCall(query, key, key, probs, 1.0)
    assert torch.equal(call.keys, expand_kv_heads(key, n_heads)) and call.n_kv_heads == n_kv_heads
    assert torch.equal(call.last_values(2), call.values[:, :, -2:])


# ---- head outputs --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def perturbed_llama(tiny_model_dir, tmp_path_factory):
    """The tiny Llama (grouped key/value heads) with seeded N(0, 0.1) added to every weight: attention far from
    uniform, so a wrong head or position cannot hide."""
    import transformers

    folder = tmp_path_factory.mktemp("perturbed-llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(tiny_model_dir("llama")).save_pretrained(folder)
    return folder


def eager_head_outputs(folder: Path, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """By hand, from transformers' own eager implementation: ``output_attentions=True``'s weights times each head's
    values (``v_proj``'s output, split by key/value head): ``{layer: [batch, q_pos, head, d_head]}``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    config = model.config
    n_heads, n_kv_heads = config.num_attention_heads, config.num_key_value_heads
    values: dict[int, torch.Tensor] = {}
    handles = [layer.self_attn.v_proj.register_forward_hook(
        lambda module, args, output, index=index: values.__setitem__(index, output))
        for index, layer in enumerate(model.model.layers)]
    try:
        with torch.inference_mode():
            weights = model(input_ids=ids, output_attentions=True, use_cache=False).attentions
    finally:
        for handle in handles:
            handle.remove()
    outputs = {}
    for layer, probs in enumerate(weights):  # probs: [batch, head, q_pos, k_pos]
        batch, n_keys, _ = values[layer].shape
        v = values[layer].view(batch, n_keys, n_kv_heads, -1).transpose(1, 2)  # [batch, kv_head, k_pos, d_head]
        v = v.repeat_interleave(n_heads // n_kv_heads, dim=1)  # query head h reads kv head h // group
        outputs[layer] = torch.matmul(probs, v).transpose(1, 2)  # [batch, q_pos, head, d_head]
    return outputs


class RowsAndOutputs(Recorder):
    """Rows from ``first`` on, and (``wants_head_outputs``) the head outputs it is handed."""

    def __init__(self, first: int, outputs: bool) -> None:
        self.first, self.wants_head_outputs = first, outputs
        self.kept: list[int] = []
        self.outputs: dict[int, torch.Tensor] = {}

    def rows_not_wanted(self, site: AttentionSite, n_queries: int) -> int:
        return self.first

    def keep(self, site: AttentionSite, call: AttentionCall) -> None:
        self.kept.append(call.first_query)

    def keep_output(self, site: AttentionSite, output: torch.Tensor) -> None:
        self.outputs[site.layer] = output.clone()


def test_head_outputs_run_fused_and_equal_eager_weights_times_values(perturbed_llama, monkeypatch):
    """HeadOutputs asks for no row, so no call is computed eagerly (``attention_scores`` would refuse); what it
    gets equals transformers' eager weights times the values, per head."""
    loaded = load_model(str(perturbed_llama))
    ids = torch.tensor([loaded.tokenizer(SENTENCES[2])["input_ids"]])
    expected = eager_head_outputs(perturbed_llama, ids)

    def no_eager(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a recorder of head outputs made a call eager")

    monkeypatch.setattr(attention, "attention_scores", no_eager)
    heads = HeadOutputs()
    with torch.inference_mode(), capture(loaded.sites, recorder=heads):
        loaded.model(input_ids=ids, use_cache=False)
    got = heads.of_kind("self")
    assert sorted(got) == sorted(expected) == list(range(loaded.config.num_hidden_layers))
    for layer, output in got.items():
        assert output.shape == (1, ids.shape[1], loaded.config.num_attention_heads, 8)
        np.testing.assert_allclose(output.numpy(), expected[layer].numpy(), atol=1e-5)


def test_a_group_gives_its_members_rows_and_head_outputs_from_one_pass(perturbed_llama):
    """The last rows (fused with the last rows) and the head outputs in one pass: the outputs equal eager's."""
    loaded = load_model(str(perturbed_llama))
    ids = torch.tensor([loaded.tokenizer(SENTENCES[2])["input_ids"]])
    expected = eager_head_outputs(perturbed_llama, ids)
    rows, heads = RowsAndOutputs(ids.shape[1] - 1, outputs=False), HeadOutputs()
    with torch.inference_mode(), capture(loaded.sites, recorder=RecorderGroup(rows, heads)):
        loaded.model(input_ids=ids, use_cache=False)
    assert rows.kept == [ids.shape[1] - 1] * loaded.config.num_hidden_layers and rows.outputs == {}
    for layer, output in heads.of_kind("self").items():
        np.testing.assert_allclose(output.numpy(), expected[layer].numpy(), atol=1e-5)


@pytest.mark.parametrize("path", ["eager", "fused with the last rows", "under an intervention"])
def test_a_recorder_not_asking_for_head_outputs_receives_none(perturbed_llama, path):
    loaded = load_model(str(perturbed_llama))
    ids = torch.tensor([loaded.tokenizer(SENTENCES[2])["input_ids"]])
    first = ids.shape[1] - 1 if path == "fused with the last rows" else 0
    silent, asking = RowsAndOutputs(first, outputs=False), RowsAndOutputs(first, outputs=True)
    for recorder in (silent, asking):  # an intervention that changes nothing still makes every call eager
        changes = attention.intervene(attention.Intervention()) if path == "under an intervention" else nullcontext()
        with torch.inference_mode(), changes, capture(loaded.sites, recorder=recorder):
            loaded.model(input_ids=ids, use_cache=False)
    assert silent.kept == asking.kept and len(silent.kept) == loaded.config.num_hidden_layers
    assert silent.outputs == {} and sorted(asking.outputs) == list(range(loaded.config.num_hidden_layers))
