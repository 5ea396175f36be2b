"""Concurrent batches in extract_corpus: same records in the same order, caller's context kept,
torch's thread count restored."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnscope import extract, extract_corpus, load_model
from attnscope.capture import Intervention, intervene
from attnscope.capture.concurrency import concurrent_map

from .conftest import SENTENCES, TINY_ARCHITECTURES

ITEMS = [SENTENCES[2], (SENTENCES[0], SENTENCES[1]), SENTENCES[3], SENTENCES[4], SENTENCES[1], SENTENCES[0]]


class UniformEverywhere(Intervention):
    def modify_probs(self, site, probs, allowed):
        return allowed.float().expand_as(probs) / allowed.sum(-1, keepdim=True)


def assert_same_records(got, expected, atol: float = 0.0) -> None:
    assert [r.tokens for r in got] == [r.tokens for r in expected]
    for a, b in zip(got, expected, strict=True):
        assert a.arrays.keys() == b.arrays.keys()
        for key in a.arrays:
            np.testing.assert_allclose(a.arrays[key], b.arrays[key], atol=atol, rtol=0, err_msg=key)


@pytest.mark.parametrize("onednn", [False, True])
@pytest.mark.parametrize("kind", TINY_ARCHITECTURES)
def test_concurrent_batches_equal_one_batch_at_a_time(kind, onednn, tiny_model_dir):
    loaded = load_model(str(tiny_model_dir(kind)))
    options = {"batch_size": 2, "qkv": True, "norms": True, "progress": False, "onednn": onednn}
    concurrent = list(extract_corpus(loaded, ITEMS, parallel_batches=2, **options))
    serial = list(extract_corpus(loaded, ITEMS, parallel_batches=1, **options))
    assert_same_records(concurrent, serial)


def test_concurrent_corpus_equals_one_at_a_time_extraction(minilm):
    corpus = list(extract_corpus(minilm, ITEMS, batch_size=2, progress=False, parallel_batches=2))
    singles = [extract(minilm, *(item if isinstance(item, tuple) else (item,))) for item in ITEMS]
    assert_same_records(corpus, singles, atol=1e-5)


def test_interventions_around_the_call_reach_the_worker_threads(tiny_model_dir):
    loaded = load_model(str(tiny_model_dir("bert")))
    with intervene(UniformEverywhere()):
        records = list(extract_corpus(loaded, ITEMS, batch_size=2, progress=False, parallel_batches=2))
    for record in records:
        n = len(record.tokens)
        np.testing.assert_allclose(record.attention, np.full(record.attention.shape, 1 / n), atol=1e-6)


def test_torch_threads_are_restored_also_when_iteration_stops_early(minilm):
    before = torch.get_num_threads()
    records = extract_corpus(minilm, ITEMS * 3, batch_size=2, progress=False, parallel_batches=2)
    next(records)
    records.close()
    assert torch.get_num_threads() == before
    list(extract_corpus(minilm, ITEMS, batch_size=2, progress=False, parallel_batches=2))
    assert torch.get_num_threads() == before


def test_numpy_blas_gets_the_workers_share_and_its_threads_back():
    from threadpoolctl import threadpool_info

    def blas_threads() -> list[int]:
        return [pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"]

    before = blas_threads()
    with concurrent_map(2) as run_each:
        share = max(1, torch.get_num_threads() // 2)
        assert list(run_each(lambda _: blas_threads(), range(2))) == [[share] * len(before)] * 2
    assert blas_threads() == before


def test_concurrent_map_keeps_order_and_raises_the_first_error():
    with concurrent_map(2) as run_each:
        assert list(run_each(lambda x: x * x, range(10))) == [x * x for x in range(10)]
        with pytest.raises(ZeroDivisionError):
            list(run_each(lambda x: 1 // x, [3, 0, 1]))


def test_progress_bar_counts_every_item(minilm, monkeypatch):
    import tqdm.auto

    counted = []
    real = tqdm.auto.tqdm

    def spy(*args, **kwargs):
        bar = real(*args, **kwargs)
        counted.append(bar)
        return bar

    monkeypatch.setattr(tqdm.auto, "tqdm", spy)
    list(extract_corpus(minilm, ITEMS, batch_size=2, progress=True, parallel_batches=2))
    assert counted[0].n == len(ITEMS)


def test_windows_cut_to_bound_the_records_they_hold_give_the_same_records_in_order(minilm, monkeypatch):
    # a sort window's records are held until its first is yielded: long inputs cut it, here down to one batch a part
    import attnscope.capture.extract as extract_module

    whole = list(extract_corpus(minilm, ITEMS, batch_size=2, progress=False))
    monkeypatch.setattr(extract_module, "HELD_RECORD_BYTES", 1)
    encoded = extract_module.encode_window(minilm, list(enumerate(ITEMS)), minilm.max_length)
    parts = list(extract_module.held_parts(minilm, encoded, 2, None, qkv=False, norms=False))
    assert [[e.index for e in part] for part in parts] == [[0, 1], [2, 3], [4, 5]]
    cut = list(extract_corpus(minilm, ITEMS, batch_size=2, progress=False))
    assert [record.tokens for record in cut] == [extract(minilm, *(i if isinstance(i, tuple) else (i,))).tokens
                                                 for i in ITEMS]
    # other batches, other padding: equal up to float32 rounding
    assert_same_records(cut, whole, atol=1e-5)
