"""QK attribution: one attention score split into (query component, key component) pairs.

References are independent of attnscope's capture: transformers' eager attention (``output_attentions=True``)
of the same weights. The score table's sums for two keys of one query differ by the difference of eager's log
attention (``s_ij - s_ij' = log a_ij - log a_ij'``; through the cap for Gemma 2), and the centred table plus the
row term equals eager's ``log a_ij``, on tiny perturbed Llama (grouped kv heads), Qwen 2 (q/k biases), Gemma 3
(per-head q/k norms, post-sublayer norms, sliding windows), Gemma 2 (softcapping), gpt-oss (learned sinks), and
on SmolLM2, Gemma 3 270M and Qwen2.5-Coder-0.5B (q/k biases, real weights) when installed. A hand-built two-layer
model with a planted induction circuit puts the previous-token head on the key side.
Layers, heads and positions are 0-indexed.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

import attnscope
from attnscope import AttnscopeError, cli
from attnscope.attribution.qk import qk_attribution
from attnscope.models.registry import ALIASES

from .conftest import VOCAB
from .test_devices import DEVICES, watched
from .tiny_architectures import build_folder, eager_attentions

TOLERANCE = 1e-4
TEXT = "The cat sat on the mat and looked at the dog."


def _config(kind: str) -> object:
    from transformers import Gemma2Config, Gemma3TextConfig, LlamaConfig, Qwen2Config

    ids = {"pad_token_id": 0, "bos_token_id": 101, "eos_token_id": 102, "vocab_size": VOCAB}
    if kind == "llama":  # grouped: 6 query heads read 2 kv heads
        return LlamaConfig(hidden_size=48, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                           intermediate_size=37, **ids)
    if kind == "qwen2":  # biases on q, k and v
        return Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           intermediate_size=37, **ids)
    shared = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1,
              "head_dim": 8, "intermediate_size": 37, "sliding_window": 4, "query_pre_attn_scalar": 16,
              "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], **ids}
    if kind == "gemma3":
        return Gemma3TextConfig(**shared)
    return Gemma2Config(attn_logit_softcapping=5.0, final_logit_softcapping=3.0, **shared)


MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma3_text", "gemma2": "gemma2"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``tiny(kind)`` -> (loaded model, its folder, the text's ids, eager attention per layer ``[head, q, k]``)."""
    built: dict[str, tuple] = {}

    def get(kind: str):
        if kind not in built:
            folder = build_folder(MODEL_TYPES[kind], tmp_path_factory.mktemp(f"qk-{kind}"), _config(kind))
            loaded = attnscope.load_model(str(folder))
            ids = loaded.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
            built[kind] = (loaded, ids, eager_attentions(folder, ids, None)["self"])
        return built[kind]

    return get


def check_against_eager(loaded, ids, eager, layer: int, head: int, query: int, key: int, other: int,
                        cap: float | None = None) -> float:
    """The largest error of the tables of (query, key) and (query, other) against eager's log attention."""
    first, second = (qk_attribution(loaded, ids, layer, head, query, k) for k in (key, other))
    seen = [q.total() if cap is None else cap * math.tanh(q.total() / cap) for q in (first, second)]
    with np.errstate(divide="ignore"):  # a sliding window's masked keys have weight 0
        log_a = np.log(eager[layer][head, query, : query + 1].astype(np.float64))
    errors = [abs(q.total() - q.score) for q in (first, second)]  # the table against the model's own score
    errors.append(abs((seen[0] - seen[1]) - (log_a[key] - log_a[other])))  # against eager
    if cap is None:
        errors += [abs(q.softmax_total() - log_a[k]) for q, k in ((first, key), (second, other))]
    else:
        assert first.centred is None and first.row_term is None
        assert first.capped_score == pytest.approx(cap * math.tanh(first.score / cap))
    return max(errors)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3", "gemma2"])
def test_pairs_sum_to_the_score_and_to_eager_log_attention(tiny, kind):
    loaded, ids, eager = tiny(kind)
    cap = getattr(loaded.config, "attn_logit_softcapping", None) if kind == "gemma2" else None
    last = len(ids) - 1
    n_heads = eager[0].shape[0]
    worst = max(check_against_eager(loaded, ids, eager, layer, head, query, query - 2, query - 1, cap)
                for layer in range(len(eager)) for head in (0, n_heads - 1) for query in (last, 5))
    assert worst < TOLERANCE


def test_the_table_has_every_component_once_and_the_bias_where_there_is_one(tiny):
    loaded, ids, _ = tiny("qwen2")
    qk = qk_attribution(loaded, ids, 1, 3, -1, 0)
    n_heads = loaded.config.num_attention_heads
    assert qk.query_components == qk.key_components
    # Qwen 2's output projection has no bias: no "L0 attention bias"; its q/k projections have one: "bias"
    assert qk.query_components == ("embedding", *[f"L0H{h} (head)" for h in range(n_heads)], "L0 MLP", "bias")
    assert qk.scores.shape == (len(qk.query_components),) * 2
    assert np.abs(qk.scores[-1]).sum() > 0 and np.abs(qk.scores[:, -1]).sum() > 0  # Qwen 2's q/k biases
    frame = qk.to_frame()
    assert len(frame) == qk.scores.size and frame.score_term.sum() == pytest.approx(qk.score, abs=TOLERANCE)
    pairs = qk.top_pairs(3)
    assert abs(pairs[0][2]) == pytest.approx(np.abs(qk.scores).max()) and len(pairs) == 3
    figure = qk.plot(k=4)  # the 4 x 4 corner of the largest rows and columns, drawn as they are
    shown = figure.axes[0].images[0].get_array()
    rows = [qk.query_components.index(t.get_text()) for t in figure.axes[0].get_yticklabels()]
    columns = [qk.key_components.index(t.get_text()) for t in figure.axes[0].get_xticklabels()]
    assert shown.shape == (4, 4) and np.allclose(shown, qk.scores[np.ix_(rows, columns)])
    assert set(rows) == set(np.argsort(-np.abs(qk.scores).sum(1))[:4])


def shown_components(qk) -> set[str]:
    """Every component name the table, the JSON and the figure show (query and key sides)."""
    frame, data, axes = qk.to_frame(), qk.to_dict(), qk.plot(k=100).axes[0]
    return {*frame.query_component, *frame.key_component, *data["query_components"], *data["key_components"],
            *(label.get_text() for label in [*axes.get_xticklabels(), *axes.get_yticklabels()])}


def test_a_model_without_query_or_key_biases_has_no_bias_component(tiny):
    loaded, ids, _ = tiny("llama")
    attention = loaded.model.model.layers[1].self_attn
    assert attention.q_proj.bias is None and attention.k_proj.bias is None  # nothing a "bias" component could hold
    qk = qk_attribution(loaded, ids, 1, 2, -1, 3)
    assert "bias" not in shown_components(qk) and "L0 MLP" in shown_components(qk)
    assert qk.query_components[-1] == "L0 MLP" and abs(qk.total() - qk.score) < TOLERANCE


def test_keys_the_query_cannot_see_are_refused_before_the_forward_pass(tiny):
    loaded, ids, _ = tiny("gemma3")  # layer 0: a sliding window of 4 keys
    with pytest.raises(AttnscopeError, match=r"outside layer 0's sliding window of 4 keys: query 9 sees keys 6\.\.9"):
        qk_attribution(loaded, ids, 0, 0, 9, 2)
    assert qk_attribution(loaded, ids, 1, 0, 9, 2).key == 2  # a global layer sees it
    with pytest.raises(AttnscopeError, match="key 5 is after query 3"):
        qk_attribution(loaded, ids, 1, 0, 3, 5)
    with pytest.raises(AttnscopeError, match=r"head 4 is outside layer 1's 4 heads \(0\.\.3\)"):
        qk_attribution(loaded, ids, 1, 4, 3, 1)
    with pytest.raises(AttnscopeError, match=r"layer 3 is outside .* 3 layers \(0\.\.2\)"):
        qk_attribution(loaded, ids, 3, 0, 3, 1)
    with pytest.raises(AttnscopeError, match="position 40 is outside"):
        qk_attribution(loaded, ids, 1, 0, 40, 1)


def test_a_learned_sink_enters_the_row_term_only(tmp_path):
    """gpt-oss: a learned sink logit per head takes part of each row (eager's rows over the real keys sum to less
    than 1); the score table is the keys' alone, and the row term holds the sink (sliding window on layer 0)."""
    from .tiny_architectures import TEXT as SINK_TEXT

    folder = build_folder("gpt_oss", tmp_path)
    loaded = attnscope.load_model(str(folder))
    ids = loaded.tokenizer(SINK_TEXT, add_special_tokens=False)["input_ids"]
    eager = eager_attentions(folder, ids, None)["self"]
    query = len(ids) - 1
    for layer in range(len(eager)):
        assert eager[layer][0, query].sum() < 0.999  # the sink took a share
        worst = check_against_eager(loaded, ids, eager, layer, 0, query, query - 2, query - 1)
        assert worst < TOLERANCE
        assert qk_attribution(loaded, ids, layer, 0, query, query - 1).sink_mass > 0


# ---- a planted induction circuit ---------------------------------------------------------------------------
TOKENS = (1000, 1001, 1002, 1003, 1004, 1005)  # token TOKENS[s] is embedded as the unit vector of dimension s


def induction_model(folder):
    """Two layers, two heads each, every other weight zero: L0H0 attends to the previous token (a constant query and
    key in RoPE's fastest pair, the key turned one position ahead) and copies its token (dimensions 0..5) into
    dimensions 8..13; L1H0's query reads the current token, its key the copied previous token (in RoPE's slowest
    pairs, which barely turn over a few positions): it attends to the token after an earlier copy of the current one
    (Olsson et al. 2022, "In-context Learning and Induction Heads")."""
    import transformers

    from attnscope.models.loading import resolve_source

    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=2, head_dim=16, intermediate_size=8, attention_bias=True,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e8}, vocab_size=VOCAB,
                                      architectures=["LlamaForCausalLM"], pad_token_id=0, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.fill_(1.0 if "norm" in name else 0.0)
        for slot, token in enumerate(TOKENS):
            model.model.embed_tokens.weight[token, slot] = 1.0
        previous, induction = model.model.layers[0].self_attn, model.model.layers[1].self_attn
        previous.q_proj.bias[0] = 12.0  # score 36 cos(offset - 1) after the 1/4 scaling: the previous token wins
        previous.k_proj.bias[0], previous.k_proj.bias[8] = 12.0 * math.cos(1.0), 12.0 * math.sin(1.0)
        for slot in range(len(TOKENS)):
            previous.v_proj.weight[slot, slot] = 1.0
            previous.o_proj.weight[8 + slot, slot] = 1.0
            induction.q_proj.weight[2 + slot, slot] = 2.0
            induction.k_proj.weight[2 + slot, 8 + slot] = 2.0
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(resolve_source("minilm")).save_pretrained(folder)
    return folder


def test_a_planted_induction_head_reads_the_previous_token_head_on_its_key_side(tmp_path):
    loaded = attnscope.load_model(str(induction_model(tmp_path)))
    ids = [TOKENS[0], TOKENS[1], TOKENS[2], TOKENS[3], TOKENS[1]]  # at the second TOKENS[1], look at TOKENS[2]
    qk = qk_attribution(loaded, ids, 1, 0, 4, 2)
    assert qk.log_attention > math.log(0.9)  # the circuit works: the head looks at the token after the copy
    assert qk.top_pairs(1)[0][:2] == ("embedding", "L0H0 (head)")
    key_side = qk.scores.sum(0)  # [key component]
    assert key_side[qk.key_components.index("L0H0 (head)")] == pytest.approx(qk.score, rel=1e-3)
    assert qk.top_pairs(1, "centred")[0][:2] == ("embedding", "L0H0 (head)")
    assert abs(qk.total() - qk.score) < TOLERANCE


# ---- real models: SmolLM2, Gemma 3 270M, Qwen2.5-Coder-0.5B ---------------------------------------------------
def eager_log_attention(loaded, ids: list[int]) -> list[np.ndarray]:
    """Transformers' eager attention of the same loaded weights: ``[head, q, k]`` per layer, float64 logs."""
    model = loaded.model
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False)
    finally:
        model.set_attn_implementation(previous)
    with np.errstate(divide="ignore"):  # the masked (later) keys have weight 0
        return [np.log(layer[0].double().numpy()) for layer in out.attentions]


# (alias, [(layer, head)]): Gemma 3's per-head q/k norms and Qwen's q/k biases on real weights
REAL = [("smollm2", [(0, 0), (17, 4), (29, 8)]), ("gemma3", [(0, 0), (5, 3), (17, 1)]),
        ("qwen0.5b", [(0, 0), (12, 7), (23, 13)])]


@pytest.mark.parametrize(("alias", "heads"), REAL, ids=[alias for alias, _ in REAL])
def test_real_model_pairs_sum_to_the_score_and_to_eager_log_attention(alias, heads):
    if not ALIASES[alias].installed:
        pytest.skip(f"{alias} not installed")
    loaded = attnscope.load_model(alias)
    ids = loaded.tokenizer("The cat sat on the mat. The cat", add_special_tokens=False)["input_ids"]
    log_a = eager_log_attention(loaded, ids)
    query = len(ids) - 1
    for layer, head in heads:
        first, second = (qk_attribution(loaded, ids, layer, head, query, key) for key in (1, query - 1))
        assert abs(first.total() - first.score) < TOLERANCE
        assert abs((first.total() - second.total()) - (log_a[layer][head, query, 1] - log_a[layer][head, query, -2])) \
            < TOLERANCE
        assert abs(first.softmax_total() - log_a[layer][head, query, 1]) < TOLERANCE
        # SmolLM2 and Gemma 3 have no q/k biases: no "bias" component; Qwen's q/k biases add a non-zero one
        has_bias = loaded.model.model.layers[layer].self_attn.q_proj.bias is not None
        assert ("bias" in shown_components(first)) == has_bias == (alias == "qwen0.5b")
        if has_bias:
            assert np.abs(first.scores[first.query_components.index("bias")]).sum() > 0


# ---- the command line ------------------------------------------------------------------------------------------
def test_cli_prints_the_top_pairs_and_the_sum_check(tiny, tmp_path, capsys):
    loaded, _, _ = tiny("llama")
    out = tmp_path / "qk.json"
    assert cli.main(["qk", "--model", str(loaded.source), TEXT, "--head", "2:5", "--query", "-1", "--key", "3",
                     "--top", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "L2H5 (0-indexed)" in printed and "table sums to" in printed and "log attention" in printed
    saved = json.loads(out.read_text())
    assert np.array(saved["scores"]).sum() == pytest.approx(saved["score"], abs=TOLERANCE)
    assert len(saved["query_components"]) == len(saved["scores"])


@pytest.mark.parametrize(("arguments", "message"), [
    (["--head", "3", "--key", "1"], "is not LAYER:HEAD"),
    (["--head", "7:0", "--key", "1"], "layer 7 is outside"),
    (["--head", "0:6", "--key", "1"], r"head 6 is outside layer 0's 6 heads \(0..5\)"),
    (["--head", "0:0", "--key", "1", "--query", "99"], "position 99 is outside"),
    (["--head", "0:0", "--key", "5", "--query", "2"], "key 5 is after query 2"),
    (["--head", "0:0", "--key", "1", "--dtype", "bfloat16"], "needs the model in float32"),
])
def test_cli_bad_head_query_or_key_is_one_line(tiny, capsys, arguments, message):
    loaded, _, _ = tiny("llama")
    try:
        code = cli.main(["qk", "--model", str(loaded.source), TEXT, *arguments])
    except SystemExit as exit_:  # argparse's own refusals (a malformed --head) exit from the parser
        code = exit_.code
    assert code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error[-1].startswith("attnscope: error:") and re.search(message, error[-1])
    assert "Traceback" not in "\n".join(error)


@pytest.mark.parametrize("device", DEVICES)
def test_qk_attribution_makes_its_tensors_on_the_models_device(tiny_model_dir, device):
    """Every tensor attnscope's code makes during a QK attribution is on the model's device (the checker of
    tests/test_devices.py; on CUDA where there is one): only the tables come to the CPU, as numpy."""
    loaded = attnscope.load_model(str(tiny_model_dir("llama")), device=device)
    ids = loaded.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    with watched(loaded.input_device) as mode:
        qk = qk_attribution(loaded, ids, 2, 3, -1, 4)
    assert mode.checked > 0 and abs(qk.total() - qk.score) < TOLERANCE


@pytest.mark.parametrize(("kind", "message"), [("gpt2", "q_proj/k_proj projections"),
                                               ("bert", "not a decoder-only language model")])
def test_a_model_of_another_form_is_one_line(tiny_model_dir, capsys, kind, message):
    """GPT-2 (one fused projection, learned positions) and BERT (an encoder) are refused before any forward pass."""
    folder = str(tiny_model_dir(kind))
    capsys.readouterr()  # building the folder writes progress bars
    assert cli.main(["qk", "--model", folder, TEXT, "--head", "0:0", "--key", "1"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("attnscope: error:") and message in error[0]
