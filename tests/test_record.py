"""AttentionRecord: immutability, save/load, and word-level aggregation on hand-made examples."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from attnscope import AttentionRecord, AttnscopeError, ModelInfo
from attnscope.capture.tokens import guess_word_ids
from attnscope.records.attention import word_groups

INFO = ModelInfo(name="hand", model_type="bert", n_layers=1, n_heads=1, n_kv_heads=1, d_head=2, causal=False,
                 is_encoder_decoder=False, scaling=0.5)
TOKENS = ("[CLS]", "straw", "##berries", "are", "red", "[SEP]")
WORD_IDS = np.array([-1, 0, 0, 1, 2, -1])


def hand_record(attention: np.ndarray, **arrays: np.ndarray) -> AttentionRecord:
    n = len(TOKENS)
    return AttentionRecord(
        model=INFO,
        tokens=TOKENS,
        arrays={
            "self.attention": attention,
            "input.token_ids": np.arange(n),
            "input.special_mask": WORD_IDS < 0,
            "input.sentence_ids": np.zeros(n, dtype=np.int64),
            "input.word_ids": WORD_IDS,
            **arrays,
        },
    )


def test_word_level_sums_over_attended_pieces_and_averages_over_attending_pieces():
    # rows are queries, columns keys (tokens: [CLS] straw ##berries are red [SEP])
    attention = np.array([[[
        [0.5, 0.1, 0.1, 0.1, 0.1, 0.1],
        [0.0, 0.2, 0.4, 0.2, 0.2, 0.0],   # straw
        [0.2, 0.2, 0.2, 0.0, 0.0, 0.4],   # ##berries
        [0.1, 0.3, 0.3, 0.1, 0.1, 0.1],
        [0.0, 0.0, 0.0, 1.0, 0.0, 0.0],
        [0.2, 0.2, 0.2, 0.2, 0.1, 0.1],
    ]]], dtype=np.float32)
    words = hand_record(attention).to_word_level()
    assert words.tokens == ("[CLS]", "strawberries", "are", "red", "[SEP]")
    expected = np.array([
        [0.5, 0.2, 0.1, 0.1, 0.1],
        [0.1, 0.5, 0.1, 0.1, 0.2],   # mean of the straw and ##berries rows, strawberry columns summed
        [0.1, 0.6, 0.1, 0.1, 0.1],
        [0.0, 0.0, 1.0, 0.0, 0.0],
        [0.2, 0.4, 0.2, 0.1, 0.1],
    ])
    np.testing.assert_allclose(words.attention[0, 0], expected, atol=1e-6)
    np.testing.assert_allclose(words.attention.sum(-1), 1.0, atol=1e-6)
    assert words.level == "word" and list(words.word_ids) == [-1, 1, 2, 3, -1]
    assert list(words.special_mask) == [True, False, False, False, True]


def test_word_groups_keep_specials_alone():
    assert word_groups(WORD_IDS) == [[0], [1, 2], [3], [4], [5]]


@pytest.mark.parametrize(
    ("tokens", "special", "expected"),
    [
        (("<s>", "▁Ich", "▁esse", "▁Äpf", "el", ".", "</s>"), [1, 0, 0, 0, 0, 0, 1], [-1, 0, 1, 2, 2, 3, -1]),
        (("[CLS]", "straw", "##berries", ",", "yes", "[SEP]"), [1, 0, 0, 0, 0, 1], [-1, 0, 0, 1, 2, -1]),
        ((" I", " went", " home", "."), [0, 0, 0, 0], [0, 1, 2, 3]),
    ],
)
def test_guessed_word_ids_for_tokenizers_without_alignment(tokens, special, expected):
    assert guess_word_ids(tokens, [bool(s) for s in special]) == expected


def test_record_is_immutable():
    record = hand_record(np.full((1, 1, 6, 6), 1 / 6, dtype=np.float32))
    with pytest.raises(ValueError):
        record.attention[0, 0, 0, 0] = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.tokens = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        record.arrays["self.attention"] = np.zeros(1)  # type: ignore[index]


def test_record_rejects_attention_that_does_not_match_tokens():
    with pytest.raises(ValueError, match="tokens"):
        hand_record(np.full((1, 1, 5, 5), 0.2, dtype=np.float32))


def test_save_and_load_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    attention = rng.dirichlet(np.ones(6), size=(1, 1, 6)).astype(np.float32)
    norms = rng.random((1, 1, 6, 6)).astype(np.float32)
    record = hand_record(attention, **{"self.norms": norms})
    loaded = AttentionRecord.load(record.save(tmp_path / "r.safetensors"))
    assert loaded.tokens == record.tokens and loaded.model == record.model
    assert loaded.arrays.keys() == record.arrays.keys()
    for key in record.arrays:
        np.testing.assert_array_equal(loaded.arrays[key], record.arrays[key])
    half = AttentionRecord.load(record.save(tmp_path / "half.safetensors", float16=True))
    assert half.attention.dtype == np.float32
    np.testing.assert_allclose(half.attention, attention, atol=5e-4)
    assert (tmp_path / "half.safetensors").stat().st_size < (tmp_path / "r.safetensors").stat().st_size


def test_loading_a_file_that_is_not_a_record_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(AttnscopeError, match="cannot read record"):
        AttentionRecord.load(bad)
