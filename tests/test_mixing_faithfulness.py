"""The faithfulness evaluation of the context-mixing measures: its references (erasure, gradient x
input) against direct computations, its table's keys, and the CLI (a handful of sentences only)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from attnscope import load_model
from attnscope.analysis.mixing import METHODS
from attnscope.cli import main
from attnscope.experiments.faithfulness import (
    BASELINES,
    erasure_scores,
    evaluate_model,
    evaluation_sentences,
    grad_x_input_scores,
    model_output,
    prepare_case,
    spearman,
)

SENTENCE = "The old man walked slowly to the small harbour."


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return load_model(str(tiny_model_dir("llama")))


def _direct_output(loaded, ids: list[int], target: int) -> torch.Tensor:
    """The output computed plainly: mean-pooled last hidden state, or the target's log-probability."""
    with torch.inference_mode():
        if loaded.causal:
            logits = loaded.model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            return logits.log_softmax(-1)[target]
        return loaded.model(torch.tensor([ids])).last_hidden_state[0].mean(0)


@pytest.mark.parametrize("which", ["minilm", "llama"])
def test_erasure_removes_each_token_and_measures_the_output(minilm, tiny_llama, which):
    loaded = minilm if which == "minilm" else tiny_llama
    case = prepare_case(loaded, SENTENCE)
    assert case is not None
    if loaded.causal:
        assert case.text == "The old man walked slowly to the small"  # the last word is the target
    scores = erasure_scores(loaded, case)
    ids = case.ids.tolist()
    full = _direct_output(loaded, ids, case.target)
    for slot, j in enumerate(case.ranked[:3]):
        erased = _direct_output(loaded, ids[:j] + ids[j + 1 :], case.target)
        expected = (full - erased) if loaded.causal else 1 - torch.nn.functional.cosine_similarity(full, erased, dim=0)
        assert scores[slot] == pytest.approx(float(expected), rel=1e-3, abs=1e-6)


@pytest.mark.parametrize("which", ["minilm", "llama"])
def test_gradient_x_input_is_the_first_order_change_of_zeroing_an_embedding(minilm, tiny_llama, which):
    loaded = minilm if which == "minilm" else tiny_llama
    case = prepare_case(loaded, SENTENCE)
    assert case is not None
    loaded.model.double()  # float32 sums of grad * x cancel too much on a random model to compare closely
    try:
        scores = grad_x_input_scores(loaded, case)
        with torch.no_grad():
            embeds = loaded.model.get_input_embeddings()(case.ids[None])
            eps = 1e-3  # Llama computes its rotary tables in float32: a larger step keeps their rounding small
            for slot, j in enumerate(case.ranked[:3]):
                moved = [embeds.clone(), embeds.clone()]
                moved[0][0, j] *= 1 - eps  # x_j -/+ eps * x_j: a central difference along x_j
                moved[1][0, j] *= 1 + eps
                low, high = (model_output(loaded, case, m, embedded=True) for m in moved)
                change = (high - low) / (2 * eps)
                assert scores[slot] == pytest.approx(float(change.norm()), rel=1e-3, abs=1e-9)
    finally:
        loaded.model.float()


def test_evaluation_table_has_the_issues_keys_and_sane_values(minilm):
    table = evaluate_model(minilm, evaluation_sentences(4), progress=False)
    assert list(table) == [*METHODS, *BASELINES]
    for row in table.values():
        assert set(row) == {"spearman_erasure", "ci", "spearman_grad_x_input"}
        low, high = row["ci"]
        assert -1 <= low <= row["spearman_erasure"] <= high <= 1
        assert -1 <= row["spearman_grad_x_input"] <= 1
    assert table["uniform"]["spearman_erasure"] == 0.0  # an encoder's uniform rollout ranks nothing


def test_spearman_of_a_constant_ranking_is_zero():
    assert spearman(np.ones(4), np.arange(4.0)) == 0.0
    assert spearman(np.arange(4.0), np.arange(4.0)) == pytest.approx(1.0)
    assert spearman(np.arange(4.0), -np.arange(4.0)) == pytest.approx(-1.0)


def test_evaluation_sentences_are_held_out_and_short():
    sentences = evaluation_sentences(200)
    assert len(sentences) == 200 and len(set(sentences)) == 200
    assert all(6 <= len(s.split()) <= 10 for s in sentences)
    from attnscope.data import brown_sentences

    assert not set(sentences) & set(brown_sentences(1000))


def test_cli_evaluate_json_and_errors(capsys, tmp_path):
    figure = tmp_path / "faithfulness.png"
    assert main(["mixing", "--evaluate", "--models", "minilm", "--sentences", "3", "--json", "--plot", str(figure)]) == 0
    table = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(table) == {"minilm"} and set(table["minilm"]) == {*METHODS, *BASELINES}
    assert figure.read_bytes()[:4] == b"\x89PNG"
    assert main(["mixing", "--evaluate", "--plot", str(tmp_path / "missing" / "f.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["mixing", "--evaluate", "some text"]) == 2
    assert "leave out the text" in capsys.readouterr().err
    assert main(["mixing"]) == 2
    assert main(["mixing", "The cat sat.", "--method", "norm", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["method"] == "norm" and len(shown["output_shares"]) == len(shown["tokens"])
    assert sum(shown["output_shares"]) == pytest.approx(1.0, abs=1e-4)
