"""A generation's memory estimate counts what its recorders keep and need (issue 47, item 5): a length whose estimate
exceeds what is free is refused before the model runs, in one line naming the estimate and the options that bound
it, and each recorder's share grows with the generation's length. Tiny Llama; layers and heads 0-indexed."""

from __future__ import annotations

import pytest

import attnscope
from attnscope.attribution import StepAttribution, StepRoutes
from attnscope.capture.generate import StepCandidates, check_generation, generation_memory, generation_shape
from attnscope.errors import AttnscopeError

PROMPT = "The cat sat on the mat. The dog sat on the rug. The cat"


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return attnscope.load_model(str(tiny_model_dir("llama")))


def test_each_recorders_share_of_the_estimate_grows_with_the_generation(tiny_llama):
    short, long = generation_shape(tiny_llama, 100, 64), generation_shape(tiny_llama, 100, 1024)
    for recorder in (StepAttribution(), StepRoutes()):
        small, large = recorder.memory(short), recorder.memory(long)
        assert 0 < small.total < large.total, type(recorder).__name__
    # routes keep every position's queries, keys, values and residual streams: at least those bytes
    shape = long
    floor = shape.n_positions * shape.n_layers * (shape.n_heads + 2 * shape.n_kv_heads) * shape.d_head * 4
    assert StepRoutes().memory(shape).working >= floor


def test_a_generation_that_would_not_fit_with_its_recorders_is_refused_in_one_line(tiny_llama, monkeypatch):
    ids = tiny_llama.tokenizer(PROMPT)["input_ids"]
    new = 400
    rows_only = generation_memory(len(tiny_llama.sites), tiny_llama.model.config.num_attention_heads, len(ids), new)
    shape = generation_shape(tiny_llama, len(ids), new)
    candidates = StepCandidates().memory(shape)  # every step's top candidates, one step's probabilities at a time
    routed = StepRoutes().memory(shape)
    available = int((rows_only.total + candidates.total + routed.total * 0.5) / 0.8)  # room for the rows, not the routes
    monkeypatch.setattr("attnscope.capture.plan.available_memory", lambda: available)
    check_generation(tiny_llama, len(ids), new)  # the rows alone fit
    with pytest.raises(AttnscopeError, match=r"needs about .* GiB .*leave out the routes \(.*--routes\)") as refused:
        attnscope.generate(tiny_llama, PROMPT, max_new_tokens=new, recorders=[StepRoutes()], progress=False)
    assert "\n" not in str(refused.value) and "max_new_tokens" in str(refused.value)


def test_the_command_refuses_it_with_exit_code_2_before_the_model_runs(tiny_model_dir, monkeypatch, capsys):
    from attnscope.cli.main import main

    monkeypatch.setattr("attnscope.capture.plan.available_memory", lambda: 2**20)
    code = main(["generate", PROMPT, "--model", str(tiny_model_dir("llama")), "-n", "400", "--attribute"])
    err = capsys.readouterr().err
    assert code == 2 and "leave out the attribution" in err and "Traceback" not in err
