"""Activation patching: a cached, batched patched run equals a re-run with the head's output replaced
by hand, the three methods agree, the shares are normalised (0 = corrupted, 1 = clean), pairs give
bootstrap intervals, and ``attnscope patch`` writes its map and JSON or refuses bad input in one line
before any forward pass."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import attnscope
from attnscope import AttnscopeError
from attnscope.capture.attention import Intervention, capture, intervene
from attnscope.capture.recorders import HeadOutputs
from attnscope.experiments.patching import PromptPair, activation_patching, mean_interval

from .test_cli_errors import assert_one_error_line, exit_code, must_not_run

CLEAN, CORRUPT = "the cat sat on the mat.", "the dog sat on the mat."
PAIR = PromptPair(CLEAN, CORRUPT, "mat", "cat")


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return attnscope.load_model(str(tiny_model_dir("llama")))


def last_logits(loaded, text: str) -> torch.Tensor:
    with torch.inference_mode():
        return loaded.model(**loaded.tokenizer(text, return_tensors="pt"), use_cache=False).logits[0, -1].float()


class ReplaceHead(Intervention):
    """By hand: head ``head`` of ``layer`` outputs ``clean`` (``[1, q_pos, head, d_head]``) at every position."""

    def __init__(self, layer: int, head: int, clean: torch.Tensor) -> None:
        self.layer, self.head, self.clean = layer, head, clean

    def applies_to(self, site) -> bool:
        return site.layer == self.layer

    def modify_output(self, site, output):
        output = output.clone()
        output[:, :, self.head] = self.clean[:, :, self.head]
        return output


def test_a_patched_head_equals_a_rerun_with_its_output_replaced_by_hand(tiny_llama):
    result = activation_patching(tiny_llama, PAIR, n_resamples=0)
    assert result.method == "cached" and result.metric == "logit_diff"
    recorder = HeadOutputs()
    with torch.inference_mode(), capture(tiny_llama.sites, recorder=recorder):
        last_logits(tiny_llama, CLEAN)
    target, other = (tiny_llama.tokenizer(t, add_special_tokens=False)["input_ids"][0] for t in ("mat", "cat"))
    for layer, head in [(0, 0), (1, 4), (2, 5)]:
        with intervene(ReplaceHead(layer, head, recorder.of_kind("self")[layer])):
            logits = last_logits(tiny_llama, CORRUPT)
        expected = float(logits[target] - logits[other])
        assert result.heads_metric[0, layer, head] == pytest.approx(expected, abs=1e-5)
    clean, corrupt = last_logits(tiny_llama, CLEAN), last_logits(tiny_llama, CORRUPT)
    assert result.clean[0] == pytest.approx(float(clean[target] - clean[other]), abs=1e-5)
    assert result.corrupt[0] == pytest.approx(float(corrupt[target] - corrupt[other]), abs=1e-5)
    share = (result.heads_metric[0] - result.corrupt[0]) / (result.clean[0] - result.corrupt[0])
    np.testing.assert_allclose(result.heads[0], share, atol=1e-12)


def test_cached_batched_and_naive_agree(tiny_llama):
    runs = {method: activation_patching(tiny_llama, PAIR, method=method, mlps=True, residual=method != "naive",
                                        n_resamples=0) for method in ("cached", "batched", "naive")}
    for method in ("batched", "naive"):
        np.testing.assert_allclose(runs[method].heads_metric, runs["cached"].heads_metric, atol=1e-5)
        np.testing.assert_allclose(runs[method].mlps, runs["cached"].mlps, atol=1e-5)
    np.testing.assert_allclose(runs["batched"].residual, runs["cached"].residual, atol=1e-5)


def test_the_residual_after_the_last_layer_at_the_last_position_recovers_everything(tiny_llama):
    result = activation_patching(tiny_llama, PAIR, residual=True, n_resamples=0)
    assert result.residual[0, -1, -1] == pytest.approx(1.0, abs=1e-5)
    n_differing = 2  # "cat" -> "dog" at position 2 ([CLS] the cat): earlier positions are equal in both runs
    np.testing.assert_allclose(result.residual[0, :, :n_differing], 0.0, atol=1e-5)


def test_pairs_give_means_and_bootstrap_intervals(tiny_llama):
    pairs = [PAIR, PromptPair("the man saw the dog.", "the man saw the cat.", "dog", "cat"),
             PromptPair("a red car.", "a blue car.", "car")]
    result = activation_patching(tiny_llama, pairs, metric="logit", n_resamples=200, mlps=True)
    assert result.heads.shape == (3, 3, 6) and result.mlps.shape == (3, 3)
    mean, low, high = result.intervals["heads"]
    np.testing.assert_allclose(mean, result.heads.mean(0), atol=1e-12)
    assert np.all(low <= mean + 1e-12) and np.all(mean <= high + 1e-12)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["n_pairs"] == 3 and len(data["heads"]["mean"]) == 3


def test_mean_interval_of_one_pair_has_no_bounds():
    mean, low, high = mean_interval(np.ones((1, 2, 3)))
    assert mean.shape == (2, 3) and np.isnan(low).all() and np.isnan(high).all()


def test_bad_pairs_are_refused(tiny_llama, minilm):
    with pytest.raises(AttnscopeError, match="same token length"):
        activation_patching(tiny_llama, PromptPair(CLEAN, "the big dog sat on the mat.", "mat"))
    with pytest.raises(AttnscopeError, match="tokens for"):
        activation_patching(tiny_llama, PromptPair(CLEAN, CORRUPT, "strawberries and cream"))
    with pytest.raises(AttnscopeError, match="pair 2: the prompt is empty"):
        activation_patching(tiny_llama, [PAIR, PromptPair(" ", " ", "mat")])
    with pytest.raises(AttnscopeError, match="not a decoder-only"):
        activation_patching(minilm, PAIR)


# ---- the command -------------------------------------------------------------------------------------------
def test_the_patch_command_writes_the_map_and_the_json(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "patching"
    code = exit_code(["patch", "-m", str(tiny_model_dir("llama")), "--clean", CLEAN, "--corrupt", CORRUPT,
                      "--target", "mat", "--other", "cat", "--mlps", "--bootstrap", "0", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    assert (out / "patching_heads.png").stat().st_size > 1000 and (out / "patching_mlps.png").exists()
    data = json.loads((out / "patching.json").read_text())
    assert data["metric"] == "logit_diff" and len(data["heads"]["mean"]) == 3
    assert "layer" in capsys.readouterr().out


def documented_patching_json() -> dict[str, set[str] | None]:
    """docs/attribution.md's table of patching.json: each key, with the keys its ``{...}`` holds (None: a value)."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "attribution.md").read_text(encoding="utf-8")
    section = page.split("### `patching.json`", 1)[1].split("\n#", 1)[0]
    documented: dict[str, set[str] | None] = {}
    for row in (line for line in section.splitlines() if line.startswith("| `")):
        names, _, holds = row.strip("|").split("|")[:3]
        inner = re.search(r"`\{([^}]*)\}`", holds)
        for name in re.findall(r"`(\w+)`", names):
            documented[name] = set(inner[1].split(", ")) if inner else None
    return documented


def test_patching_json_has_the_keys_its_page_documents(tiny_model_dir):
    """Real patching and AtP* with every part write exactly the keys the docs' table lists, nested ones too (the
    command writes these objects, with ``verify`` added; its figures are left out here, they cost the time)."""
    from attnscope.experiments.atp import attribution_patching, verify_estimates

    loaded = attnscope.load_model(str(tiny_model_dir("llama")))
    pair = PromptPair(CLEAN, CORRUPT, "mat", "cat")
    real = activation_patching(loaded, pair, mlps=True, residual=True, n_resamples=0)
    estimated = attribution_patching(loaded, pair, method="atp*", mlps=True, residual=True, positions=True,
                                     n_resamples=0)
    written = {**real.to_dict(), **estimated.to_dict(), "verify": verify_estimates(loaded, [pair], estimated, 1).to_dict()}
    documented = documented_patching_json()
    assert set(written) == set(documented)
    for key, inner in documented.items():
        value = written[key]
        first = value[0] if isinstance(value, list) else value  # pairs: a list of {...}
        assert (set(first) if isinstance(first, dict) else None) == inner, key
    assert set(written["verify"]["heads"][0]) == {"layer", "head", "chosen", "estimate", "real"}


def test_the_patch_command_reads_pairs_from_a_file(tiny_model_dir, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"clean": CLEAN, "corrupt": CORRUPT, "target": "mat", "other": "cat"}) + "\n"
                     + json.dumps({"clean": "the man saw the dog.", "corrupt": "the man saw the cat.",
                                   "target": "dog", "other": "cat"}) + "\n")
    out = tmp_path / "out"
    assert exit_code(["patch", "-m", str(tiny_model_dir("llama")), "--file", str(pairs), "--bootstrap", "50",
                      "-o", str(out)]) == 0
    assert json.loads((out / "patching.json").read_text())["n_pairs"] == 2


PATCH_CASES = {
    "a target of several tokens": (["--target", "strawberries and cream"], "tokens for"),
    "prompts of different lengths": (["--corrupt", "the big dog sat on the mat.", "--target", "mat"],
                                     "same token length"),
    "an encoder model": (["--model", "{bert}", "--target", "mat"], "not a decoder-only"),
    "an empty prompt": (["--clean", " ", "--target", "mat"], "the clean prompt is empty"),
    "no target": ([], "missing --target"),
    "logit_diff without --other": (["--target", "mat", "--metric", "logit_diff"], "needs the other token"),
    "a pairs file and typed prompts": (["--file", "{pairs}", "--target", "mat"], "either --file"),
    "a pairs file line without a target": (["--file", "{bad_pairs}", "--clean", None], "line 1: expected an object"),
}


@pytest.mark.parametrize("name", list(PATCH_CASES))
def test_bad_patch_input_is_one_line_before_any_forward_pass(name, tiny_model_dir, tmp_path, capsys, monkeypatch):
    extra, expect = PATCH_CASES[name]

    must_not_run(monkeypatch, "attnscope.experiments.patching.activation_patching")
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"clean": CLEAN, "corrupt": CORRUPT, "target": "mat"}) + "\n")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"clean": CLEAN, "corrupt": CORRUPT}) + "\n")
    folders = {"bert": str(tiny_model_dir("bert")), "pairs": str(tmp_path / "pairs.jsonl"),
               "bad_pairs": str(tmp_path / "bad.jsonl")}
    args = {"--model": str(tiny_model_dir("llama")), "--clean": CLEAN, "--corrupt": CORRUPT}
    given = dict(zip(extra[::2], extra[1::2]))
    if "--file" in given:
        args = {"--model": args["--model"]}
    args.update({key: value.format(**folders) for key, value in given.items() if value is not None})
    args = {key: value for key, value in args.items() if given.get(key, "") is not None}
    argv = ["patch", *[item for pair in args.items() for item in pair], "-o", str(tmp_path / "out")]
    assert_one_error_line(exit_code(argv), capsys.readouterr().err, expect)


def test_gemma3_patches_whole_batched_passes_equal_to_the_naive_loop(tmp_path_factory):
    """Gemma 3's adapter does not allow running from a middle layer: whole forward passes, batched."""
    from .conftest import build_tiny_model
    from .test_attribution import _config

    folder = build_tiny_model("gemma3", tmp_path_factory.mktemp("tiny-gemma3-patch"), _config("gemma3"))
    loaded = attnscope.load_model(str(folder))
    batched = activation_patching(loaded, PAIR, mlps=True, residual=True, n_resamples=0)
    naive = activation_patching(loaded, PAIR, method="naive", mlps=True, n_resamples=0)
    assert batched.method == "batched"
    np.testing.assert_allclose(batched.heads_metric, naive.heads_metric, atol=1e-5)
    np.testing.assert_allclose(batched.mlps, naive.mlps, atol=1e-5)
    assert batched.residual[0, -1, -1] == pytest.approx(1.0, abs=1e-5)
    with pytest.raises(AttnscopeError, match="cannot start from a middle layer"):
        activation_patching(loaded, PAIR, method="cached")
