"""Every command on the real Qwen2.5-Coder-0.5B-Instruct (the ``qwen0.5b`` alias), each as small as it goes.

The model is loaded once (float32) and handed to every command but the first, which loads it as a user
does; results are checked against transformers' own eager attention, greedy ``generate`` and loss, and a
head zeroed by a hook. Skipped, with the line that installs it, where the parts are not installed
(``make test`` installs them; the 1.5B runs in ``benchmarks/big.py`` instead).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from attnscope.capture import loading as capture_loading
from attnscope.models.registry import ALIASES

from .test_analysis_cli import run

ALIAS = ALIASES["qwen0.5b"]
TEXT = "def add(a, b):\n    return a + b"


@pytest.fixture(scope="module")
def qwen():
    if not (ALIAS.installed or ALIAS.buildable):
        pytest.skip(f"qwen0.5b is not installed: {ALIAS.install}")
    return capture_loading.load_model("qwen0.5b")


@pytest.fixture
def shared(qwen, monkeypatch):
    """Commands get the loaded model instead of loading it again (same name, dtype and device only)."""
    real = capture_loading.load_model

    def load_model(name="minilm", *, dtype="float32", device="cpu"):
        return qwen if (name, dtype, device) == ("qwen0.5b", "float32", "cpu") else real(name, dtype=dtype,
                                                                                      device=device)

    monkeypatch.setattr(capture_loading, "load_model", load_model)
    return qwen


def _eager(qwen):
    """The same weights with transformers' eager attention (switched on the loaded model, then back)."""
    class Eager:
        def __enter__(self):
            qwen.model.set_attn_implementation("eager")
            return qwen.model

        def __exit__(self, *exc):
            qwen.model.set_attn_implementation(capture_loading.ATTN_IMPLEMENTATION)

    return Eager()


def test_the_alias_is_the_model_the_issue_names(qwen):
    config = qwen.config
    assert (config.model_type, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.hidden_size) == ("qwen2", 24, 14, 2, 896)
    assert qwen.max_length == ALIAS.max_tokens


def test_extract_equals_eager_attention_of_the_real_model(shared, tmp_path, capsys):
    from attnscope import AttentionRecord

    out = tmp_path / "records"
    code, _, err = run(capsys, "extract", TEXT, "--model", "qwen0.5b", "--out", str(out))
    assert code == 0, err
    record = AttentionRecord.open(next(out.glob("*.safetensors")))
    ids = torch.from_numpy(np.asarray(record.token_ids).copy())[None]
    with _eager(shared) as eager, torch.inference_mode():
        expected = torch.cat(eager(ids, output_attentions=True).attentions).numpy()  # [layer, head, q, k]
    assert record.attention.shape == expected.shape == (24, 14, ids.shape[1], ids.shape[1])
    np.testing.assert_allclose(record.attention, expected, atol=1e-5, rtol=0)


def test_report_loads_the_alias_as_a_user_does(qwen, capsys):
    code, out, err = run(capsys, "report", TEXT, "--model", "qwen0.5b", "--layers", "0")
    assert code == 0, err
    assert "24 layers x 14 heads (2 key/value heads)" in out


def test_view_long_draws_a_shipped_document(shared, tmp_path, capsys):
    page = tmp_path / "long.html"
    code, _, err = run(capsys, "view", "--file", "moby-dick-001", "--model", "qwen0.5b", "--max-tokens", "96",
                       "--long", "--layers", "0", "-o", str(page))
    assert code == 0, err
    html = page.read_text()
    start = html.index('id="attnscope-view-payload"')
    payload = json.loads(html[html.index(">", start) + 1:html.index("</script>", start)])
    assert len(payload["tokens"]) == 96 and payload["layers"] == [0]
    assert "".join(payload["tokens"]).startswith("CHAPTER 1. Loomings.")


def test_patterns_classifies_every_head(shared, capsys):
    code, out, err = run(capsys, "patterns", TEXT, "--model", "qwen0.5b", "--json")
    assert code == 0, err
    heads = json.loads(out.strip().splitlines()[-1])
    assert len(heads) == 24 * 14
    assert {(row["layer"], row["head"]) for row in heads} == {(layer, head) for layer in range(24) for head in range(14)}


def test_sinks_finds_the_first_token_sink(shared, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The cat sat on the mat.\nWrite a function that adds two numbers.\n")
    out = tmp_path / "sinks"
    code, _, err = run(capsys, "sinks", str(corpus), "--model", "qwen0.5b", "--limit", "2", "-o", str(out))
    assert code == 0, err
    data = json.loads((out / "sinks.json").read_text())
    assert data["n_inputs"] == 2 and data["summary"]["heads"] == 24 * 14


def test_mixing_shares_of_each_token_sum_to_one(shared, capsys):
    code, out, err = run(capsys, "mixing", TEXT, "--model", "qwen0.5b", "--json")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    n = len(shared.tokenizer(TEXT)["input_ids"])
    assert len(result["tokens"]) == len(result["output_shares"]) == n
    assert sum(result["output_shares"]) == pytest.approx(1.0, abs=1e-4)
    rollout = np.array(result["rollout"])  # [q, k]: a causal model mixes in no later token
    np.testing.assert_allclose(rollout.sum(-1), 1.0, atol=1e-4)
    assert np.abs(np.triu(rollout, 1)).max() <= 1e-6


def test_generate_chat_equals_transformers_greedy_and_writes_the_step_view(shared, tmp_path, capsys):
    from attnscope.records.generation import GenerationRecord

    page, saved = tmp_path / "steps.html", tmp_path / "steps.safetensors"
    code, out, err = run(capsys, "generate", "Say hi.", "--model", "qwen0.5b", "--chat", "-n", "4", "--json",
                         "--html", str(page), "--save", str(saved))
    assert code == 0, err
    record = GenerationRecord.load(saved)
    assert len(json.loads(out.strip().splitlines()[-1])["steps"]) == 4
    chat = shared.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)
    with torch.inference_mode():
        greedy = shared.model.generate(**chat, max_new_tokens=4, do_sample=False)
    assert record.token_ids[:record.prompt_length].tolist() == chat["input_ids"][0].tolist()
    assert record.token_ids[record.prompt_length:].tolist() == greedy[0, chat["input_ids"].shape[1]:].tolist()
    assert page.stat().st_size > 10_000


def test_ablate_one_layer_equals_a_head_zeroed_by_hand(shared, tmp_path, capsys):
    import pandas as pd

    texts = ["The cat sat on the mat.", "Write a function that adds two numbers."]
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(texts) + "\n")
    out = tmp_path / "ablation"
    code, _, err = run(capsys, "ablate", "--model", "qwen0.5b", "--data", str(data), "--metric", "loss",
                       "--layers", "3", "--bootstrap", "10", "-o", str(out))
    assert code == 0, err
    table = pd.read_csv(out / "ablation_heads.csv")
    assert list(table["head"]) == list(range(14))

    def loss(zero_head: int | None) -> float:
        """Token-weighted next-token loss over ``texts``, with one head of layer 3 zeroed at o_proj's input."""
        o_proj = shared.model.model.layers[3].self_attn.o_proj

        def zero(module, args):
            hidden = args[0].clone()
            hidden[..., zero_head * 64:(zero_head + 1) * 64] = 0
            return (hidden,)

        handle = o_proj.register_forward_pre_hook(zero) if zero_head is not None else None
        total = tokens = 0.0
        try:
            for text in texts:
                ids = shared.tokenizer(text, return_tensors="pt")["input_ids"]
                with torch.inference_mode():
                    log_p = torch.log_softmax(shared.model(ids).logits[0, :-1].double(), -1)  # float64 throughout
                total -= float(log_p.gather(-1, ids[0, 1:, None]).sum())
                tokens += ids.shape[1] - 1
        finally:
            if handle is not None:
                handle.remove()
        return total / tokens

    baseline = loss(None)
    assert table["baseline"].iloc[0] == pytest.approx(baseline, abs=2e-5)  # batched and padded vs one by one
    for head in (0, 7):
        assert table["delta"][head] == pytest.approx(loss(head) - baseline, abs=2e-5)
