"""Per-head statistics against values computed by hand on small matrices."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnscope.analysis.stats import HeadStatistics, head_statistics, row_entropy, statistic_names
from attnscope.analysis.tokens import token_context
from attnscope.records.attention import AttentionRecord, ModelInfo

# [CLS] the cat . [SEP] the dog [SEP]: a pair whose word "the" occurs in both sentences
TOKENS = ("[CLS]", "the", "cat", ".", "[SEP]", "the", "dog", "[SEP]")
SPECIAL = [True, False, False, False, True, False, False, True]
SENTENCE = [0, 0, 0, 0, 0, 1, 1, 1]
WORDS = [-1, 0, 1, 2, -1, 3, 4, -1]
N = len(TOKENS)


def make_record(attention: np.ndarray, norms: np.ndarray | None = None, causal: bool = False) -> AttentionRecord:
    """A record of a 1-layer model whose heads are ``attention`` ``[head, q_pos, k_pos]``."""
    heads = attention.shape[0]
    info = ModelInfo("hand", "hand", 1, heads, heads, 4, causal, False, 0.5)
    arrays = {"self.attention": attention[None].astype(np.float32),
              "input.token_ids": np.arange(N), "input.special_mask": np.array(SPECIAL),
              "input.sentence_ids": np.array(SENTENCE), "input.word_ids": np.array(WORDS)}
    if norms is not None:
        arrays["self.norms"] = norms[None].astype(np.float32)
    return AttentionRecord(model=info, tokens=TOKENS, arrays=arrays)


def all_to_cls() -> np.ndarray:
    matrix = np.zeros((N, N))
    matrix[:, 0] = 1.0
    return matrix


def uniform() -> np.ndarray:
    return np.full((N, N), 1.0 / N)


@pytest.fixture(scope="module")
def stats() -> HeadStatistics:
    norms = np.zeros((2, N, N))
    norms[0] = all_to_cls() * 3.0  # same shares as the weights
    norms[1][:, [4, 7]] = 2.0  # head 1: all the norm sits on the two [SEP]s
    return head_statistics(make_record(np.stack([all_to_cls(), uniform()]), norms))


def value(stats: HeadStatistics, name: str, head: int) -> float:
    return float(stats[name][0, head])


def test_token_context_finds_types_sentences_and_repeated_words():
    ctx = token_context(make_record(np.stack([uniform()])))
    assert ctx.cls.tolist() == [True] + [False] * 7
    assert ctx.sep.nonzero()[0].tolist() == [4, 7]
    assert ctx.punct.nonzero()[0].tolist() == [3]
    assert sorted(zip(*ctx.same_word.nonzero())) == [(1, 5), (5, 1)]  # the two "the", never a token with itself
    assert ctx.same_word_other_sentence.sum() == 2 and ctx.is_pair


def test_head_that_attends_only_to_cls(stats):
    assert value(stats, "cls", 0) == pytest.approx(1.0)
    for name in ("sep", "punct", "same_word", "same_word_other", "next"):
        assert value(stats, name, 0) == pytest.approx(0.0)
    assert value(stats, "self", 0) == pytest.approx(1 / 8)  # only [CLS] itself
    assert value(stats, "prev", 0) == pytest.approx(1 / 7)  # only "the" (q=1) has [CLS] before it; 7 queries have one
    assert value(stats, "within_sentence", 0) == pytest.approx(5 / 8)  # sentence 1's 3 tokens look across
    assert value(stats, "cross_sentence", 0) == pytest.approx(3 / 8)
    assert value(stats, "entropy", 0) == pytest.approx(0.0, abs=1e-6)
    assert value(stats, "mean_distance", 0) == pytest.approx(sum(range(8)) / 8)  # |q - 0| averaged = 3.5
    assert value(stats, "max_weight", 0) == pytest.approx(1.0)


def test_uniform_head(stats):
    assert value(stats, "cls", 1) == pytest.approx(1 / 8)
    assert value(stats, "sep", 1) == pytest.approx(2 / 8)
    assert value(stats, "punct", 1) == pytest.approx(1 / 8)
    for name in ("self", "prev", "next", "same_word", "same_word_other"):
        assert value(stats, name, 1) == pytest.approx(1 / 8)
    # sentence 0 has 5 tokens, sentence 1 has 3: (5 * 5/8 + 3 * 3/8) / 8
    assert value(stats, "within_sentence", 1) == pytest.approx(34 / 64)
    assert value(stats, "cross_sentence", 1) == pytest.approx(30 / 64)
    # a uniform map has maximal entropy, equal to its uniform baseline ln 8
    assert value(stats, "entropy", 1) == pytest.approx(math.log(8), rel=1e-6)
    assert value(stats, "uniform_entropy", 1) == pytest.approx(math.log(8))
    # sum over q, k of |q - k| for 8 positions is 2 * sum_d d (8 - d) = 168; divided by 64 cells
    assert value(stats, "mean_distance", 1) == pytest.approx(168 / 64)
    assert value(stats, "max_weight", 1) == pytest.approx(1 / 8)


def test_norm_weighted_masses_follow_the_norms_not_the_weights(stats):
    assert value(stats, "norm_cls", 0) == pytest.approx(1.0)
    assert value(stats, "norm_sep", 1) == pytest.approx(1.0)  # weights are uniform, norms all on [SEP]
    assert value(stats, "norm_cls", 1) == pytest.approx(0.0)
    assert set(statistic_names(norms=True)) == set(stats.values)


def test_statistics_that_cannot_apply_are_nan_and_skipped_in_means():
    single = make_record(np.stack([uniform()]))
    arrays = dict(single.arrays)
    arrays["input.sentence_ids"] = np.zeros(N, dtype=np.int64)
    arrays["input.word_ids"] = np.array([-1, 0, 1, 2, -1, 3, 4, -1])
    tokens = ("[CLS]", "a", "cat", ".", "[SEP]", "the", "dog", "[SEP]")  # no repeated word, one sentence
    record = AttentionRecord(model=single.model, tokens=tokens, arrays=arrays)
    alone = head_statistics(record)
    assert np.isnan(alone["cross_sentence"]).all() and np.isnan(alone["same_word"]).all()
    assert "norm_cls" not in alone.values  # no norms captured
    paired = head_statistics(make_record(np.stack([uniform()])))
    mean = HeadStatistics.mean([alone, paired])
    assert mean["same_word"][0, 0] == pytest.approx(paired["same_word"][0, 0])  # NaN skipped, not averaged as 0
    assert mean["cls"][0, 0] == pytest.approx(1 / 8) and mean.n_inputs == 2


def test_causal_records_have_no_next_token_and_a_smaller_uniform_baseline():
    causal_uniform = np.tril(np.ones((N, N)))
    causal_uniform /= causal_uniform.sum(axis=1, keepdims=True)
    stats = head_statistics(make_record(np.stack([causal_uniform]), causal=True))
    assert np.isnan(stats["next"]).all()
    expected = np.mean([math.log(q + 1) for q in range(1, N)])  # query q sees q + 1 keys; query 0 only itself
    assert stats["uniform_entropy"][0, 0] == pytest.approx(expected)
    assert stats["entropy"][0, 0] == pytest.approx(expected, rel=1e-5)


# a causal input whose first token "The" (the attention sink) repeats as "the" at position 4
SINK_TOKENS = ("The", " cat", " sat", " on", " the", " mat", ".")


def causal_record(attention: np.ndarray, tokens: tuple[str, ...] = SINK_TOKENS) -> AttentionRecord:
    """A record of a 1-layer causal model without special tokens; heads are ``attention`` ``[head, q, k]``."""
    n = len(tokens)
    info = ModelInfo("hand", "hand", 1, attention.shape[0], attention.shape[0], 4, True, False, 0.5)
    arrays = {"self.attention": attention[None].astype(np.float32), "input.token_ids": np.arange(n),
              "input.special_mask": np.zeros(n, dtype=bool), "input.sentence_ids": np.zeros(n, dtype=np.int64),
              "input.word_ids": np.arange(n)}
    return AttentionRecord(model=info, tokens=tokens, arrays=arrays)


def sink_map(n: int, on_sink: float = 1.0) -> np.ndarray:
    """Causal ``[q_pos, k_pos]``: ``on_sink`` of every row on position 0, the rest spread evenly over its keys."""
    matrix = np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None] * (1.0 - on_sink)
    matrix[:, 0] += on_sink
    return matrix


def test_the_sink_of_a_causal_model_is_its_own_statistic_and_no_other_key():
    """Issue 19.2: "the" looking at the first token "The" (the sink) was counted as same-word attention,
    the second token's look at the sink as previous-token attention, and so on."""
    n = len(SINK_TOKENS)
    causal_uniform = np.tril(np.ones((n, n))) / np.arange(1, n + 1)[:, None]
    record = causal_record(np.stack([sink_map(n), causal_uniform]))
    ctx = token_context(record)
    assert ctx.sink.tolist() == [True] + [False] * (n - 1) and not ctx.same_word.any()
    stats = head_statistics(record, ctx)
    assert stats["sink"][0].tolist() == pytest.approx([1.0, np.mean(1 / np.arange(1, n + 1))])
    assert np.isnan(stats["same_word"]).all()  # the only repeat is the sink: nothing to measure
    assert value(stats, "prev", 0) == 0.0  # queries 2-6 have a previous token other than the sink
    assert value(stats, "self", 0) == 0.0  # query 0's own position is the sink
    assert value(stats, "prev", 1) == pytest.approx(np.mean(1 / np.arange(3, n + 1)))
    assert value(stats, "max_weight", 0) == 1.0 and value(stats, "entropy", 0) == pytest.approx(0.0, abs=1e-6)
    assert value(stats, "mean_distance", 0) == pytest.approx(np.mean(np.arange(1, n)))  # queries 1-6
    repeated = causal_record(np.stack([causal_uniform]), ("A", " cat", " saw", " the", " cat", " sat", "."))
    assert sorted(zip(*token_context(repeated).same_word.nonzero())) == [(4, 1)]  # repeats off the sink still count


def test_bidirectional_models_have_no_sink():
    stats = head_statistics(make_record(np.stack([all_to_cls()])))
    assert not token_context(make_record(np.stack([all_to_cls()]))).sink.any()
    assert np.isnan(stats["sink"]).all() and value(stats, "cls", 0) == pytest.approx(1.0)


def test_row_entropy_in_nats():
    assert row_entropy(np.array([[0.5, 0.5, 0.0]]))[0] == pytest.approx(math.log(2))


def test_frame_and_top_name_heads_zero_indexed(stats):
    frame = stats.to_frame()
    assert list(frame.columns[:2]) == ["layer", "head"] and len(frame) == 2
    assert stats.top("sep", 1) == [(0, 1, pytest.approx(0.25))]
    assert "0-indexed" in stats._repr_html_()


def test_top_names_only_heads_where_the_statistic_applied():
    """Issue 19.1: asking for more heads than were measured listed unmeasured (NaN) heads too."""
    values = np.array([[np.nan, -0.2], [np.nan, -0.5]])  # [layer, head]; two heads measured, both negative
    stats = HeadStatistics({"same_word": values})
    assert stats.top("same_word", 3) == [(0, 1, pytest.approx(-0.2)), (1, 1, pytest.approx(-0.5))]
    assert HeadStatistics({"same_word": np.full((2, 2), np.nan)}).top("same_word") == []


def test_statistics_of_a_real_record_are_shares(minilm):
    from attnscope import extract

    record = extract(minilm, "I went to the store.", "At the store, I bought fresh strawberries.", norms=True)
    stats = head_statistics(record)
    assert stats.shape == (6, 12)
    together = stats["cls"] + stats["sep"] + stats["punct"]
    assert np.all((together >= 0) & (together <= 1 + 1e-5))
    assert np.allclose(stats["within_sentence"] + stats["cross_sentence"], 1.0, atol=1e-5)
    assert np.allclose(stats["norm_within_sentence"] + stats["norm_cross_sentence"], 1.0, atol=1e-5)
    # the "same word in the other sentence" mass exists: "store" and "i" repeat across the pair
    assert np.isfinite(stats["same_word_other"]).all()
