"""Analyses refuse in one line when attnscope's attention function is not the one running (issue 46, item 2).

``AutoModelForCausalLM.from_config(loaded.model.config, attn_implementation="eager")`` switches the shared config
of a loaded model to transformers' eager attention, in place: nothing is recorded and no intervention applies
any more, so patching used to answer a share recovered of 0 for every head. Each analysis must refuse before its
first forward pass where the config tells, and after the pass where only the pass can (capture/running.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

import attnscope
from attnscope.attribution import logit_lens, qk_attribution
from attnscope.attribution.dla import direct_logit_attribution
from attnscope.attribution.generation_routes import StepRoutes
from attnscope.attribution.routes import routes
from attnscope.attribution.steps import StepAttribution
from attnscope.capture.attention import capture, register_attention_function
from attnscope.errors import AttnscopeError
from attnscope.experiments import head_importance, prepare_metric, run_sweep
from attnscope.experiments.atp import attribution_patching
from attnscope.experiments.interventions import ablate_heads
from attnscope.experiments.mixing import mixing_measures
from attnscope.experiments.patching import PromptPair, activation_patching

TEXT = "When Mary and John went to the store, John gave a drink to"
PAIR = PromptPair(TEXT, "When Mary and John went to the store, Mary gave a drink to", " Mary", " John")
SWITCHED = "now runs transformers' 'eager' implementation, not attnscope's: its config was changed after loading"


@contextmanager
def eager_config(config) -> Iterator[None]:
    """``config`` (and its sub-configs) switched to eager attention, as ``from_config(config,
    attn_implementation="eager")`` leaves it (see the first test), put back after the block: the loaded model may
    be shared with other tests."""
    previous = config._attn_implementation
    try:
        config._attn_implementation = "eager"
        yield
    finally:
        config._attn_implementation = previous


@contextmanager
def passes_counted(layer: torch.nn.Module) -> Iterator[list[int]]:
    """How many forward passes reach ``layer`` inside the block (a real hook on the real model)."""
    count = [0]
    handle = layer.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    try:
        yield count
    finally:
        handle.remove()


def one_line_refusal(run: Callable[[], object], match: str) -> str:
    with pytest.raises(AttnscopeError, match=match) as refused:
        run()
    assert "\n" not in str(refused.value)
    return str(refused.value)


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return attnscope.load_model(str(tiny_model_dir("llama")))


def test_a_model_built_from_the_loaded_config_switches_it_and_patching_refuses(tiny_llama):
    """The issue's own step, on a tiny Llama: the sibling model switches the loaded model's config in place."""
    import transformers

    config = tiny_llama.model.config
    try:
        transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        assert config._attn_implementation == "eager"
        pair = PromptPair("the cat sat on the mat", "the cat sat on the rug", "mat", "rug")
        one_line_refusal(lambda: activation_patching(tiny_llama, pair, n_resamples=0), SWITCHED)
    finally:
        config._attn_implementation = "attnscope"
    assert activation_patching(tiny_llama, pair, n_resamples=0).heads.shape == (1, 3, 6)  # back: it runs again


def _loss_task(model):
    return prepare_metric("loss", model, [TEXT], batch_size=1)


ANALYSES: dict[str, Callable[[attnscope.LoadedModel], object]] = {
    "activation patching": lambda m: activation_patching(m, PAIR, n_resamples=0),
    "AtP": lambda m: attribution_patching(m, PAIR, method="atp", n_resamples=0),
    "AtP*": lambda m: attribution_patching(m, PAIR, method="atp*", n_resamples=0),
    "ablation sweep": lambda m: run_sweep(m, _loss_task(m), "heads", layers=[0], n_resamples=0, progress=False),
    "head importance": lambda m: head_importance(m, _loss_task(m)),
    "direct logit attribution": lambda m: direct_logit_attribution(m, TEXT),
    "logit lens": lambda m: logit_lens(m, TEXT),
    "routes": lambda m: routes(m, TEXT),
    "QK attribution": lambda m: qk_attribution(m, TEXT, 5, 0, -1, 0),
    "value zeroing": lambda m: mixing_measures(m, TEXT, methods=["value_zeroing"]),
    "generate (rows)": lambda m: attnscope.generate(m, TEXT, max_new_tokens=2),
    "generate --attribute": lambda m: attnscope.generate(m, TEXT, max_new_tokens=2, recorders=[StepAttribution()]),
    "generate --routes": lambda m: attnscope.generate(m, TEXT, max_new_tokens=2, recorders=[StepRoutes()]),
    "extract": lambda m: attnscope.extract(m, TEXT),
}


@pytest.mark.parametrize("analysis", list(ANALYSES))
def test_every_analysis_refuses_a_switched_smollm2_before_its_first_forward_pass(smollm2, analysis):
    with eager_config(smollm2.model.config), passes_counted(smollm2.model.model.layers[0]) as passes:
        message = one_line_refusal(lambda: ANALYSES[analysis](smollm2), SWITCHED)
    assert passes == [0], f"{analysis} ran {passes[0]} forward passes before refusing"
    assert "attnscope.load_model" in message and "copy.deepcopy(loaded.model.config)" in message


def test_an_intervention_block_in_which_no_call_arrived_is_refused_after_the_pass(tiny_llama):
    """``ablate_heads`` does not know the model, so only the pass tells: it changed nothing."""
    ids = tiny_llama.tokenizer("the cat sat on the mat", return_tensors="pt")["input_ids"]
    refused = pytest.raises(AttnscopeError, match="no call reached attnscope's attention function inside this intervene")
    with eager_config(tiny_llama.model.config), refused, ablate_heads({0: [0]}), torch.inference_mode():
        tiny_llama.model(input_ids=ids, use_cache=False)
    with ablate_heads({0: [0]}), torch.inference_mode():  # wired again: the same block is fine
        tiny_llama.model(input_ids=ids, use_cache=False)


def test_a_replaced_attention_function_is_refused_after_the_pass(tiny_llama):
    """The config still names ``"attnscope"``, but another function is registered under that name: only the pass
    can tell. Patching used to answer 0 for every head here too."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    pair = PromptPair("the cat sat on the mat", "the cat sat on the rug", "mat", "rug")
    try:
        AttentionInterface.register("attnscope", sdpa_attention_forward)
        one_line_refusal(lambda: activation_patching(tiny_llama, pair, n_resamples=0),
                         "ran .* but never called attnscope's attention function")
    finally:
        register_attention_function()
    with capture(tiny_llama.sites):  # a capture block without a forward pass heard nothing and is fine
        pass


def test_a_switched_sub_config_of_an_encoder_decoder_is_refused(tiny_model_dir):
    """T5Gemma keeps its encoder's and decoder's configs apart: switching only the decoder's is enough to lose
    its cross- and self-attention."""
    from .tiny_architectures import build_folder

    folder = build_folder("t5gemma", tiny_model_dir("bart").parent / "t5gemma-switch")
    loaded = attnscope.load_model(str(folder))
    decoder = loaded.model.config.decoder
    with eager_config(decoder):
        assert loaded.model.config.encoder._attn_implementation == "attnscope"
        one_line_refusal(lambda: attnscope.extract(loaded, "the cat sat", "the dog"), SWITCHED)
    assert attnscope.extract(loaded, "the cat sat", "the dog").attention.shape[0] > 0
