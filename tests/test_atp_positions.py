"""Attribution patching per position and on the residual stream, against independent references: per-position
estimates add up to the per-node ones where patching every position is the sum of patching each; a head's output at
one position and the residual after a layer at one position are the derivatives a finite difference of a
hand-written patch measures; GradDrop per position equals the hand-cut backward passes; where everything downstream
is linear (one attention-only layer, logit metric) AtP* equals real single-position patching of a head's output,
query and key (the single-key closed form also against a softmax written out by hand) and real residual patching;
``patch --positions/--residual`` with atp writes the maps and refuses bad input in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import attnscope
from attnscope.capture.attention import Intervention, intervene
from attnscope.capture.hooks import local_hooks
from attnscope.experiments.atp import attribution_patching, single_key_estimates
from attnscope.experiments.patching import PromptPair, activation_patching

from .test_atp import (
    CLEAN,
    CORRUPT,
    PAIR,
    gradient_with_layer_cut,
    head_outputs,
    metric_of,
    one_linear_layer,
    patched_projection,
    tiny,
)
from .test_cli_errors import assert_one_error_line, exit_code, must_not_run

# two tokens differ (positions 2 and 6 after [CLS]), so that single-key patches do not add up to the whole-key one
TWO_CLEAN, TWO_CORRUPT = "the cat sat on the mat", "the dog sat on the rug"
TWO = PromptPair(TWO_CLEAN, TWO_CORRUPT, "mat")
PARTS = ("heads", "queries", "keys")


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return attnscope.load_model(str(tiny_model_dir("llama")))


def gap(result) -> float:
    return float(result.clean[0] - result.corrupt[0])


class MixHeadAt(Intervention):
    """By hand: head ``head`` of ``layer`` outputs ``corrupt + t (clean - corrupt)`` at ``position`` only."""

    def __init__(self, layer: int, head: int, position: int, clean: torch.Tensor, corrupt: torch.Tensor,
                 t: float) -> None:
        self.layer, self.head, self.position, self.clean, self.corrupt, self.t = layer, head, position, clean, corrupt, t

    def applies_to(self, site) -> bool:
        return site.layer == self.layer

    def modify_output(self, site, output):  # [batch, pos, head, d_head]
        output = output.clone()
        h, p = self.head, self.position
        output[:, p, h] = self.corrupt[:, p, h] + self.t * (self.clean[:, p, h] - self.corrupt[:, p, h])
        return output


def block_outputs(loaded, text: str) -> dict[int, torch.Tensor]:
    """Each block's output ``[1, pos, d_model]`` (the residual stream after the layer), by hand."""
    blocks, kept = loaded.model.model.layers, {}

    def keep(module, inputs, output):
        kept[list(blocks).index(module)] = (output[0] if isinstance(output, tuple) else output).detach()

    with local_hooks(list(blocks), keep):
        metric_of(loaded, text, "mat")
    return kept


def mixed_block_metric(loaded, layer: int, position: int, clean: dict, corrupt: dict, t: float) -> float:
    """PAIR's corrupted metric with block ``layer``'s output at ``position`` moved ``t`` of the way to the clean
    one, by hand."""
    def mix(module, inputs, output):
        tensor = (output[0] if isinstance(output, tuple) else output).clone()
        tensor[:, position] = corrupt[layer][:, position] + t * (clean[layer][:, position] - corrupt[layer][:, position])
        return (tensor, *output[1:]) if isinstance(output, tuple) else tensor

    with local_hooks([loaded.model.model.layers[layer]], mix):
        return metric_of(loaded, CORRUPT, "mat", "cat")


# ---- the pieces add up -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["atp", "atp*"])
def test_per_position_estimates_sum_to_the_per_node_estimates(method, tiny_llama):
    result = attribution_patching(tiny_llama, PAIR, method=method, grad_drop=False, mlps=True, positions=True,
                                  n_resamples=0)
    n_tokens = len(result.tokens[0])
    assert result.heads_by_position.shape == (1, 3, n_tokens, 6) and result.mlps_by_position.shape == (1, 3, n_tokens)
    summed = ("heads", "queries", "mlps") + (("keys",) if method == "atp" else ())  # single keys renormalise rows
    for name in summed:
        np.testing.assert_allclose(getattr(result, f"{name}_by_position")[0].sum(1), getattr(result, name)[0],
                                   rtol=1e-9, atol=1e-12, err_msg=name)
    assert np.abs(result.heads_by_position).max() > 1e-3  # something to add up


def test_graddrop_per_position_is_the_mean_magnitude_of_each_position_with_each_layer_cut(tiny_llama):
    star = attribution_patching(tiny_llama, PAIR, method="atp*", positions=True, n_resamples=0)
    clean, corrupt = head_outputs(tiny_llama, CLEAN), head_outputs(tiny_llama, CORRUPT)
    delta = clean[0] - corrupt[0]  # [1, pos, head, d_head]
    per_cut = torch.stack([(delta * gradient_with_layer_cut(tiny_llama, 0, cut)).sum(dim=(0, 3))
                           for cut in range(3)]).double().numpy()  # [cut, pos, head]
    expected = np.abs(per_cut).sum(0) / 2 * np.where(per_cut.sum(0) < 0, -1, 1)
    np.testing.assert_allclose(star.heads_by_position[0, 0] * gap(star), expected, rtol=1e-4, atol=1e-5)
    # magnitudes do not add up: over positions they bound the per-head magnitude from above (triangle inequality)
    assert (np.abs(star.heads_by_position[0]).sum(1) >= np.abs(star.heads[0]) - 1e-9).all()


# ---- derivatives ---------------------------------------------------------------------------------------------
def test_a_head_at_one_position_is_the_finite_difference_of_a_hand_written_patch(tiny_llama):
    result = attribution_patching(tiny_llama, PAIR, method="atp", positions=True, n_resamples=0)
    clean, corrupt = head_outputs(tiny_llama, CLEAN), head_outputs(tiny_llama, CORRUPT)
    eps = 1e-2
    for layer, head, position in [(0, 1, 2), (1, 3, 5), (2, 5, len(result.tokens[0]) - 1)]:
        moved = []
        for t in (eps, -eps):
            with intervene(MixHeadAt(layer, head, position, clean[layer], corrupt[layer], t)):
                moved.append(metric_of(tiny_llama, CORRUPT, "mat", "cat"))
        derivative = (moved[0] - moved[1]) / (2 * eps)
        estimate = result.heads_by_position[0, layer, position, head] * gap(result)
        assert estimate == pytest.approx(derivative, rel=1e-3, abs=2e-4), (layer, head, position)


def test_the_residual_at_one_position_is_the_finite_difference_of_a_hand_written_patch(tiny_llama):
    result = attribution_patching(tiny_llama, PAIR, method="atp", residual=True, n_resamples=0)
    clean, corrupt = block_outputs(tiny_llama, CLEAN), block_outputs(tiny_llama, CORRUPT)
    eps = 1e-2
    for layer, position in [(0, 2), (1, 2), (1, 4)]:
        moved = [mixed_block_metric(tiny_llama, layer, position, clean, corrupt, t) for t in (eps, -eps)]
        derivative = (moved[0] - moved[1]) / (2 * eps)
        estimate = result.residual[0, layer, position] * gap(result)
        assert estimate == pytest.approx(derivative, rel=1e-3, abs=2e-4), (layer, position)
    star = attribution_patching(tiny_llama, PAIR, method="atp*", residual=True, n_resamples=0)
    np.testing.assert_allclose(star.residual, result.residual, rtol=1e-5, atol=1e-7)  # the undropped copy's


# ---- one linear layer: exact ---------------------------------------------------------------------------------
def patched_projection_at(loaded, name: str, head: int, positions: list[int] | None) -> float:
    """TWO's metric with head ``head``'s query or key projection patched at ``positions`` (None: every one)."""
    return patched_projection(loaded, name, head, positions, (TWO_CLEAN, TWO_CORRUPT))


def test_atp_star_equals_real_single_position_patching_where_everything_downstream_is_linear(tmp_path):
    loaded = one_linear_layer(tmp_path / "linear")
    result = attribution_patching(loaded, TWO, method="atp*", positions=True, residual=True, n_resamples=0)
    corrupt = metric_of(loaded, TWO_CORRUPT, "mat")
    assert result.corrupt[0] == pytest.approx(corrupt, abs=1e-5)
    clean_outputs, corrupt_outputs = head_outputs(loaded, TWO_CLEAN), head_outputs(loaded, TWO_CORRUPT)
    n_tokens = len(result.tokens[0])
    real = {name: np.zeros((n_tokens, 4)) for name in PARTS}
    for position in range(n_tokens):
        for head in range(4):
            with intervene(MixHeadAt(0, head, position, clean_outputs[0], corrupt_outputs[0], 1.0)):
                real["heads"][position, head] = metric_of(loaded, TWO_CORRUPT, "mat") - corrupt
            real["queries"][position, head] = patched_projection_at(loaded, "q_proj", head, [position]) - corrupt
            real["keys"][position, head] = patched_projection_at(loaded, "k_proj", head, [position]) - corrupt
    for name in PARTS:
        estimate = getattr(result, f"{name}_by_position")[0, 0] * gap(result)
        np.testing.assert_allclose(estimate, real[name], rtol=1e-4, atol=1e-5, err_msg=name)
    # two keys moved: each single-key patch renormalises the rows, so they do not add up to the whole-key patch
    assert (np.abs(real["keys"]) > 1e-3).sum(0).max() >= 2
    whole = np.array([patched_projection_at(loaded, "k_proj", head, None) - corrupt
                      for head in range(4)])
    assert np.abs(real["keys"].sum(0) - whole).max() > 1e-2 * np.abs(whole).max()  # far above round-off
    np.testing.assert_allclose(result.keys[0, 0] * gap(result), whole, rtol=1e-4, atol=1e-5)
    # the residual after the (only, last) layer: real patching of one position at a time
    patched = activation_patching(loaded, TWO, residual=True, n_resamples=0)
    np.testing.assert_allclose(result.residual, patched.residual, rtol=1e-4, atol=1e-5)  # batched runs: round-off
    assert result.residual[0, 0, -1] == pytest.approx(1.0, abs=1e-4)  # the whole last state: all of the gap


def test_the_single_key_closed_form_equals_a_softmax_written_out():
    generator = torch.Generator().manual_seed(0)
    heads, n = 3, 7
    sharpness = torch.tensor([1.0, 10.0, 80.0], dtype=torch.float64)[:, None, None]  # the last head saturates
    scores = torch.randn(heads, n, n, generator=generator, dtype=torch.float64) * sharpness
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    change = (torch.randn(heads, n, n, generator=generator, dtype=torch.float64) * 30).masked_fill(~causal, 0.0)
    grad = torch.randn(heads, n, n, generator=generator, dtype=torch.float64)
    probs = torch.softmax(scores, -1)
    assert (1 - probs.max(-1).values[2, 1:]).min() < 1e-16  # past float64's precision near 1
    expected = torch.zeros(heads, n, dtype=torch.float64)
    for key in range(n):
        moved = scores.clone()
        moved[:, :, key] = moved[:, :, key] + change[:, :, key]  # only column `key`
        expected[:, key] = (grad * (torch.softmax(moved, -1) - probs)).sum(dim=(1, 2))
    got = single_key_estimates(scores, change, grad)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", ["gemma3", "qwen2"])
def test_per_position_with_windows_and_grouped_heads(kind, tmp_path_factory):
    loaded = tiny(kind, tmp_path_factory)
    ids = loaded.tokenizer(CLEAN, add_special_tokens=False)["input_ids"]
    result = attribution_patching(loaded, PromptPair(CLEAN, CORRUPT, ids[-1], ids[0]), positions=True, residual=True,
                                  grad_drop=False, n_resamples=0)
    for name in ("heads_by_position", "queries_by_position", "keys_by_position", "residual"):
        assert np.isfinite(getattr(result, name)).all(), name
    np.testing.assert_allclose(result.heads_by_position[0].sum(1), result.heads[0], rtol=1e-9, atol=1e-12)


# ---- the command -------------------------------------------------------------------------------------------
def test_patch_atp_positions_and_residual_write_the_maps_and_json(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "atp"
    code = exit_code(["patch", "-m", str(tiny_model_dir("llama")), "--clean", CLEAN, "--corrupt", CORRUPT,
                      "--target", "mat", "--other", "cat", "--method", "atp*", "--positions", "--residual", "--mlps",
                      "--bootstrap", "0", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    for part in ("heads_by_position", "queries_by_position", "keys_by_position", "mlps_by_position", "residual"):
        assert (out / f"patching_{part}.png").stat().st_size > 1000, part
    data = json.loads((out / "patching.json").read_text())
    n_tokens = len(data["pairs"][0]["tokens"])
    assert np.array(data["heads_by_position"]["per_pair"], dtype=float).shape == (1, 3, n_tokens, 6)
    assert np.array(data["residual"]["mean"], dtype=float).shape == (3, n_tokens)
    assert "at position" in capsys.readouterr().out


@pytest.mark.parametrize("method", ["cached", "naive"])
def test_positions_without_atp_is_one_line_before_any_pass(method, tiny_model_dir, tmp_path, capsys, monkeypatch):
    must_not_run(monkeypatch, "attnscope.experiments.patching.activation_patching")
    argv = ["patch", "-m", str(tiny_model_dir("llama")), "--clean", CLEAN, "--corrupt", CORRUPT, "--target", "mat",
            "--method", method, "--positions", "-o", str(tmp_path / "out")]
    assert_one_error_line(exit_code(argv), capsys.readouterr().err, "go with --method atp")
