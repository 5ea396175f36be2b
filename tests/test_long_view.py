"""The long-input view's payload: block averages against a direct loop, packing round trips, the
schema, the page's size budget, and one-line errors for arrays that do not fit together."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from attnscope import AttnscopeError
from attnscope.present import build_long_payload, downsample_attention, long_view, long_view_schema, top_k_rows
from attnscope.present.longview import coarsen_overview, unpack_top_k
from attnscope.present.payload import unpack

from .long_attention import synthetic_long_attention

jsonschema = pytest.importorskip("jsonschema")


def loop_downsample(matrix: np.ndarray, block: int) -> np.ndarray:
    """Reference: cell (i, j) = mean over the queries of block i of their summed weight on block j."""
    queries, keys = matrix.shape
    rows, cols = math.ceil(queries / block), math.ceil(keys / block)
    out = np.zeros((rows, cols))
    for i in range(rows):
        for j in range(cols):
            part = matrix[i * block:(i + 1) * block, j * block:(j + 1) * block]
            out[i, j] = part.sum(axis=1).mean()
    return out


def dense(attention, layer: int, head: int) -> np.ndarray:
    """The synthetic head's full matrix ``[q_pos, k_pos]``, weight by weight."""
    n = len(attention.tokens)
    return np.array([[attention.weight(layer, head, q, k) for k in range(n)] for q in range(n)])


@pytest.mark.parametrize(("queries", "keys", "block"), [(12, 12, 4), (13, 13, 4), (10, 7, 3), (5, 5, 8), (6, 6, 1)])
def test_downsample_matches_a_direct_loop(queries, keys, block):
    rng = np.random.default_rng(queries * 100 + block)
    matrix = rng.random((2, 3, queries, keys))  # [layer, head, q, k]
    got = downsample_attention(matrix, block)
    assert got.shape == (2, 3, math.ceil(queries / block), math.ceil(keys / block))
    for layer in range(2):
        for head in range(3):
            np.testing.assert_allclose(got[layer, head], loop_downsample(matrix[layer, head], block), atol=1e-12)


def test_rows_of_a_downsampled_attention_matrix_still_sum_to_one():
    rng = np.random.default_rng(0)
    weights = rng.random((37, 37))
    weights /= weights.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(downsample_attention(weights, 8).sum(axis=1), 1.0, atol=1e-12)


@pytest.mark.parametrize(("tokens", "block", "factor"), [(37, 4, 3), (64, 8, 2), (50, 5, 7)])
def test_coarsening_an_overview_equals_downsampling_the_matrix_at_the_coarser_block(tokens, block, factor):
    rng = np.random.default_rng(tokens)
    matrix = rng.random((tokens, tokens))  # last blocks shorter when tokens is not a multiple
    coarse = coarsen_overview(downsample_attention(matrix, block), block, tokens, factor)
    np.testing.assert_allclose(coarse, loop_downsample(matrix, block * factor), atol=1e-12)


def test_the_synthetic_attention_is_a_consistent_matrix():
    """The tests' synthetic family: rows sum to 1, its overview and top-k rows are those of its matrix."""
    attention = synthetic_long_attention(70, 1, 2, k=8, block=16)
    for head in range(2):
        full = dense(attention, 0, head)
        np.testing.assert_allclose(full.sum(axis=1), 1.0, atol=1e-12)
        assert np.all(np.triu(full, 1) == 0)  # causal
        np.testing.assert_allclose(attention.overview[0, head], loop_downsample(full, 16), atol=1e-12)
        for q in range(70):
            listed = attention.weights[0, head, q] > 0
            keys = attention.indices[0, head, q][listed]
            np.testing.assert_allclose(attention.weights[0, head, q][listed], full[q, keys])
            assert full[q, keys].min() >= np.delete(full[q], keys).max(initial=0)  # they are the strongest


@pytest.fixture(scope="module")
def attention():
    return synthetic_long_attention(300, 2, 3, k=8, block=16, seed=1)


def payload_of(attention, **options):
    indices = np.where(attention.weights > 0, attention.indices, -1)  # the capture's -1: the row has fewer keys
    return build_long_payload(attention.tokens, attention.overview, attention.block, indices,
                              attention.weights, layers=[3, 4], heads=[0, 2, 5], causal=True,
                              special_mask=np.arange(len(attention.tokens)) == 0, **options)


def test_payload_follows_its_schema_and_packs_what_it_was_given(attention):
    payload = payload_of(attention)
    jsonschema.Draft202012Validator.check_schema(long_view_schema())
    jsonschema.Draft202012Validator(long_view_schema()).validate(json.loads(json.dumps(payload)))
    assert payload["layers"] == [3, 4] and payload["heads"] == [0, 2, 5] and payload["notes"] == []
    assert payload["special"][:2] == [True, False] and len(payload["tokens"]) == 300
    overview, top = payload["overview"], payload["top_k"]
    assert (overview["block"], overview["size"], top["k"]) == (16, 19, 8)  # nothing dropped
    for layer in range(2):
        mean = np.zeros((19, 19))
        for head in range(3):
            cells = unpack(overview["heads"][layer][head])
            np.testing.assert_allclose(cells, attention.overview[layer, head], rtol=1e-3, atol=1e-7)  # float16
            mean += cells / 3
            indices, weights = unpack_top_k(top["indices"][layer][head], top["weights"][layer][head])
            listed = attention.weights[layer, head] > 0
            np.testing.assert_array_equal(indices[listed], attention.indices[layer, head][listed])
            np.testing.assert_allclose(weights, attention.weights[layer, head], rtol=1e-3, atol=1e-7)
        np.testing.assert_allclose(unpack(overview["mean"][layer]), mean, rtol=2e-3, atol=1e-6)
    thumbnails = payload["thumbnails"]
    assert thumbnails["size"] == 19 and thumbnails["data"]["shape"] == [2, 3, 19, 19]  # 19 cells fit in 48


def test_a_small_budget_groups_the_overview_and_ships_fewer_keys_and_says_so(attention):
    full = len(long_view(attention.tokens, attention.overview, attention.block, attention.indices, attention.weights,
                         layers=[3, 4], heads=[0, 2, 5], causal=True, special_mask=[False] * 300).to_html())
    payload = payload_of(attention, max_mb=0.015)
    overview, top = payload["overview"], payload["top_k"]
    assert overview["block"] > 16 and overview["block"] % 16 == 0 and top["k"] < 8
    tokens = len(attention.tokens)
    assert overview["size"] == math.ceil(tokens / overview["block"])
    coarse = coarsen_overview(attention.overview, 16, tokens, overview["block"] // 16)
    np.testing.assert_allclose(unpack(overview["heads"][1][2]), coarse[1, 2], rtol=1e-3, atol=1e-7)
    _, weights = unpack_top_k(top["indices"][0][0], top["weights"][0][0])
    np.testing.assert_allclose(weights, attention.weights[0, 0, :, :top["k"]], rtol=1e-3, atol=1e-7)  # the strongest
    assert any("blocks of" in note for note in payload["notes"]) and any("top" in note for note in payload["notes"])
    assert len(json.dumps(payload)) < full


def test_a_long_page_is_one_offline_file_under_its_budget(tmp_path):
    attention = synthetic_long_attention(8192, 2, 3, k=16, block=32)
    page = long_view(attention.tokens, attention.overview, 32, attention.indices, attention.weights,
                     layers=[0, 1], heads=[0, 1, 2], causal=True, special_mask=np.zeros(8192, bool), max_mb=2.0)
    path = page.save(tmp_path / "long.html")
    assert path.stat().st_size < 2.0e6
    text = path.read_text(encoding="utf-8")
    assert "Content-Security-Policy" in text and "http://" not in text.replace("http://www.w3.org", "")
    assert page.views == ["heatmap", "model", "window"]


@pytest.mark.parametrize(("change", "message"), [
    ({"overview": np.zeros((2, 3, 5, 5))}, "overview has shape"),
    ({"block": 0}, "block of at least 1"),
    ({"topk_weights": np.zeros((2, 3, 300, 7))}, "must both be"),
    ({"special_mask": [False] * 299}, "special_mask has 299"),
    ({"heads": [0, 1]}, "overview has shape"),
])
def test_arrays_that_do_not_fit_together_give_one_clear_error(attention, change, message):
    arguments = {"tokens": attention.tokens, "overview": attention.overview, "block": 16,
                 "topk_indices": attention.indices, "topk_weights": attention.weights, "layers": [3, 4],
                 "heads": [0, 2, 5], "causal": True, "special_mask": [False] * 300} | change
    with pytest.raises(AttnscopeError, match=message):
        long_view(**arguments)


def test_top_k_rows_are_each_rows_strongest_keys_in_order():
    rng = np.random.default_rng(3)
    matrix = rng.random((2, 3, 9, 11))  # [layer, head, q, k]
    indices, weights = top_k_rows(matrix, 4)
    assert indices.shape == weights.shape == (2, 3, 9, 4)
    for layer, head, query in np.ndindex(2, 3, 9):
        row = matrix[layer, head, query]
        expected = sorted(range(11), key=lambda key: -row[key])[:4]
        assert list(indices[layer, head, query]) == expected
        np.testing.assert_array_equal(weights[layer, head, query], row[expected])
    assert top_k_rows(matrix, 50)[0].shape[-1] == 11  # k is capped by the number of keys
