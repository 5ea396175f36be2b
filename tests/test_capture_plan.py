"""Planned capture (selection, statistics, top-k, overview, streaming) against full capture.

The reference is always the full ``[layer, head, q_pos, k_pos]`` matrix of an ordinary capture
(itself tested against ``output_attentions=True``), and statistics computed from it directly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnscope import load_model
from attnscope.capture.extract import extract, extract_corpus
from attnscope.capture.plan import CapturePlan, MemoryEstimate, QuerySelection, check_memory, estimate_capture_memory
from attnscope.errors import AttnscopeError
from attnscope.records.attention import AttentionRecord
from attnscope.records.format import distance_bin_edges

TEXTS = ["The cat sat on the mat because it was tired, and the dog slept by the door all afternoon.",
         "Attention heads often look at the previous token or at punctuation marks in the sentence.",
         "Hello."]


def reference_statistics(matrix: np.ndarray, special: np.ndarray, causal: bool) -> dict[str, np.ndarray]:
    """Row statistics computed directly from ``[layer, head, q, k]``, one loop per row."""
    n_layers, n_heads, n, _ = matrix.shape
    out = {name: np.full((n_layers, n_heads, n), np.nan) for name in
           ("first", "special", "self", "prev", "next", "entropy", "distance", "max_weight")}
    for q in range(n):
        row = matrix[:, :, q, :].astype(np.float64)
        out["first"][:, :, q] = row[..., 0]
        out["special"][:, :, q] = row[..., special].sum(-1)
        out["self"][:, :, q] = row[..., q]
        if q > 0:
            out["prev"][:, :, q] = row[..., q - 1]
        if q + 1 < n and not causal:
            out["next"][:, :, q] = row[..., q + 1]
        positive = np.where(row > 0, row, 1.0)
        out["entropy"][:, :, q] = -(row * np.log(positive)).sum(-1)
        out["distance"][:, :, q] = (row * np.abs(q - np.arange(n))).sum(-1)
        out["max_weight"][:, :, q] = row.max(-1)
    return out


def reference_histogram(matrix: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``[layer, head, bin]``: mass at each distance bin, summed over ``rows``."""
    n = matrix.shape[-1]
    edges = distance_bin_edges(n)
    hist = np.zeros((*matrix.shape[:2], len(edges)))
    for q in rows:
        for k in range(n):
            b = next(i for i, (lo, hi) in enumerate(edges) if lo <= abs(q - k) <= hi)
            hist[:, :, b] += matrix[:, :, q, k]
    return hist


@pytest.fixture(scope="module", params=["llama", "bert"])
def model(request, tiny_model_dir):
    return load_model(str(tiny_model_dir(request.param)))


def test_statistics_equal_the_full_matrix(model):
    plan = CapturePlan(attention=False, statistics=True, chunk=5)  # chunks smaller than the input
    planned = list(extract_corpus(model, TEXTS, batch_size=3, plan=plan, progress=False))
    for text, record in zip(TEXTS, planned):
        full = extract(model, text)
        assert record.is_partial and record.layers_held == tuple(range(full.n_layers))
        expected = reference_statistics(full.attention, full.special_mask.astype(bool), full.model.causal)
        for name, values in record.statistics.items():
            np.testing.assert_allclose(values, expected[name], atol=1e-5, err_msg=name)
        rows = np.arange(len(full.tokens))
        np.testing.assert_allclose(record.held("distance_histogram"), reference_histogram(full.attention, rows),
                                   atol=1e-5)


def test_selection_keeps_only_the_chosen_rows_layers_and_heads(model):
    layers, heads = (1,), (0, 2)
    plan = CapturePlan(layers=layers, heads=heads, queries=QuerySelection.parse("every:3"), chunk=4)
    for text in TEXTS[:2]:
        full = extract(model, text)
        record = extract(model, text, plan=plan)
        positions = np.arange(0, len(full.tokens), 3)
        np.testing.assert_array_equal(record.query_positions, positions)
        assert record.held().shape == (1, 2, len(positions), len(full.tokens))
        expected = full.attention[np.ix_(layers, heads, positions)]
        np.testing.assert_allclose(record.held(), expected, atol=1e-6)
        np.testing.assert_allclose(record.head_rows(1, 2), full.attention[1, 2, positions], atol=1e-6)
        with pytest.raises(AttnscopeError, match="partial"):
            record.attention  # noqa: B018 - the consumer that assumes [L, H, T, T] is told clearly
        with pytest.raises(AttnscopeError, match="not in this record"):
            record.head_rows(0, 0)


def test_top_k_and_overview(model):
    text = TEXTS[0]
    full = extract(model, text)
    plan = CapturePlan(attention=False, top_k=4, overview=3, queries=QuerySelection.parse("last:5"), chunk=7)
    record = extract(model, text, plan=plan)
    n = len(full.tokens)
    rows = np.arange(n - 5, n)
    weights, indices = record.held("topk_weights"), record.held("topk_indices")
    expected = np.sort(full.attention[:, :, rows], axis=-1)[..., ::-1][..., :4]
    np.testing.assert_allclose(weights, expected, atol=1e-6)
    picked = np.take_along_axis(full.attention[:, :, rows], indices.astype(np.int64), axis=-1)
    np.testing.assert_allclose(picked, weights, atol=1e-6)
    blocks = -(-n // 3)
    overview = np.zeros((*full.attention.shape[:2], blocks, blocks))
    for i in range(blocks):
        for j in range(blocks):
            overview[:, :, i, j] = full.attention[:, :, 3 * i : 3 * i + 3, 3 * j : 3 * j + 3].sum(-1).mean(-1)
    np.testing.assert_allclose(record.held("overview"), overview, atol=1e-6)
    np.testing.assert_allclose(record.held("overview").sum(-1), 1.0, atol=1e-5)


def test_top_k_beyond_the_keys_keeps_one_slot_per_key(model, tmp_path):
    """``--top-k 50000`` on a short input wrote K slots per row whatever its length (issue 36): each record keeps
    its own keys, whole rows sorted, in memory (a batch of different lengths) and streamed."""
    from attnscope.capture.extract import extract_to_file

    plan = CapturePlan(attention=False, top_k=1000)
    records = list(extract_corpus(model, TEXTS, plan=plan, progress=False))
    records.append(extract_to_file(model, TEXTS[2], path=tmp_path / "short.safetensors", plan=plan, progress=False))
    for text, record in zip([*TEXTS, TEXTS[2]], records, strict=True):
        full = extract(model, text).attention
        assert record.held("topk_weights").shape == full.shape  # [layer, head, q_pos, one slot per key]
        np.testing.assert_allclose(record.held("topk_weights"), np.sort(full, axis=-1)[..., ::-1], atol=1e-6)


@pytest.mark.parametrize("streamed", [False, True])
def test_the_memory_estimate_counts_top_k_up_to_the_keys_that_exist(streamed):
    def estimate(top_k: int) -> int:
        plan = CapturePlan(attention=False, statistics=True, top_k=top_k)
        return estimate_capture_memory(plan, n_layers=6, n_heads=12, length=5, streamed=streamed).total

    assert estimate(50_000) == estimate(5) > estimate(4) > estimate(0)


def test_planned_record_saves_loads_and_opens_lazily(model, tmp_path):
    plan = CapturePlan(layers=(0,), statistics=True, top_k=3)
    record = extract(model, TEXTS[1], plan=plan)
    path = record.save(tmp_path / "rec.safetensors")
    for again in (AttentionRecord.load(path), AttentionRecord.open(path)):
        assert again.selection == record.selection
        assert again.holdings() == record.holdings()
        for key, value in record.arrays.items():
            np.testing.assert_array_equal(np.asarray(again.arrays[key]), value, err_msg=key)
    lazy = AttentionRecord.open(path)
    assert isinstance(lazy.arrays["self.attention" if "self.attention" in lazy.arrays else "encoder.attention"].base,
                      np.memmap)


def test_query_selection_parsing():
    assert QuerySelection.parse("last").positions(5).tolist() == [4]
    assert QuerySelection.parse("last:2").positions(5).tolist() == [3, 4]
    assert QuerySelection.parse("span:1:3").positions(5).tolist() == [1, 2]
    assert QuerySelection.parse("0,-1").positions(5).tolist() == [0, 4]
    for bad in ("every:0", "span:x", "", "7"):
        with pytest.raises(AttnscopeError):
            QuerySelection.parse(bad).positions(5)


def test_memory_estimate_refuses_with_one_clear_line():
    full = estimate_capture_memory(None, n_layers=30, n_heads=9, length=4096)
    stats = estimate_capture_memory(CapturePlan(attention=False, statistics=True), n_layers=30, n_heads=9,
                                    length=4096)
    assert full.kept == 2 * 30 * 9 * 4096 * 4096 * 4  # the whole float32 matrix of every layer, stacked once
    assert stats.total < full.total / 50
    with pytest.raises(AttnscopeError, match=r"needs about .* GiB .* available; keep less \(attnscope extract with --stats"):
        check_memory(full, what="capturing", available=8 * 2**30)
    check_memory(MemoryEstimate(kept=1, working=1), what="capturing", available=8 * 2**30)


@pytest.mark.parametrize("float16", [False, True])
def test_streamed_record_equals_planned_capture(model, tmp_path, float16):
    from attnscope.capture.extract import extract_to_file

    plan = CapturePlan(heads=(1, 3), statistics=True, top_k=5, overview=4, chunk=6)
    in_memory = extract(model, TEXTS[0], plan=plan)
    streamed = extract_to_file(model, TEXTS[0], path=tmp_path / "long.safetensors", plan=plan, float16=float16,
                               progress=False)
    assert streamed.selection == in_memory.selection and streamed.tokens == in_memory.tokens
    assert streamed.model == in_memory.model
    tolerance = 1e-3 if float16 else 1e-6
    for key, value in in_memory.arrays.items():
        np.testing.assert_allclose(np.asarray(streamed.arrays[key], dtype=np.float64), value, atol=tolerance,
                                   err_msg=key)
    if float16:
        assert streamed.held("attention").dtype == np.float16


def test_streaming_everything_equals_full_capture(model, tmp_path):
    from attnscope.capture.extract import extract_to_file

    full = extract(model, TEXTS[1])
    streamed = extract_to_file(model, TEXTS[1], path=tmp_path / "all.safetensors", progress=False)
    np.testing.assert_allclose(streamed.held(), full.attention, atol=1e-6)


@pytest.mark.parametrize("alias", ["minilm", "smollm2", "toy-translator"])
def test_each_alias_knows_its_real_limit_and_truncates_with_a_warning(alias):
    from attnscope.models.registry import ALIASES

    if not ALIASES[alias].installed:
        pytest.skip(f"{alias} is not installed or built")
    loaded = load_model(alias)
    assert loaded.max_length == ALIASES[alias].max_tokens
    text = "word " * (ALIASES[alias].max_tokens + 10)
    plan = CapturePlan(attention=False, statistics=True, layers=(0,))
    why = "the model's limit" if loaded.max_length <= 40 else f"chosen; the model takes up to {loaded.max_length}"
    with pytest.warns(UserWarning, match=rf"truncated to {min(40, loaded.max_length)} \({why}\)"):
        record = extract(loaded, text, plan=plan, max_length=40)
    assert len(record.tokens) == min(40, loaded.max_length)


def test_partial_statistics_equal_head_statistics_of_the_full_matrix(tiny_model_dir):
    """The per-head means of a stats-only record against analysis.head_statistics on the full record."""
    from attnscope.analysis import head_statistics, partial_statistics

    model = load_model(str(tiny_model_dir("bert")))
    full = extract(model, TEXTS[0])
    record = extract(model, TEXTS[0], plan=CapturePlan(attention=False, statistics=True, chunk=6))
    table = partial_statistics(record).set_index(["layer", "head"])
    expected = head_statistics(full)
    for ours, theirs in (("self", "self"), ("prev", "prev"), ("next", "next"), ("entropy", "entropy"),
                         ("max_weight", "max_weight")):
        np.testing.assert_allclose(table[ours].to_numpy().reshape(expected[theirs].shape), expected[theirs],
                                   atol=1e-5, err_msg=ours)
    # head_statistics divides the distance sum by the number of queries: the same mean over all rows
    np.testing.assert_allclose(table["distance"].to_numpy().reshape(expected["mean_distance"].shape),
                               expected["mean_distance"], atol=1e-4)
    shares = table.filter(like="dist_").to_numpy()
    np.testing.assert_allclose(shares.sum(1), 1.0, atol=1e-6)
    with pytest.raises(AttnscopeError, match="head statistics"):
        head_statistics(record)


def test_damaged_or_unfinished_partial_records_are_refused(model, tmp_path):
    from dataclasses import replace

    from attnscope.records.format import RecordWriter

    plan = CapturePlan(layers=(0,), statistics=True, top_k=3, overview=4)
    record = extract(model, TEXTS[1], plan=plan)
    kind = record.model.main_kind
    arrays = dict(record.arrays)
    arrays[f"{kind}.stat_first"] = arrays[f"{kind}.stat_first"][:, :, :-1]  # one row short
    path = replace(record, arrays=arrays).save(tmp_path / "short.safetensors")
    for read in (AttentionRecord.load, AttentionRecord.open):
        with pytest.raises(AttnscopeError, match="stat_first has .* rows"):
            read(path)
    arrays = dict(record.arrays)
    arrays[f"{kind}.overview"] = arrays[f"{kind}.overview"][:, :, :1, :1]
    with pytest.raises(AttnscopeError, match="overview has 1 query blocks"):
        AttentionRecord.load(replace(record, arrays=arrays).save(tmp_path / "overview.safetensors"))
    unfinished = tmp_path / "unfinished.safetensors"
    RecordWriter(unfinished, {"self.attention": ("float32", (1, 1, 2, 2))}, {"complete": False})
    with pytest.raises(AttnscopeError, match="was not finished"):
        AttentionRecord.open(unfinished)


def test_a_streamed_long_record_keeps_all_its_metadata(model, tmp_path):
    """A long input's tokens and text make metadata far larger than a short one's (an 8,192-token
    benchmark run once outgrew the header): the header reserves room for them."""
    from attnscope.capture.extract import extract_to_file

    text = " ".join(f"«Ünïcode» word{i} \"quoted\"" for i in range(2000))
    record = extract_to_file(model, text, path=tmp_path / "long.safetensors", max_length=10**6, progress=False,
                             plan=CapturePlan(attention=False, statistics=True, layers=(0,)))
    again = AttentionRecord.open(tmp_path / "long.safetensors")
    assert again.text == (text,) and again.tokens == record.tokens and len(record.tokens) > 500


def test_histogram_of_selected_rows_equals_the_full_matrix(model):
    """Rows that are not contiguous (every 3rd, a span) within chunks of another width."""
    full = extract(model, TEXTS[0])
    for spec in ("every:3", "span:4:17", "0,5,6,20"):
        plan = CapturePlan(attention=False, statistics=True, queries=QuerySelection.parse(spec), chunk=7)
        record = extract(model, TEXTS[0], plan=plan)
        expected = reference_histogram(full.attention, record.query_positions)
        np.testing.assert_allclose(record.held("distance_histogram"), expected, atol=1e-5, err_msg=spec)


def selected_keys_call(n: int = 40, top_k: int = 6) -> tuple[torch.Tensor, ...]:
    """Queries, keys, values ``[1, 4, n, 16]`` and an indexer's selection ``[1, n, top_k]`` (keys at or before each
    query, -1 where it has fewer), seeded."""
    generator = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn((1, 4, n, 16), generator=generator) for _ in range(3))
    scores = torch.rand((n, n), generator=generator).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -1.0)
    chosen = scores.topk(top_k, dim=-1)
    return query, key, value, chosen.indices.masked_fill(chosen.values < 0, -1)[None]


def planned_call(query, key, value, mask, plan, **kwargs):
    """One call of the attention function on a bare causal site under a planned capture: ``(output, rows kept)``."""
    from torch import nn

    from attnscope.capture.attention import attnscope_attention, capture
    from attnscope.capture.rows import BatchFacts
    from attnscope.models.adapters import AttentionSite

    n = query.shape[2]
    module, site = nn.Module(), AttentionSite("self", 0, "layers.0.self_attn", True, None)
    module.attnscope_site = site
    facts = BatchFacts([n], torch.zeros((1, n), dtype=torch.bool), [np.arange(n)])
    with torch.inference_mode(), capture({module: site}, plan=plan, facts=facts) as session:
        output, _ = attnscope_attention(module, query, key, value, mask, scaling=0.25, **kwargs)
    return output, session.captured[("self", 0)]


def test_selected_keys_are_masked_one_chunk_at_a_time_with_the_same_result(monkeypatch):
    """DeepSeek sparse attention hands the attention function each query's selected keys (``indices``): under planned
    capture their mask is built for one chunk of queries at a time (never ``[q_pos, k_pos]``), and the output and
    the rows kept equal, bit for bit, those of the same call given the whole mask (built here by hand), and the
    softmax of the masked scores computed directly."""
    from attnscope.capture import attention

    query, key, value, indices = selected_keys_call()
    n, chunk = query.shape[2], 8
    seen = torch.zeros((n, n), dtype=torch.bool)
    for q in range(n):
        seen[q, [k for k in indices[0, q].tolist() if k >= 0]] = True
    built = []
    rows = attention.SelectedKeys.rows
    monkeypatch.setattr(attention.SelectedKeys, "rows", lambda self, start, end: built.append(end - start) or
                        rows(self, start, end))
    plan = CapturePlan(chunk=chunk)
    output, kept = planned_call(query, key, value, None, plan, indices=indices)
    assert built == [chunk] * (n // chunk)  # one mask per chunk of queries, none of every row
    whole_output, whole_kept = planned_call(query, key, value, seen[None, None], plan)
    assert torch.equal(output, whole_output) and torch.equal(kept.attention, whole_kept.attention)
    scores = (query @ key.transpose(-1, -2) * 0.25).masked_fill(~seen, float("-inf"))  # [1, head, q_pos, k_pos]
    torch.testing.assert_close(kept.attention, torch.softmax(scores, dim=-1), atol=1e-6, rtol=0)


def test_a_sparse_attention_model_under_planned_capture_equals_its_full_record(tmp_path, monkeypatch):
    """A tiny DeepSeek V3.2 (its indexer selects 4 keys per query): a planned capture in chunks of 4 queries builds
    no selection mask of more than 4 rows and records what the full capture records."""
    from attnscope.capture import attention

    from .tiny_architectures import TEXT, build_folder

    loaded = load_model(str(build_folder("deepseek_v32", tmp_path)))
    full = extract(loaded, TEXT).get("self")  # [layer, head, q_pos, k_pos]
    built = []
    rows = attention.SelectedKeys.rows
    monkeypatch.setattr(attention.SelectedKeys, "rows", lambda self, start, end: built.append(end - start) or
                        rows(self, start, end))
    planned = extract(loaded, TEXT, plan=CapturePlan(chunk=4, statistics=True)).get("self")  # not a full capture
    assert built and max(built) == 4
    np.testing.assert_allclose(planned, full, atol=1e-6, rtol=0)
