"""The Recorder protocol: a recorder written here, knowing nothing of attention.py's insides, gets
the same probabilities as the full record through each of the attention function's paths (eager,
fused with the last rows, chunked), and the attention function never asks which recorder it has."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from attnscope import load_model
from attnscope.capture import attention
from attnscope.capture.attention import capture
from attnscope.capture.decode import _source_ids, step_forward
from attnscope.capture.recorders import AttentionCall, CaptureComplete, Recorder
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


EXEMPT = ("getattr", "module", "attnscope_site")  # the nn.Module's site, set by load_model: not the recorder
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
            if (node.func.id, *args) != EXEMPT:
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
