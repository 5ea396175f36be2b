"""A generation's memory estimate counts what its recorders keep and need (issue 47, item 5): a length whose estimate
exceeds what is free is refused before the model runs, in one line naming the estimate and the options that bound
it, and each recorder's share grows with the generation's length. Tiny Llama; layers and heads 0-indexed."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

import attnscope
from attnscope.attribution import StepAttribution, StepRoutes
from attnscope.attribution.terms import residual_parts
from attnscope.capture.generate import StepCandidates, check_generation, generation_memory, generation_shape
from attnscope.errors import AttnscopeError

PROMPT = "The cat sat on the mat. The dog sat on the rug. The cat"


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return attnscope.load_model(str(tiny_model_dir("llama")))


def test_each_recorders_share_of_the_estimate_grows_with_the_generation(tiny_llama):
    short, long = generation_shape(tiny_llama, 100, 64), generation_shape(tiny_llama, 100, 1024)
    for recorder in (StepAttribution(), StepAttribution(lens=True), StepRoutes()):
        small, large = recorder.memory(short), recorder.memory(long)
        assert 0 < small.total < large.total, type(recorder).__name__
    # the lens holds every step's block outputs and the LM head's logits besides the terms
    assert StepAttribution(lens=True).memory(long).total > StepAttribution().memory(long).total
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


def test_a_sampled_steps_candidates_and_chosen_probability_are_its_raw_next_token_distribution(tiny_llama):
    """StepCandidates reads each pass's logits as it ends: candidates and the chosen token's probability must be those of
    the position before the token (softmax of the raw logits, before temperature), checked on a teacher-forced pass."""
    record = attnscope.generate(tiny_llama, PROMPT, max_new_tokens=8, do_sample=True, temperature=3.0, seed=1,
                                candidates=3, progress=False)
    with torch.inference_mode():
        logits = tiny_llama.model(input_ids=torch.tensor([record.token_ids.tolist()]), use_cache=False).logits[0]
    probs = torch.softmax(logits.float(), dim=-1)  # [position, vocab]
    below_top = 0
    for step in range(record.n_steps):
        expected = probs[record.prompt_length + step - 1]
        chosen = record.chosen(step)
        assert chosen.probability == pytest.approx(float(expected[chosen.token_id]), abs=1e-5)
        assert [c.token_id for c in record.candidates(step)] == expected.topk(3).indices.tolist()
        below_top += chosen.token_id != record.candidates(step)[0].token_id
    assert below_top  # sampling at temperature 3 chose a token other than the best somewhere: the check has teeth


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS needs Linux's /proc")
def test_a_long_generation_holds_no_logits_of_every_step(tiny_llama):
    """generate used to ask transformers for every step's logits, [step, vocab] float32, kept to the end (about 480
    steps of this model's 30,522-token vocabulary: 56 MB); the candidates now keep [step, k]. Peak RSS over the call,
    above its start, stays within the record's own bytes and a margin well under those logits."""
    steps = tiny_llama.max_length - len(tiny_llama.tokenizer(PROMPT)["input_ids"])
    logits_mb = steps * tiny_llama.model.config.vocab_size * 4 / 2**20
    attnscope.generate(tiny_llama, PROMPT, max_new_tokens=4, progress=False)  # warm-up
    gc.collect()
    start = _status_mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    record = attnscope.generate(tiny_llama, PROMPT, max_new_tokens=steps, progress=False)
    above = _status_mb("VmHWM") - start - sum(a.nbytes for a in record.arrays.values()) / 2**20
    assert record.n_steps == steps and above < logits_mb / 2, (above, logits_mb)


def test_residual_pieces_of_each_pass_own_only_their_last_position(tiny_llama):
    """The pieces kept per pass are copies of its last position: a view would hold the pass's whole
    ``[position, d_model]`` output (a long prompt's) for as long as the piece is kept."""
    ids = tiny_llama.tokenizer(PROMPT * 3)["input_ids"]
    with torch.inference_mode(), residual_parts(tiny_llama, None, blocks=True) as parts:
        tiny_llama.model(input_ids=torch.tensor([ids]), use_cache=False)
        pieces = {key: kept[0] for key, kept in parts.pieces.items()}
    assert len(ids) > 20 and pieces
    held = {key: piece.untyped_storage().nbytes() // piece.nbytes for key, piece in pieces.items()}
    assert set(held.values()) == {1}, held


class _Watching(StepAttribution):
    """StepAttribution that notes, as each step is split, how many times its rows' bytes their storage holds."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[int] = []  # across the generation (finish starts the recorder afresh)

    def split(self, index: int) -> None:
        self.held.append(max(row.untyped_storage().nbytes() // row.nbytes for row in self.rows[index].values()))
        super().split(index)


def test_step_attribution_keeps_each_calls_last_row_not_its_block(tiny_llama):
    """The prompt's pass hands each layer a [head, P, P] block; the attribution keeps its last row until the step is
    split, and a view of it would hold the whole block (all layers' prompt blocks at once)."""
    watching = _Watching()
    record = attnscope.generate(tiny_llama, PROMPT * 3, max_new_tokens=3, recorders=[watching], progress=False)
    assert record.prompt_length > 20
    assert watching.held == [1, 1, 1]


def _status_mb(field: str) -> float:
    """``field`` of /proc/self/status (VmRSS, VmHWM) in MB."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(f"{field}:"))
    return int(line.split()[1]) / 1024
