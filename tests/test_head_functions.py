"""Head-function scores (induction, previous-token, duplicate-token, echo, locality, receiver): each equals a
naive computation from transformers' eager ``output_attentions=True`` rows on tiny random Llama (grouped heads),
Gemma 3 (sliding window of 4), Qwen2 (biases) and gpt-oss (learned sinks); planted heads of a hand-built GPT-2
score what they were wired to; the per-layer window and sink facts are stated; bad input is one line."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from attnscope import HeadScores, HeadScoreSettings, head_scores, load_model
from attnscope.analysis.head_functions import (
    HeadFunction,
    get_head_function,
    head_functions,
    register_head_function,
    unregister_head_function,
)
from attnscope.analysis.sentences import SentenceAttention, split_sentences
from attnscope.capture.extract import extract, extract_to_file
from attnscope.capture.plan import CapturePlan, QuerySelection
from attnscope.errors import AttnscopeError
from attnscope.experiments.random_tokens import repeated_random_tokens
from attnscope.records import AttentionRecord

from .tiny_architectures import SLIDING_WINDOW, TEXT, build_folder, eager_attentions

REPEATED = HeadScoreSettings(period=6, repeats=3, sequences=2, seed=3)
PAIRS = ((0, 1), (2, 3), (1, 8), (3, 50))
LONG_TEXT = " ".join([TEXT] * 3)  # 46 WordPiece tokens (cut at 64 where a tokenizer makes more): past all windows but 50
TOLERANCE = 1e-5


def naive_repeated(attention: list[np.ndarray], period: int, repeats: int, prefix: int = 0) -> dict[str, np.ndarray]:
    """The four repeated-token scores of one sequence, by loops over eager ``[head, q, k]`` layers: ``[layer,
    head]``. ``prefix``: tokens before the first copy (a BOS; the WordPiece tokenizer has none)."""
    n = prefix + period * repeats
    scores = {name: np.zeros((len(attention), attention[0].shape[0])) for name in
              ("induction", "duplicate_token", "echo", "previous_token")}
    later = range(prefix + period, n)
    for layer, a in enumerate(attention):
        for q in later:
            scores["induction"][layer] += a[:, q, q - period + 1] / len(later)
            scores["duplicate_token"][layer] += a[:, q, q - period] / len(later)
            first_copy = prefix + (q - prefix) % period
            scores["echo"][layer] += sum(a[:, q, k] for k in range(first_copy, q, period)) / len(later)
        for q in range(1, n):
            scores["previous_token"][layer] += a[:, q, q - 1] / (n - 1)
    return scores


def naive_locality(attention: list[np.ndarray], sink: int, window: int, queries: np.ndarray) -> np.ndarray:
    """``[layer, head]``: the mean over ``queries`` of 1 - the eager row's mass on keys ``sink .. q - window``
    (a learned sink's mass, absent from eager rows, counts as kept)."""
    kept = np.zeros((len(attention), attention[0].shape[0]))
    for layer, a in enumerate(attention):
        for q in queries:
            evicted = [k for k in range(q + 1) if sink <= k <= q - window]
            kept[layer] += (1.0 - a[:, q, evicted].sum(-1)) / len(queries)
    return kept


@pytest.fixture(scope="module", params=["llama", "gemma3_text", "qwen2", "gpt_oss"])
def tiny(request, tmp_path_factory):
    folder = build_folder(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, folder, load_model(str(folder))


def test_repeated_token_scores_equal_loops_over_eager_rows(tiny):
    model_type, folder, loaded = tiny
    found = head_scores(loaded, ["induction", "duplicate_token", "echo", "previous_token"], REPEATED)
    sequences = repeated_random_tokens(loaded, REPEATED.period, repeats=REPEATED.repeats,
                                       sequences=REPEATED.sequences, seed=REPEATED.seed)
    expected = [naive_repeated(eager_attentions(folder, ids, None)["self"], REPEATED.period, REPEATED.repeats)
                for ids in sequences]
    for name, values in found.scores.items():
        reference = np.mean([one[name] for one in expected], axis=0)
        np.testing.assert_allclose(values, reference, atol=TOLERANCE, err_msg=f"{model_type} {name}")
    # with three copies echo sums two earlier ones: it is not the duplicate-token score
    assert not np.allclose(found.scores["echo"], found.scores["duplicate_token"])


def test_locality_from_planned_capture_equals_a_direct_sum_of_eager_rows(tiny):
    model_type, folder, loaded = tiny
    settings = HeadScoreSettings(documents=(LONG_TEXT,), max_tokens=64, sinks=(0, 1, 2, 3), windows=(1, 3, 8, 50),
                                 every=3, chunk=7, share=0.5)
    found = head_scores(loaded, ["locality"], settings)
    plan = CapturePlan(attention=False, statistics=True)
    ids = extract(loaded, LONG_TEXT, plan=plan, max_length=64).token_ids.tolist()
    eager = eager_attentions(folder, ids, None)["self"]
    queries = np.arange(0, len(ids), 3)
    for sink, window in PAIRS:
        np.testing.assert_allclose(found.scores[f"locality_k{sink}_w{window}"],
                                   naive_locality(eager, sink, window, queries), atol=TOLERANCE,
                                   err_msg=f"{model_type} ({sink}, {window})")
    # the smallest window of the grid keeping half: checked against the grid itself
    grid = np.stack([found.scores[f"locality_k2_w{w}"] for w in settings.windows], axis=-1)
    holds = grid >= 0.5
    smallest = np.where(holds.any(-1), np.array(settings.windows)[holds.argmax(-1)], np.nan)
    np.testing.assert_array_equal(found.scores["streaming_window_k2"], smallest)


def test_windows_and_sinks_are_stated_per_layer(tiny):
    model_type, _, loaded = tiny
    found = head_scores(loaded, ["previous_token"], REPEATED)
    frame = found.to_frame()
    windows = [site.window for site in sorted(loaded.sites.values(), key=lambda s: s.layer)]
    assert frame.groupby("layer")["window"].first().tolist() == windows
    if model_type == "gemma3_text":
        assert SLIDING_WINDOW in windows and 0 in windows
        assert all(f"sliding window of {SLIDING_WINDOW} keys" in note
                   for note in frame.loc[frame["window"] > 0, "note"])
        assert not frame.loc[frame["window"] == 0, "note"].str.contains("sliding").any()
    assert found.learned_sinks == (model_type == "gpt_oss")
    assert frame["note"].str.contains("learned sinks").all() == (model_type == "gpt_oss")


def test_a_sliding_layer_keeps_everything_once_the_window_covers_its_own(tmp_path):
    """A query of a layer with a window of 4 sees keys q - 3 .. q only: the recent window w = 4 keeps all of it
    (and NaN nowhere), while the global layer's rows reach further back."""
    loaded = load_model(str(build_folder("gemma3_text", tmp_path)))
    settings = HeadScoreSettings(documents=(LONG_TEXT,), max_tokens=64, sinks=(0,), windows=(SLIDING_WINDOW,), chunk=5)
    found = head_scores(loaded, ["locality"], settings)
    kept = found.scores[f"locality_k0_w{SLIDING_WINDOW}"]
    local = [layer for layer in range(kept.shape[0]) if found.window(layer)]
    np.testing.assert_allclose(kept[local], 1.0, atol=1e-6)
    assert (kept[[layer for layer in range(kept.shape[0]) if not found.window(layer)]] < 1 - 1e-3).all()


# ---- planted heads -----------------------------------------------------------------------------------
def planted_gpt2(folder, shift: int):
    """A one-layer GPT-2 whose head 0 attends from each position ``p`` to ``p - shift`` (by position alone: token
    embeddings are 0, position ``p``'s embedding is the unit vector e_p) and whose head 1 is uniform (zero
    queries); everything else is zero. Loaded by attnscope from ``folder``."""
    import transformers

    from attnscope.models.loading import resolve_source

    n = 16
    config = transformers.GPT2Config(vocab_size=30522, n_positions=n, n_embd=2 * n, n_layer=1, n_head=2,
                                     bos_token_id=101, eos_token_id=102)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.transformer.wpe.weight[:, :n] = torch.eye(n)
        for norm in (model.transformer.h[0].ln_1, model.transformer.h[0].ln_2, model.transformer.ln_f):
            norm.weight.fill_(1.0)
        weight = model.transformer.h[0].attn.c_attn.weight  # Conv1D [n_embd, 3 * n_embd]: x @ W
        weight[:n, :n] = 40.0 * torch.eye(n)  # head 0's query: position p's own direction
        for p in range(n - shift):  # head 0's key at position j: direction j + shift
            weight[p, 2 * n + p + shift] = 1.0
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(resolve_source("minilm")).save_pretrained(folder)
    return load_model(str(folder))


PLANTED = HeadScoreSettings(period=5, repeats=3, sequences=2)


def test_a_planted_previous_token_head_scores_one_and_no_induction(tmp_path):
    found = head_scores(planted_gpt2(tmp_path, 1), ["previous_token", "induction", "duplicate_token"], PLANTED)
    assert found.scores["previous_token"][0, 0] > 0.99
    assert found.scores["induction"][0, 0] < 0.01 and found.scores["duplicate_token"][0, 0] < 0.01
    # the uniform head: query q spreads 1 / (q + 1) over its keys
    uniform = np.mean([1 / (q + 1) for q in range(1, 15)])
    np.testing.assert_allclose(found.scores["previous_token"][0, 1], uniform, atol=1e-5)
    assert found.ranked("previous_token", 1)[0][:2] == (0, 0)


def test_planted_induction_and_duplicate_offsets_score_one(tmp_path):
    induction = head_scores(planted_gpt2(tmp_path / "induction", PLANTED.period - 1),
                            ["induction", "previous_token"], PLANTED)
    assert induction.scores["induction"][0, 0] > 0.99
    # queries before the offset find no key wired to them: their rows are uniform, and only those reach q - 1
    shift = PLANTED.period - 1
    uniform_part = np.mean([1 / (q + 1) if q < shift else 0.0 for q in range(1, 15)])
    np.testing.assert_allclose(induction.scores["previous_token"][0, 0], uniform_part, atol=1e-3)
    duplicate = head_scores(planted_gpt2(tmp_path / "duplicate", PLANTED.period), ["duplicate_token", "echo"], PLANTED)
    assert duplicate.scores["duplicate_token"][0, 0] > 0.99
    # echo sums every earlier copy; the planted head only reaches the nearest, so the two agree
    np.testing.assert_allclose(duplicate.scores["echo"][0, 0], duplicate.scores["duplicate_token"][0, 0], atol=1e-6)


# ---- records, registry, table ----------------------------------------------------------------------------
def test_locality_is_kept_by_streamed_records_as_in_memory(tiny, tmp_path):
    model_type, _, loaded = tiny
    if model_type != "llama":
        pytest.skip("one architecture is enough for the file path")
    plan = CapturePlan(attention=False, locality=PAIRS, queries=QuerySelection("every", n=2), chunk=5)
    in_memory = extract(loaded, LONG_TEXT, plan=plan)
    extract_to_file(loaded, LONG_TEXT, path=tmp_path / "doc.safetensors", plan=plan, progress=False)
    streamed = AttentionRecord.load(tmp_path / "doc.safetensors")
    np.testing.assert_allclose(streamed.get("self", "locality"), in_memory.get("self", "locality"), atol=1e-6)
    assert "locality" in in_memory.holdings()


def test_the_registry_lists_every_score_and_receiver_is_the_sentence_kurtosis():
    names = [f.name for f in head_functions()]
    assert {"induction", "previous_token", "duplicate_token", "echo", "locality", "receiver"} <= set(names)
    assert all(f.reference and f.cited and f.label for f in head_functions())
    rng = np.random.default_rng(0)
    tokens = [w for i in range(12) for w in (" A", " b", ".")]
    sentences = split_sentences(tokens)
    matrix = np.tril(rng.random((2, 3, len(sentences), len(sentences)))).astype(np.float32)
    found = SentenceAttention(sentences, matrix, (0, 1), (0, 1, 2))
    got = get_head_function("receiver").compute([found, found])["receiver"]
    np.testing.assert_allclose(got, found.receiver_heads().kurtosis)
    extra = register_head_function(HeadFunction("twice", "Twice", "repeated_tokens", "x", "y", lambda e: {}))
    try:
        with pytest.raises(AttnscopeError, match="already registered"):
            register_head_function(extra)
    finally:
        unregister_head_function("twice")


def test_kv_groups_take_the_max_and_mean_of_their_query_heads(tmp_path):
    scores = np.arange(12, dtype=float).reshape(2, 6)  # 2 layers, 6 heads, 2 KV heads of 3
    found = HeadScores("m", {"induction": scores}, n_kv_heads=2, windows=(4, 0))
    groups = found.to_frame("kv_head")
    assert groups["induction_max"].tolist() == [2, 5, 8, 11]
    assert groups["induction_mean"].tolist() == [1, 4, 7, 10]
    assert groups["window"].tolist() == [4, 4, 0, 0]
    import pandas as pd

    path = found.save(tmp_path / "scores.parquet")
    back = pd.read_parquet(path)
    assert back["kv_head"].tolist() == [0, 0, 0, 1, 1, 1] * 2 and back["induction"].tolist() == scores.ravel().tolist()


# ---- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("scores, settings, message", [
    (["nope"], REPEATED, "unknown head score 'nope'"),
    (["induction"], HeadScoreSettings(period=300, repeats=2), "limit of 512"),
    (["induction"], HeadScoreSettings(period=1), "period >= 2"),
    (["locality"], HeadScoreSettings(max_tokens=100_000), "above .* limit"),
    (["locality"], HeadScoreSettings(share=1.5), r"in \(0, 1\]"),
    (["locality"], HeadScoreSettings(documents=("no-such-document",)), "no shipped document"),
    (["locality"], HeadScoreSettings(windows=(0,)), "window >= 1"),
])
def test_bad_settings_are_one_line_before_the_model_runs(tiny, scores, settings, message):
    _, _, loaded = tiny

    def forward(*args, **kwargs):  # the model must not run
        raise AssertionError("the model ran")

    original, loaded.model.forward = loaded.model.forward, forward
    try:
        with pytest.raises(AttnscopeError, match=message) as refused:
            head_scores(loaded, scores, settings)
    finally:
        loaded.model.forward = original
    assert "\n" not in str(refused.value)


def test_an_encoder_and_k_above_the_heads_are_refused(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        encoder = load_model(str(build_folder("bert", tmp_path)))
    with pytest.raises(AttnscopeError, match="need a decoder .* is an encoder"):
        head_scores(encoder, ["induction"], REPEATED)
    found = HeadScores("m", {"induction": np.zeros((2, 4))}, n_kv_heads=2)
    with pytest.raises(AttnscopeError, match="between 1 and the model's 8 heads"):
        found.ranked("induction", 9)
