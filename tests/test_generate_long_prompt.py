"""Generation after a long prompt without the prompt's own rows (``prompt_rows=False``): the rows
kept (from the prompt's last position on) equal eager ``output_attentions=True`` of the final text,
the prompt's rows are dropped as each layer's call arrives, a dropped row is refused with advice, the
record saves and loads, the default keeps the prompt's rows only below a budget, the CLI flag, and
the step view's page in Debian's Chromium."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import attnscope
from attnscope import AttnscopeError, GenerationRecord
from attnscope.capture import generate as generating
from attnscope.capture.attention import capture
from attnscope.capture.generate import StepCandidates, StepRows, generation_memory, generation_shape, keeps_prompt_rows
from attnscope.data import brown_sentences
from attnscope.experiments.interventions import HeadAblation
from attnscope.present.steps import steps_view
from attnscope.records.format import write_attnscope_file
from attnscope.records.generation import packed_length, row_offset

from .test_generate import eager_attention
from .test_steps_view import VIEW, chromium_page, quantisation_step, shown_token

ARTIFACTS = Path(__file__).parent / "artifacts"
PROMPT_TOKENS = 300  # "a few hundred": far more rows dropped than kept, still fast for a tiny model
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tiny_llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def tiny_llama(tiny_llama_dir):
    return attnscope.load_model(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def long_prompt(tiny_llama):
    """Brown sentences joined until the tokenizer makes at least PROMPT_TOKENS tokens of them."""
    sentences: list[str] = []
    for sentence in brown_sentences():
        sentences.append(sentence)
        if len(tiny_llama.tokenizer(" ".join(sentences))["input_ids"]) >= PROMPT_TOKENS:
            return " ".join(sentences)
    raise AssertionError("the Brown sample is shorter than the prompt wanted")


@pytest.fixture(scope="module")
def last_rows(tiny_llama, long_prompt):
    return attnscope.generate(tiny_llama, long_prompt, max_new_tokens=NEW_TOKENS, prompt_rows=False)


@pytest.fixture(scope="module")
def expected(tiny_llama, last_rows):
    """Eager ``[layer, head, q_pos, k_pos]`` of the final text, teacher-forced."""
    return eager_attention(tiny_llama, last_rows.token_ids)


def test_kept_rows_equal_a_teacher_forced_pass(last_rows, expected):
    record = last_rows
    assert record.prompt_length >= PROMPT_TOKENS and record.n_steps == NEW_TOKENS
    assert record.first_row == record.prompt_length - 1 and not record.has_prompt_rows
    assert f"rows from position {record.first_row}" in repr(record)
    n = len(record.tokens)
    assert record.arrays["rows"].shape == (3, 6, packed_length(n) - row_offset(record.first_row))
    for position in range(record.first_row, n):
        np.testing.assert_allclose(record.row(position), expected[:, :, position, : position + 1], atol=1e-5)
    for step in range(record.n_steps):
        position = record.prompt_length + step - 1
        np.testing.assert_allclose(record.step_attention(step), expected[:, :, position, : position + 1], atol=1e-5)


def test_the_same_generation_keeping_every_row_holds_the_same_rows(tiny_llama, long_prompt, last_rows):
    everything = attnscope.generate(tiny_llama, long_prompt, max_new_tokens=NEW_TOKENS, prompt_rows=True)
    assert everything.first_row == 0 and everything.tokens == last_rows.tokens
    start = row_offset(last_rows.first_row)
    # without the prompt's rows its output comes from the fused SDPA kernel, with them from the eager
    # product: the same numbers to float32 rounding, not bit for bit
    np.testing.assert_allclose(everything.arrays["rows"][..., start:], last_rows.arrays["rows"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(everything.arrays["value_norms"], last_rows.arrays["value_norms"], rtol=1e-5)
    step = NEW_TOKENS - 1
    np.testing.assert_allclose(everything.step_attention(step, weighted=True),
                               last_rows.step_attention(step, weighted=True), atol=1e-6)


def test_prefill_rows_before_first_row_are_dropped_as_each_call_arrives(tiny_llama, long_prompt):
    ids = tiny_llama.tokenizer(long_prompt)["input_ids"]
    kept_per_layer, computed = [], []

    class Watching(StepRows):  # what is kept right after each layer's call, before the next one runs
        def __call__(self, site, captured):  # type: ignore[no-untyped-def]
            computed.append((tuple(captured.attention.shape), captured.first_query))
            super().__call__(site, captured)
            kept_per_layer.append(self.kept_elements(site.layer))

    rows = Watching(first_row=len(ids) - 1, layers=(0, 1, 2), n_positions=len(ids))
    with torch.inference_mode(), capture(tiny_llama.sites, recorder=rows):
        tiny_llama.model(input_ids=torch.tensor([ids]), use_cache=True)
    assert kept_per_layer == [6 * len(ids)] * 3, "each layer keeps one row of every head, not [head, P, P]"
    # the attention function ran the unwanted rows fused: it computed the probabilities of one row only
    assert computed == [((1, 6, 1, len(ids)), len(ids) - 1)] * 3


def test_a_dropped_row_and_the_full_matrix_are_refused_with_advice(last_rows):
    for position in (0, last_rows.first_row - 1):
        with pytest.raises(AttnscopeError, match="were not kept.*prompt_rows=True"):
            last_rows.row(position)
    with pytest.raises(AttnscopeError, match="no full \\[layer, head, T, T\\] matrix.*--prompt-rows all"):
        last_rows.to_attention_record()
    with pytest.raises(AttnscopeError, match="no full"):
        last_rows.attention_matrix()
    with pytest.raises(ValueError, match="first_row"):  # the row that chose the first token must be kept
        GenerationRecord(model=last_rows.model, tokens=last_rows.tokens, prompt_length=last_rows.prompt_length,
                         arrays=last_rows.arrays, candidate_tokens=last_rows.candidate_tokens,
                         first_row=last_rows.prompt_length)


def test_save_and_load_keep_first_row_and_older_files_load_as_every_row(tiny_llama, last_rows, tmp_path):
    again = GenerationRecord.load(last_rows.save(tmp_path / "gen.safetensors"))
    assert again.first_row == last_rows.first_row and again.tokens == last_rows.tokens
    np.testing.assert_array_equal(again.step_attention(3), last_rows.step_attention(3))

    older = attnscope.generate(tiny_llama, "The cat sat on the mat.", max_new_tokens=3)
    metadata = older._metadata()
    del metadata["first_row"]  # what a file written before first_row existed holds
    loaded = GenerationRecord.load(write_attnscope_file(tmp_path / "old.safetensors", older.arrays, metadata))
    assert loaded.first_row == 0
    np.testing.assert_array_equal(loaded.attention_matrix(), older.attention_matrix())


def test_the_default_keeps_the_prompt_rows_only_within_the_budget(tiny_llama, long_prompt, monkeypatch):
    n_prompt = len(tiny_llama.tokenizer(long_prompt)["input_ids"])
    prompt_bytes = 3 * 6 * packed_length(n_prompt) * 4  # float32 rows of every layer and head
    monkeypatch.setattr(generating, "PROMPT_ROWS_BUDGET", prompt_bytes)
    within = attnscope.generate(tiny_llama, long_prompt, max_new_tokens=1)
    monkeypatch.setattr(generating, "PROMPT_ROWS_BUDGET", prompt_bytes - 1)
    above = attnscope.generate(tiny_llama, long_prompt, max_new_tokens=1)
    assert within.first_row == 0 and above.first_row == n_prompt - 1
    kept = attnscope.generate(tiny_llama, long_prompt, max_new_tokens=1, prompt_rows=True)
    assert kept.first_row == 0, "an explicit choice overrides the budget"
    monkeypatch.undo()
    # SmolLM2's shape (30 layers x 9 heads) under the shipped budget of 512 MiB: about 1,000 tokens
    assert keeps_prompt_rows(None, 30, 9, 900) and not keeps_prompt_rows(None, 30, 9, 1100)
    assert not keeps_prompt_rows(False, 30, 9, 10) and keeps_prompt_rows(True, 30, 9, 8000)


def test_the_memory_estimate_follows_the_rows_kept_and_one_layers_prefill(tiny_llama, long_prompt, monkeypatch):
    gib = 2**30
    smollm2_window = generation_memory(30, 9, 8176, 16, first_row=8175)  # a whole context window
    assert smollm2_window.kept < 0.5 * gib and smollm2_window.total < 10 * gib  # 17 rows of 8,192 keys per head
    one_layer = 9 * 8176**2 * 4
    assert smollm2_window.working < one_layer / 2, "the prompt runs fused: its masks and one row per head"
    every_row = generation_memory(30, 9, 8176, 16, first_row=0)
    assert 3 * one_layer <= every_row.working < 4 * one_layer, "one layer's [head, P, P] blocks, not 30"
    under_an_intervention = generation_memory(30, 9, 8176, 16, first_row=8175, fused_prompt=False)
    assert under_an_intervention.working == every_row.working and under_an_intervention.kept == smollm2_window.kept
    assert every_row.kept > 60 * gib  # every prompt row, twice
    # An intervention makes the prompt run eagerly: the same generation is refused under one only
    ids = tiny_llama.tokenizer(long_prompt)["input_ids"]
    layers, heads = len(tiny_llama.sites), tiny_llama.model.config.num_attention_heads
    fused = generation_memory(layers, heads, len(ids), 2, first_row=len(ids) - 1)
    eager = generation_memory(layers, heads, len(ids), 2, first_row=len(ids) - 1, fused_prompt=False)
    candidates = StepCandidates().memory(generation_shape(tiny_llama, len(ids), 2)).total  # each step's top tokens
    monkeypatch.setattr("attnscope.capture.plan.available_memory",
                        lambda: int(((fused.total + eager.total) / 2 + candidates) / 0.8))
    attnscope.generate(tiny_llama, long_prompt, max_new_tokens=2, prompt_rows=False)
    with pytest.raises(AttnscopeError, match="needs about"), attnscope.intervene(HeadAblation("zero", layers=[0])):
        attnscope.generate(tiny_llama, long_prompt, max_new_tokens=2, prompt_rows=False)
    # Refused in one line when it would not fit (the machine's available memory set small)
    monkeypatch.setattr("attnscope.capture.plan.available_memory", lambda: 2**20)
    with pytest.raises(AttnscopeError, match="prompt_rows=False, --prompt-rows last") as refused:
        attnscope.generate(tiny_llama, long_prompt, max_new_tokens=2, prompt_rows=True)
    assert "\n" not in str(refused.value)


def test_cli_prompt_rows_flag(tiny_llama_dir, long_prompt, tmp_path, capsys):
    from attnscope.cli import main

    saved = tmp_path / "gen.safetensors"
    arguments = ["generate", long_prompt, "--model", str(tiny_llama_dir), "-n", "3", "--save", str(saved)]
    assert main([*arguments, "--prompt-rows", "last", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    record = GenerationRecord.load(saved)
    assert record.first_row == record.prompt_length - 1 and len(result["steps"]) == 3
    assert [step["token"] for step in result["steps"]] == list(record.generated_tokens)
    assert main([*arguments, "--prompt-rows", "all"]) == 0  # the per-step table
    assert record.generated_text in capsys.readouterr().out
    assert GenerationRecord.load(saved).first_row == 0
    with pytest.raises(SystemExit) as bad:
        main(["generate", "x", "--prompt-rows", "some"])
    assert bad.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("attnscope: error:") and "--prompt-rows" in error


def test_cli_reads_a_long_prompt_from_a_file(tiny_llama_dir, long_prompt, tmp_path, capsys):
    from attnscope.cli import main

    document = tmp_path / "report.txt"
    document.write_text(long_prompt, encoding="utf-8")
    common = ["--model", str(tiny_llama_dir), "-n", "3", "--prompt-rows", "last", "--json"]
    assert main(["generate", "--file", str(document), *common]) == 0
    from_file = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["generate", long_prompt, *common]) == 0
    assert from_file == json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for arguments, message in [(["generate", "hi", "--file", str(document)], "one of them"),
                               (["generate"], "one of them"),
                               (["generate", "--file", str(tmp_path / "missing.txt")], "no such file: ")]:
        assert main([*arguments, "--model", str(tiny_llama_dir)]) == 2
        error = capsys.readouterr().err.strip().splitlines()
        assert len(error) == 1 and error[0].startswith("attnscope: error:") and message in error[0]


def test_the_step_page_draws_after_a_prompt_without_its_rows(browser, last_rows):
    page = chromium_page(browser, steps_view(last_rows).save(ARTIFACTS / "steps_long_prompt.html"))
    within = lambda got, want, levels: np.all(np.abs(np.array(got) - want) <= quantisation_step(want, levels))
    assert page.text_content("[data-role=chosen]") == shown_token(last_rows.chosen(0).token)
    assert page.locator("[data-role=attention] .st-key").count() == last_rows.prompt_length
    assert within(page.evaluate(f"{VIEW}.row()"), last_rows.step_attention(0).mean(axis=(0, 1)), 255)
    page.keyboard.press("End")
    last = last_rows.n_steps - 1
    page.wait_for_function(f"() => document.querySelector('.attnscope-steps').dataset.step === '{last}'")
    assert page.locator("[data-role=attention] .st-key").count() == last_rows.prompt_length + last
    page.select_option("[data-role=layer]", "2")
    page.select_option("[data-role=head]", "4")
    assert within(page.evaluate(f"{VIEW}.row()"), last_rows.step_attention(last)[2, 4], 15)
    page.screenshot(path=str(ARTIFACTS / "steps_long_prompt.png"))
    assert page.errors == [] and all(url.startswith("file:") for url in page.requests)
