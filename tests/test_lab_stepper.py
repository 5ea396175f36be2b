"""Step debugger and translator experiments, on a tiny random BART (exactness, not quality)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnscope import AttnscopeError, capture_attention, load_model
from attnscope.capture.decode import decode_steps, step_forward
from attnscope.lab.experiments import BEGINNING_TOKENS, EXPERIMENTS, translate_with

SOURCE = "i can eat apples today"


@pytest.fixture(scope="module")
def bart(tiny_model_dir):
    return load_model(str(tiny_model_dir("bart")))


def test_step_logits_equal_the_models_own_forward(bart):
    trace = decode_steps(bart, SOURCE, max_steps=4)
    source_ids = bart.tokenizer(SOURCE, return_tensors="pt")["input_ids"]
    for step in trace.steps:
        prefix = bart.tokenizer.convert_tokens_to_ids(list(step.prefix))
        with torch.inference_mode():
            logits = bart.model(input_ids=source_ids, decoder_input_ids=torch.tensor([prefix])).logits[0, -1]
        top = torch.topk(logits, len(step.candidates))
        assert [c.token_id for c in step.candidates] == top.indices.tolist()
        np.testing.assert_allclose([c.logit for c in step.candidates], top.values.numpy(), atol=1e-5)
        np.testing.assert_allclose(step.cross_attention.sum(-1), 1.0, atol=1e-5)  # [layer, head] rows


def test_greedy_steps_reproduce_generate(bart):
    trace = decode_steps(bart, SOURCE, max_steps=6)
    with torch.inference_mode():
        generated = bart.model.generate(bart.tokenizer(SOURCE, return_tensors="pt")["input_ids"], num_beams=1,
                                        do_sample=False, max_new_tokens=6)[0]
    chosen = [bart.tokenizer.convert_tokens_to_ids(step.chosen) for step in trace.steps]
    assert chosen == generated[1 : 1 + len(chosen)].tolist()


def test_beam_of_width_one_is_greedy(bart):
    greedy, beam = decode_steps(bart, SOURCE, max_steps=5), decode_steps(bart, SOURCE, beams=1, max_steps=5)
    assert [s.chosen for s in greedy.steps] == [s.chosen for s in beam.steps]
    wide = decode_steps(bart, SOURCE, beams=3, max_steps=5)
    assert wide.method == "beam search (3)" and wide.steps[0].beams and len(wide.steps[0].beams) == 3


def cross_attention_under(bart, experiment: str) -> np.ndarray:
    source_ids = bart.tokenizer(SOURCE, return_tensors="pt")["input_ids"]
    with EXPERIMENTS[experiment].apply(bart):
        _, cross = step_forward(bart, source_ids, [bart.config.decoder_start_token_id, 2000, 2001])
    return cross  # [layer, head, source_pos]


def test_corruptions_set_cross_attention_exactly(bart):
    n = len(bart.tokenizer(SOURCE)["input_ids"])
    np.testing.assert_allclose(cross_attention_under(bart, "uniform"), 1.0 / n, atol=1e-7)
    beginning = np.zeros(n)
    beginning[:BEGINNING_TOKENS] = 1.0 / BEGINNING_TOKENS
    np.testing.assert_allclose(cross_attention_under(bart, "beginning"), np.broadcast_to(beginning, (2, 4, n)))
    end = np.zeros(n)
    end[-1] = 1.0
    np.testing.assert_allclose(cross_attention_under(bart, "end"), np.broadcast_to(end, (2, 4, n)))


def test_experiments_leave_the_model_as_it_was(bart):
    sentences = ["i can eat apples", "she reads books"]
    before = translate_with(bart, sentences)
    for name in EXPERIMENTS:
        translate_with(bart, sentences, name)
    assert translate_with(bart, sentences) == before
    with capture_attention(bart.sites):
        pass
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in bart.model.modules())


def test_switching_off_cross_attention_makes_the_output_ignore_the_source(bart):
    outputs = translate_with(bart, ["i can eat apples", "the children drink milk today"], "no-cross-attention")
    assert outputs[0] == outputs[1]


def test_step_debugger_rejects_bad_input(bart, minilm):
    with pytest.raises(AttnscopeError, match="not an encoder-decoder"):
        decode_steps(minilm, SOURCE)
    with pytest.raises(AttnscopeError, match="empty"):
        decode_steps(bart, "  ")


def test_a_custom_cross_attention_function_is_applied(bart):
    from attnscope.experiments.interventions import end_pattern

    sentences = ["i can eat apples", "she reads books"]
    assert translate_with(bart, sentences, pattern=end_pattern) == translate_with(bart, sentences, "end")
