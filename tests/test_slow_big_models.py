"""The issue's own commands on the biggest shipped models, marked ``slow`` (``make test`` leaves them out; run them
with ``pytest -m slow``, minutes each on 2 cores): Qwen2.5-Coder-1.5B-Instruct answering a chat prompt with the
step view, against transformers' own greedy ``generate``, and Gemma 3's long view over its whole window.
Skipped, with the line that installs them, where the models are not installed."""

from __future__ import annotations

import json

import pytest
import torch

from attnscope.models.registry import ALIASES

from .test_analysis_cli import run

pytestmark = pytest.mark.slow


def installed(alias: str) -> None:
    if not (ALIASES[alias].installed or ALIASES[alias].buildable):
        pytest.skip(f"{alias} is not installed: {ALIASES[alias].install}")


def test_qwen1_5b_answers_a_chat_prompt_as_transformers_does_and_writes_the_step_view(tmp_path, capsys):
    from attnscope import load_model
    from attnscope.records.generation import GenerationRecord

    installed("qwen1.5b")
    page, saved = tmp_path / "steps.html", tmp_path / "steps.safetensors"
    prompt = "Explain what a hash map is."
    code, out, err = run(capsys, "generate", "--model", "qwen1.5b", "--chat", prompt, "-n", "32", "--html", str(page),
                         "--save", str(saved), "--json")
    assert code == 0, err
    assert len(json.loads(out.strip().splitlines()[-1])["steps"]) == 32 and page.stat().st_size > 10_000
    record = GenerationRecord.load(saved)
    loaded = load_model("qwen1.5b")
    chat = loaded.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        greedy = loaded.model.generate(**chat, max_new_tokens=32, do_sample=False)
    assert record.token_ids.tolist() == greedy[0].tolist()
    assert "hash" in loaded.tokenizer.decode(greedy[0, chat["input_ids"].shape[1]:]).lower()


def test_gemma3_long_view_of_a_whole_window(tmp_path, capsys):
    installed("gemma3")
    page = tmp_path / "long.html"
    code, out, err = run(capsys, "view", "--model", "gemma3", "--file", "sotu-1981-jimmy-carter", "--long", "-o",
                         str(page))
    assert code == 0, err
    assert "32,768 tokens" in out and page.stat().st_size > 1_000_000
