"""Attribution patching (AtP, AtP*) against independent references: a head's estimate is the derivative a finite
difference of a hand-written patch measures; where everything downstream of a head is linear (one attention-only
layer, no final norm, the logit metric) AtP* equals real patching of its output, queries and keys, where AtP is
exact for outputs only; with saturated attention AtP misses what AtP* gets; GradDrop equals the sum of the
estimates with each layer's contribution cut from the backward pass by hand; ``patch --method atp*`` refuses bad
input in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

import attnscope
from attnscope import AttnscopeError
from attnscope.capture.attention import Intervention, capture, intervene
from attnscope.capture.hooks import local_hooks
from attnscope.capture.recorders import HeadOutputs
from attnscope.experiments.atp import attribution_patching, verify_estimates
from attnscope.experiments.patching import PromptPair, activation_patching

from .test_cli_errors import assert_one_error_line, exit_code, must_not_run

CLEAN, CORRUPT = "the cat sat on the mat.", "the dog sat on the mat."
PAIR = PromptPair(CLEAN, CORRUPT, "mat", "cat")
# the last token differs, so that the last query does: the one-layer model's metric reads only the last row
LAST_CLEAN, LAST_CORRUPT = "the cat sat on the mat", "the cat sat on the rug"
LOGIT_PAIR = PromptPair(LAST_CLEAN, LAST_CORRUPT, "mat")


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return attnscope.load_model(str(tiny_model_dir("llama")))


def token(loaded, text: str | int) -> int:
    return text if isinstance(text, int) else loaded.tokenizer(text, add_special_tokens=False)["input_ids"][0]


def metric_of(loaded, text: str, target: str | int, other: str | int | None = None) -> float:
    ids = loaded.tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        logits = loaded.model(**ids, use_cache=False).logits[0, -1].float()
    value = logits[token(loaded, target)]
    if other is not None:
        value = value - logits[token(loaded, other)]
    return float(value)


def head_outputs(loaded, text: str) -> dict[int, torch.Tensor]:
    recorder = HeadOutputs()
    with torch.no_grad(), capture(loaded.sites, recorder=recorder):
        loaded.model(**loaded.tokenizer(text, return_tensors="pt"), use_cache=False)
    return recorder.of_kind("self")


class MixHead(Intervention):
    """By hand: head ``head`` of ``layer`` outputs ``corrupt + t (clean - corrupt)`` at every position."""

    def __init__(self, layer: int, head: int, clean: torch.Tensor, corrupt: torch.Tensor, t: float) -> None:
        self.layer, self.head, self.clean, self.corrupt, self.t = layer, head, clean, corrupt, t

    def applies_to(self, site) -> bool:
        return site.layer == self.layer

    def modify_output(self, site, output):
        output = output.clone()
        h = self.head
        output[:, :, h] = self.corrupt[:, :, h] + self.t * (self.clean[:, :, h] - self.corrupt[:, :, h])
        return output


# ---- AtP is the derivative --------------------------------------------------------------------------------
def test_atp_per_head_equals_a_finite_difference_of_a_hand_written_patch(tiny_llama):
    result = attribution_patching(tiny_llama, PAIR, method="atp", n_resamples=0)
    clean, corrupt = head_outputs(tiny_llama, CLEAN), head_outputs(tiny_llama, CORRUPT)
    eps = 1e-2
    for layer, head in [(0, 1), (1, 3), (2, 5)]:
        moved = []
        for t in (eps, -eps):
            with intervene(MixHead(layer, head, clean[layer], corrupt[layer], t)):
                moved.append(metric_of(tiny_llama, CORRUPT, "mat", "cat"))
        derivative = (moved[0] - moved[1]) / (2 * eps)  # central: error O(eps^2) + float32 round-off / eps
        estimate = result.heads_metric[0, layer, head] - result.corrupt[0]
        assert estimate == pytest.approx(derivative, rel=1e-3, abs=2e-4)
    assert result.corrupt[0] == pytest.approx(metric_of(tiny_llama, CORRUPT, "mat", "cat"), abs=1e-5)
    assert result.clean[0] == pytest.approx(metric_of(tiny_llama, CLEAN, "mat", "cat"), abs=1e-5)
    share = (result.heads_metric[0] - result.corrupt[0]) / (result.clean[0] - result.corrupt[0])
    np.testing.assert_allclose(result.heads[0], share, atol=1e-12)


# ---- one linear layer: AtP* is exact ------------------------------------------------------------------------
def one_linear_layer(folder, scale_queries: float = 1.0):
    """A one-layer Llama whose MLP outputs zero and whose final norm is the identity: the logits are linear in
    every head's output and in every attention pattern. Its scores and values are scaled up from the random
    initialisation's so that patches move the logit visibly; ``scale_queries`` sharpens (saturates) attention.
    Its tokenizer adds [CLS] only (no final [SEP]), so that the last token, and so the last query, can differ."""
    from tokenizers.processors import TemplateProcessing
    from transformers import LlamaConfig

    from .conftest import CLS, VOCAB, build_tiny_model

    config = LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                         intermediate_size=37, architectures=["LlamaForCausalLM"], pad_token_id=0, bos_token_id=101,
                         eos_token_id=102, vocab_size=VOCAB)
    loaded = attnscope.load_model(str(build_tiny_model("llama", folder, config)))
    body = loaded.model.model
    attention = body.layers[0].self_attn
    with torch.no_grad():
        body.layers[0].mlp.down_proj.weight.zero_()
        for projection, scale in ((attention.q_proj, 8 * scale_queries), (attention.k_proj, 8),
                                  (attention.v_proj, 20), (attention.o_proj, 20)):
            projection.weight.mul_(scale)
    body.norm = nn.Identity()
    loaded.tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="[CLS] $A", special_tokens=[("[CLS]", CLS)])
    return loaded


def patched_projection(loaded, name: str, head: int, positions: list[int] | None = None,
                       texts: tuple[str, str] = (LAST_CLEAN, LAST_CORRUPT)) -> float:
    """The logit of " mat" with head ``head``'s slice of ``q_proj`` or ``k_proj`` (before the rotary embedding,
    which depends on the position only) taken from the clean run (``texts``: clean, corrupted), at every position
    or at ``positions`` only: real patching, written by hand."""
    projection = getattr(loaded.model.model.layers[0].self_attn, name)
    d_head = loaded.model.config.head_dim
    part = slice(head * d_head, (head + 1) * d_head)
    where = slice(None) if positions is None else positions
    kept = {}

    def keep(module, inputs, output):
        kept["clean"] = output.detach()

    def replace(module, inputs, output):  # [batch, pos, head * d_head]
        output = output.clone()
        output[:, where, part] = kept["clean"][:, where, part]
        return output

    with local_hooks([projection], keep):
        metric_of(loaded, texts[0], "mat")
    with local_hooks([projection], replace):
        return metric_of(loaded, texts[1], "mat")


def real_effects(loaded) -> dict[str, np.ndarray]:
    corrupt = metric_of(loaded, LAST_CORRUPT, "mat")
    clean_outputs, corrupt_outputs = head_outputs(loaded, LAST_CLEAN), head_outputs(loaded, LAST_CORRUPT)
    out = {"heads": [], "queries": [], "keys": []}
    for head in range(4):
        with intervene(MixHead(0, head, clean_outputs[0], corrupt_outputs[0], 1.0)):
            out["heads"].append(metric_of(loaded, LAST_CORRUPT, "mat") - corrupt)
        out["queries"].append(patched_projection(loaded, "q_proj", head) - corrupt)
        out["keys"].append(patched_projection(loaded, "k_proj", head) - corrupt)
    return {name: np.array(values) for name, values in out.items()}


def estimated_effects(result) -> dict[str, np.ndarray]:
    gap = result.clean[0] - result.corrupt[0]
    return {"heads": result.heads_metric[0, 0] - result.corrupt[0], "queries": result.queries[0, 0] * gap,
            "keys": result.keys[0, 0] * gap}


def test_atp_star_equals_real_patching_where_everything_downstream_is_linear(tmp_path):
    loaded = one_linear_layer(tmp_path / "linear")
    real = real_effects(loaded)
    star, plain = (estimated_effects(attribution_patching(loaded, LOGIT_PAIR, method=method, n_resamples=0))
                   for method in ("atp*", "atp"))
    assert np.abs(real["keys"]).max() > 1e-3 and np.abs(real["queries"]).max() > 1e-3  # something to estimate
    for name in ("heads", "queries", "keys"):
        np.testing.assert_allclose(star[name], real[name], rtol=1e-4, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(plain["heads"], real["heads"], rtol=1e-4, atol=1e-6)  # a head's output: AtP exact too
    # and the head map is a patching map: real cached patching of the same heads
    cached = activation_patching(loaded, LOGIT_PAIR, n_resamples=0)
    np.testing.assert_allclose(cached.heads_metric[0, 0] - cached.corrupt[0], real["heads"], rtol=1e-4, atol=1e-6)


def test_with_saturated_attention_atp_misses_what_atp_star_gets(tmp_path):
    loaded = one_linear_layer(tmp_path / "saturated", scale_queries=20.0)
    with torch.no_grad(), capture(loaded.sites) as session:
        loaded.model(**loaded.tokenizer(LAST_CORRUPT, return_tensors="pt"), use_cache=False)
    rows = session.layers("self")[0].attention[0, :, 1:]  # [head, query, key] past the first query
    assert rows.max(-1).values.mean() > 0.9  # saturated: most rows put nearly all their weight on one key
    real = real_effects(loaded)
    star, plain = (estimated_effects(attribution_patching(loaded, LOGIT_PAIR, method=method, n_resamples=0))
                   for method in ("atp*", "atp"))
    for name in ("queries", "keys"):
        np.testing.assert_allclose(star[name], real[name], rtol=1e-4, atol=1e-6, err_msg=name)
    # a query patch that moves a saturated row: the softmax's gradient is nearly flat there, so AtP misses most of
    # the largest effect (it reads the patch as small), where AtP* recomputes the row and is exact
    assert np.abs(real["queries"]).max() > 0.1
    assert np.abs(plain["queries"] - real["queries"]).max() > 0.5 * np.abs(real["queries"]).max(), plain["queries"]


# ---- GradDrop ---------------------------------------------------------------------------------------------
class Leaf(Intervention):
    """Head outputs of ``layer`` become a leaf that requires grad (kept in ``leaf``), so its gradient can be read."""

    def __init__(self, layer: int) -> None:
        self.layer, self.leaf = layer, None

    def applies_to(self, site) -> bool:
        return site.layer == self.layer

    def modify_output(self, site, output):
        self.leaf = output.detach().requires_grad_(True)
        return self.leaf


def gradient_with_layer_cut(loaded, layer: int, cut: int | None) -> torch.Tensor:
    """dM/d(head outputs of ``layer``) on the corrupted run with layer ``cut``'s attention and MLP outputs detached
    (no gradient through them), by hand."""
    body = loaded.model.model
    modules = [] if cut is None else [body.layers[cut].self_attn, body.layers[cut].mlp]

    def detach(module, inputs, output):
        return (output[0].detach(), *output[1:]) if isinstance(output, tuple) else output.detach()

    leaf = Leaf(layer)
    ids = loaded.tokenizer(CORRUPT, return_tensors="pt")
    mat, cat = (loaded.tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in ("mat", "cat"))
    with torch.enable_grad(), intervene(leaf), local_hooks(modules, detach):
        logits = loaded.model(**ids, use_cache=False).logits[0, -1].float()
        (grad,) = torch.autograd.grad(logits[mat] - logits[cat], leaf.leaf, allow_unused=True)
    return torch.zeros_like(leaf.leaf) if grad is None else grad  # cut == layer: the leaf reaches nothing


def test_graddrop_is_the_mean_magnitude_of_the_estimates_with_each_layer_cut(tiny_llama):
    star = attribution_patching(tiny_llama, PAIR, method="atp*", qk_fix=False, n_resamples=0)
    plain = attribution_patching(tiny_llama, PAIR, method="atp", n_resamples=0)
    clean, corrupt = head_outputs(tiny_llama, CLEAN), head_outputs(tiny_llama, CORRUPT)
    n_layers = 3
    for layer in (0, 1):
        delta = clean[layer] - corrupt[layer]  # [1, pos, head, d_head]
        per_cut = torch.stack([(delta * gradient_with_layer_cut(tiny_llama, layer, cut)).sum(dim=(0, 1, 3))
                               for cut in range(n_layers)]).double().numpy()  # [cut, head]
        expected = np.abs(per_cut).sum(0) / (n_layers - 1) * np.where(per_cut.sum(0) < 0, -1, 1)
        np.testing.assert_allclose(star.heads_metric[0, layer] - star.corrupt[0], expected, rtol=1e-4, atol=1e-5)
    # the last layer has no later layer to cut: GradDrop leaves its estimates as AtP's
    np.testing.assert_allclose(star.heads_metric[0, 2], plain.heads_metric[0, 2], rtol=1e-5, atol=1e-6)


def test_mlps_and_json(tiny_llama):
    result = attribution_patching(tiny_llama, [PAIR, PromptPair("the man saw the dog.", "the man saw the cat.",
                                                                "dog", "cat")], mlps=True, n_resamples=50)
    assert result.method == "atp*" and result.mlps.shape == (2, 3) and result.keys.shape == (2, 3, 6)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["estimate"] == {"qk_fix": True, "grad_drop": True, "what": data["estimate"]["what"]}
    assert len(data["keys"]["mean"]) == 3 and data["n_pairs"] == 2


def test_verify_patches_the_top_estimates_and_random_heads_for_real(tiny_llama):
    result = attribution_patching(tiny_llama, PAIR, n_resamples=0)
    check = verify_estimates(tiny_llama, [PAIR], result, 3)
    real = activation_patching(tiny_llama, PAIR, n_resamples=0)
    assert [c[2] for c in check.cells] == ["top"] * 3 + ["random"] * 3
    for (layer, head, _), value in zip(check.cells, check.real):
        assert value == pytest.approx(real.heads[0, layer, head], abs=1e-5)
    assert -1.0 <= check.spearman <= 1.0


# ---- other families ------------------------------------------------------------------------------------------
def tiny(kind: str, tmp_path_factory):
    from transformers import Qwen2Config

    from .conftest import VOCAB, build_tiny_model
    from .test_attribution import _config

    config = _config(kind) if kind != "qwen2" else Qwen2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=37,
        architectures=["Qwen2ForCausalLM"], pad_token_id=0, bos_token_id=101, eos_token_id=102, vocab_size=VOCAB)
    return attnscope.load_model(str(build_tiny_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}-atp"), config)))


@pytest.mark.parametrize("kind", ["gemma3", "qwen2"])
def test_gemma3_and_qwen2_estimate_with_their_windows_and_grouped_heads(kind, tmp_path_factory):
    loaded = tiny(kind, tmp_path_factory)
    ids = loaded.tokenizer(CLEAN, add_special_tokens=False)["input_ids"]
    pair = PromptPair(CLEAN, CORRUPT, ids[-1], ids[0])  # whatever this tokenizer cuts the words into
    result = attribution_patching(loaded, pair, mlps=True, n_resamples=0)
    assert np.isfinite(result.heads).all() and np.isfinite(result.keys).all() and np.isfinite(result.mlps).all()
    plain = attribution_patching(loaded, pair, method="atp", n_resamples=0)
    assert plain.corrupt[0] == pytest.approx(metric_of(loaded, CORRUPT, ids[-1], ids[0]), abs=1e-5)
    clean, corrupt = head_outputs(loaded, CLEAN), head_outputs(loaded, CORRUPT)
    eps = 1e-2
    moved = []
    for t in (eps, -eps):
        with intervene(MixHead(0, 1, clean[0], corrupt[0], t)):
            moved.append(metric_of(loaded, CORRUPT, ids[-1], ids[0]))
    assert plain.heads_metric[0, 0, 1] - plain.corrupt[0] == pytest.approx((moved[0] - moved[1]) / (2 * eps),
                                                                            rel=1e-3, abs=2e-4)


def test_softcapped_attention_is_refused_in_one_line(tmp_path_factory):
    loaded = tiny("gemma2", tmp_path_factory)
    with pytest.raises(AttnscopeError, match="softcaps its attention scores"):
        attribution_patching(loaded, PAIR, n_resamples=0)


# ---- the command -------------------------------------------------------------------------------------------
def test_patch_atp_star_writes_the_map_json_and_the_verification(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "atp"
    code = exit_code(["patch", "-m", str(tiny_model_dir("llama")), "--clean", CLEAN, "--corrupt", CORRUPT,
                      "--target", "mat", "--other", "cat", "--method", "atp*", "--verify", "2", "--bootstrap", "0",
                      "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    assert (out / "patching_heads.png").stat().st_size > 1000 and (out / "patching_keys.png").exists()
    data = json.loads((out / "patching.json").read_text())
    assert data["method"] == "atp*" and len(data["verify"]["heads"]) == 4
    printed = capsys.readouterr().out
    assert "Spearman(estimate, real)" in printed and "estimated recovering most" in printed
    assert data["estimate"]["qk_fix"] and data["estimate"]["grad_drop"]
    assert exit_code(["patch", "-m", str(tiny_model_dir("llama")), "--clean", CLEAN, "--corrupt", CORRUPT, "--target",
                      "mat", "--method", "atp*", "--no-qk-fix", "--no-graddrop", "--bootstrap", "0", "-o",
                      str(out), "--overwrite"]) == 0
    fixes = json.loads((out / "patching.json").read_text())["estimate"]
    assert not fixes["qk_fix"] and not fixes["grad_drop"]


ATP_CASES = {
    "K = 0": (["--method", "atp*", "--verify", "0"], "expected a positive integer"),
    "K above the heads": (["--method", "atp*", "--verify", "19"], "choose K from 1 to 18"),
    "--verify without atp": (["--method", "cached", "--verify", "2"], "go with --method atp"),
}


@pytest.mark.parametrize("name", list(ATP_CASES))
def test_bad_atp_input_is_one_line_before_any_pass(name, tiny_model_dir, tmp_path, capsys, monkeypatch):
    extra, expect = ATP_CASES[name]
    must_not_run(monkeypatch, "attnscope.experiments.atp.attribution_patching")
    must_not_run(monkeypatch, "attnscope.experiments.patching.activation_patching")
    argv = ["patch", "-m", str(tiny_model_dir("llama")), "--clean", CLEAN, "--corrupt", CORRUPT, "--target", "mat",
            *extra, "-o", str(tmp_path / "out")]
    assert_one_error_line(exit_code(argv), capsys.readouterr().err, expect)


def test_brown_patch_pairs_have_one_token_length_and_two_next_words(tiny_llama):
    from attnscope.experiments.tasks import brown_patch_pairs

    pairs = brown_patch_pairs(tiny_llama, 3)
    for pair in pairs:
        clean, corrupt = (tiny_llama.tokenizer(text)["input_ids"] for text in (pair.clean, pair.corrupt))
        assert len(clean) == len(corrupt) and pair.clean != pair.corrupt and pair.target != pair.other


@pytest.mark.parametrize(("given", "method"), [("atp-star", "atp*"), ("atp*", "atp*"), ("atp", "atp")])
def test_the_patch_command_takes_atp_star_without_a_glob(given, method):
    # a bare atp* in a shell expands to matching file names (an earlier `-o atp/` turns it into atp): atp-star is the
    # same method without the star
    from attnscope.cli.main import build_parser

    args = build_parser().parse_args(["patch", "--clean", "a b", "--corrupt", "a c", "--target", " d", "--method", given])
    assert args.method == method
