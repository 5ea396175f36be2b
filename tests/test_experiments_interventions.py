"""Head ablation, attention corruption and sublayer skipping, checked against direct computation
(hand-built masks, recorded attention and values, models with the sublayer removed by hand)."""

from __future__ import annotations

import copy

import pytest
import torch

from attnscope import load_model
from attnscope.capture import capture, intervene
from attnscope.errors import AttnscopeError
from attnscope.experiments import (
    HeadAblation,
    HeadGates,
    ablate_heads,
    corrupt_attention,
    head_output_means,
    prune_heads,
    skip_sublayers,
)
from attnscope.experiments.interventions import beginning_pattern, end_pattern, previous_token_pattern, uniform_pattern

from .conftest import SENTENCES


@pytest.fixture(scope="module")
def tiny_bert(tiny_model_dir):
    return load_model(str(tiny_model_dir("bert")))


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return load_model(str(tiny_model_dir("llama")))


@pytest.fixture(scope="module")
def tiny_bart(tiny_model_dir):
    return load_model(str(tiny_model_dir("bart")))


def padded(loaded, texts=(SENTENCES[0], SENTENCES[3], SENTENCES[2])):
    return loaded.tokenizer(list(texts), return_tensors="pt", padding=True)


def hidden(loaded, inputs):
    with torch.inference_mode():
        out = loaded.model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


# ---- patterns on a hand-built mask -------------------------------------------------------------
ALLOWED = torch.tensor([[1, 1, 1, 0],  # query 0 may see keys 0-2 (key 3 is padding)
                        [1, 1, 1, 0],
                        [1, 0, 1, 0]], dtype=torch.bool)[None, None]  # [1, 1, q_pos=3, k_pos=4]
PROBS = torch.full((1, 2, 3, 4), 0.25)


def test_patterns_put_weight_exactly_where_hand_computed():
    third, half = 1 / 3, 1 / 2
    torch.testing.assert_close(uniform_pattern(PROBS, ALLOWED)[0, 0], torch.tensor(
        [[third, third, third, 0], [third, third, third, 0], [half, 0, half, 0]]))
    torch.testing.assert_close(beginning_pattern(2)(PROBS, ALLOWED)[0, 1], torch.tensor(
        [[half, half, 0, 0], [half, half, 0, 0], [half, 0, half, 0]]))  # first two allowed keys
    torch.testing.assert_close(end_pattern(PROBS, ALLOWED)[0, 0], torch.tensor(
        [[0, 0, 1.0, 0], [0, 0, 1.0, 0], [0, 0, 1.0, 0]]))
    # with fewer queries than keys the queries are the last positions (decoding with a cache)
    torch.testing.assert_close(previous_token_pattern(PROBS, ALLOWED)[0, 0], torch.tensor(
        [[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0]]))
    square = torch.tril(torch.ones(4, 4, dtype=torch.bool))[None, None]  # causal
    torch.testing.assert_close(previous_token_pattern(torch.zeros(1, 1, 4, 4), square)[0, 0], torch.tensor(
        [[1.0, 0, 0, 0], [1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0]]))  # the first token attends to itself


def test_bad_heads_and_unknown_patterns_are_one_line_errors():
    with pytest.raises(AttnscopeError, match="unknown attention pattern"):
        HeadAblation("sideways")
    with pytest.raises(AttnscopeError, match="reference means"):
        HeadAblation("mean")
    with pytest.raises(AttnscopeError, match="between 0 and 3"):
        HeadAblation(heads=[4]).modify_output(None, torch.zeros(1, 2, 4, 8))  # type: ignore[arg-type]


# ---- corruption --------------------------------------------------------------------------------
def test_uniform_corruption_gives_one_over_n_on_valid_keys(tiny_bert):
    inputs = padded(tiny_bert)
    with capture(tiny_bert.sites) as session, corrupt_attention("uniform", layers=[1], heads=[0, 2]):
        hidden(tiny_bert, inputs)
    attention = session.captured[("self", 1)].attention  # [batch, head, q_pos, k_pos]
    for row, n in enumerate(inputs["attention_mask"].sum(-1).tolist()):
        expected = torch.zeros(attention.shape[-1])
        expected[:n] = 1 / n
        for head in (0, 2):
            torch.testing.assert_close(attention[row, head, :n], expected.expand(n, -1))
        assert not torch.allclose(attention[row, 1, :n], expected.expand(n, -1))  # head 1 untouched
    assert not torch.allclose(session.captured[("self", 0)].attention[0, 0], attention[0, 0])  # layer 0 untouched


def test_cross_attention_corruption_to_the_end_and_beginning(tiny_bart):
    inputs = padded(tiny_bart, (SENTENCES[0], SENTENCES[2]))
    inputs["decoder_input_ids"] = torch.tensor([[101, 2023, 2003], [101, 1037, 2204]])
    lengths = inputs["attention_mask"].sum(-1).tolist()
    for pattern, k in (("end", 1), ("beginning", 3)):
        with capture(tiny_bart.sites) as session, corrupt_attention(pattern, kinds=["cross"], k=k):
            hidden(tiny_bart, inputs)
        cross = session.captured[("cross", 0)].attention  # [batch, head, target_pos, source_pos]
        for row, n in enumerate(lengths):
            expected = torch.zeros(cross.shape[-1])
            if pattern == "end":
                expected[n - 1] = 1.0  # the last real source token (end of sentence), not padding
            else:
                expected[:k] = 1 / k
            torch.testing.assert_close(cross[row], expected.expand_as(cross[row]))


def test_a_user_function_can_corrupt_attention(tiny_llama):
    inputs = padded(tiny_llama)
    diagonal = lambda probs, allowed: torch.eye(probs.shape[-1]).expand_as(probs)
    with capture(tiny_llama.sites) as session, corrupt_attention(diagonal, layers=[2]):
        hidden(tiny_llama, inputs)
    attention = session.captured[("self", 2)].attention
    torch.testing.assert_close(attention, torch.eye(attention.shape[-1]).expand_as(attention))


# ---- ablation ----------------------------------------------------------------------------------
def test_zero_ablation_of_all_heads_equals_skipping_the_attention_sublayer(tiny_llama, tiny_bert):
    # Llama's projections have no bias, so removing every head removes the whole sublayer output
    inputs = padded(tiny_llama)
    with ablate_heads({1: None}, mode="zero"):
        ablated = hidden(tiny_llama, inputs)
    with skip_sublayers(tiny_llama, attention=[1]):
        skipped = hidden(tiny_llama, inputs)
    torch.testing.assert_close(ablated, skipped, atol=1e-6, rtol=0)
    assert not torch.allclose(ablated, hidden(tiny_llama, inputs))
    # BERT's output projection adds a bias after the heads: with it set to zero the two agree too
    bert = prune_heads(tiny_bert, {})  # a deep copy with its own sites
    out_proj = bert.model.get_submodule("encoder.layer.0.attention.output.dense")
    with torch.no_grad():
        out_proj.bias.zero_()
    inputs = padded(bert)
    with ablate_heads({0: None}):
        ablated = hidden(bert, inputs)
    with skip_sublayers(bert, attention=[0]):
        skipped = hidden(bert, inputs)
    torch.testing.assert_close(ablated, skipped, atol=1e-6, rtol=0)


def test_skipping_the_feed_forward_sublayer_equals_a_hand_made_model_without_it(tiny_llama):
    inputs = padded(tiny_llama)
    changed = copy.deepcopy(tiny_llama.model)
    with torch.no_grad():
        changed.model.layers[0].mlp.down_proj.weight.zero_()  # the MLP now adds exactly 0
    with torch.inference_mode():
        reference = changed(**inputs).logits
    with skip_sublayers(tiny_llama, ffn=[0]):
        skipped = hidden(tiny_llama, inputs)
    torch.testing.assert_close(skipped, reference, atol=1e-6, rtol=0)


def test_skipping_every_cross_attention_makes_the_decoder_deaf_to_the_source(tiny_bart):
    decoder = torch.tensor([[101, 2023, 2003, 1037]])
    outputs = []
    for source in (SENTENCES[0], SENTENCES[2]):
        inputs = dict(tiny_bart.tokenizer(source, return_tensors="pt"), decoder_input_ids=decoder)
        with skip_sublayers(tiny_bart, cross=[0, 1]):
            outputs.append(hidden(tiny_bart, inputs))
        normal = hidden(tiny_bart, inputs)
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=0)
    assert not torch.allclose(outputs[1], normal)


def test_mean_ablation_uses_each_heads_mean_output_over_real_tokens(tiny_bert):
    inputs = padded(tiny_bert)
    means = head_output_means(tiny_bert, [inputs])
    with capture(tiny_bert.sites, qkv=True) as session:
        hidden(tiny_bert, inputs)
    site = session.captured[("self", 1)]
    outputs = site.attention @ site.values  # [batch, head, q_pos, d_head]: each head's output
    real = inputs["attention_mask"].bool()
    expected = torch.stack([outputs[:, h][real].mean(0) for h in range(outputs.shape[1])])  # [head, d_head]
    torch.testing.assert_close(means[("self", 1)], expected, atol=1e-5, rtol=1e-5)
    recorded = {}

    class Spy(HeadAblation):
        def modify_output(self, s, output):
            recorded["after"] = output
            return output

    with ablate_heads({1: [3]}, mode="mean", means=means), intervene(Spy(layers=[1])):
        hidden(tiny_bert, inputs)
    torch.testing.assert_close(recorded["after"][:, :, 3], expected[3].expand_as(recorded["after"][:, :, 3]))


def test_per_row_head_masks_equal_separate_runs(tiny_llama):
    inputs = padded(tiny_llama, (SENTENCES[1],))
    variants = torch.tensor([[True, False, False, False, False, False],
                             [False, False, True, True, False, False],
                             [False, False, False, False, False, False]])
    batched_inputs = {k: v.repeat(3, 1) for k, v in inputs.items()}
    with intervene(HeadAblation("uniform", layers=[0], heads=variants)):
        batched = hidden(tiny_llama, batched_inputs)
    for row in range(3):
        with intervene(HeadAblation("uniform", layers=[0], heads=variants[row])):
            alone = hidden(tiny_llama, inputs)
        torch.testing.assert_close(batched[row], alone[0], atol=1e-5, rtol=0)


def test_gates_of_zero_equal_zero_ablation_and_gates_of_one_change_nothing(tiny_llama):
    inputs = padded(tiny_llama)
    gates = torch.ones(3, 6)
    with intervene(HeadGates({"self": gates})):
        assert torch.allclose(hidden(tiny_llama, inputs), hidden(tiny_llama, inputs))
    gates[1, [2, 5]] = 0
    with intervene(HeadGates({"self": gates})):
        gated = hidden(tiny_llama, inputs)
    with ablate_heads({1: [2, 5]}):
        ablated = hidden(tiny_llama, inputs)
    torch.testing.assert_close(gated, ablated)


# ---- clean-up ----------------------------------------------------------------------------------
def test_the_model_is_restored_after_an_exception_inside_any_intervention(tiny_bert):
    inputs = padded(tiny_bert)
    before = hidden(tiny_bert, inputs)
    blocks = [lambda: ablate_heads({0: [1]}), lambda: corrupt_attention("end"),
              lambda: skip_sublayers(tiny_bert, attention=[0], ffn=[1])]
    for make in blocks:
        with pytest.raises(RuntimeError), make():
            raise RuntimeError("user code failed inside the block")
    assert all(not module._forward_hooks for module in tiny_bert.model.modules())
    torch.testing.assert_close(hidden(tiny_bert, inputs), before, atol=0, rtol=0)


def test_unknown_sublayers_are_one_line_errors(tiny_bert):
    with pytest.raises(AttnscopeError, match="no cross-attention sublayer"), skip_sublayers(tiny_bert, cross=[0]):
        pass
    with pytest.raises(AttnscopeError, match="layer 7"), skip_sublayers(tiny_bert, ffn=[7]):
        pass


# ---- threads -----------------------------------------------------------------------------------
RUNS = 8


def run_side_by_side(loaded, inputs, changed_block) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two threads run the same model at once, ``RUNS`` times each: one inside ``changed_block()``,
    the other with no intervention. Returns (changed outputs, intact outputs)."""
    import threading

    both_inside = threading.Barrier(2, timeout=60)
    outputs: dict[str, list[torch.Tensor]] = {"changed": [], "intact": []}

    def run(name: str) -> None:
        for _ in range(RUNS):
            both_inside.wait()  # each run of one thread overlaps a run of the other
            outputs[name].append(hidden(loaded, inputs))

    def changed() -> None:
        with changed_block():
            run("changed")

    threads = [threading.Thread(target=changed), threading.Thread(target=run, args=("intact",))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(outputs["changed"]) == len(outputs["intact"]) == RUNS
    return outputs["changed"], outputs["intact"]


@pytest.mark.parametrize("block", ["skip", "ablate", "corrupt"])
def test_interventions_act_only_in_the_thread_that_asked(tiny_llama, block):
    inputs = padded(tiny_llama)
    intact = hidden(tiny_llama, inputs)
    make = {"skip": lambda: skip_sublayers(tiny_llama, attention=[1], ffn=[0]),
            "ablate": lambda: ablate_heads({1: None}),
            "corrupt": lambda: corrupt_attention("uniform")}[block]
    with make():
        expected_changed = hidden(tiny_llama, inputs)
    assert not torch.allclose(expected_changed, intact)
    changed, unchanged = run_side_by_side(tiny_llama, inputs, make)
    for run in range(RUNS):
        torch.testing.assert_close(unchanged[run], intact, atol=0, rtol=0, msg=f"intact thread, run {run}")
        torch.testing.assert_close(changed[run], expected_changed, atol=0, rtol=0, msg=f"changed thread, run {run}")
    assert all(not module._forward_hooks for module in tiny_llama.model.modules())


def test_nested_and_overlapping_skips_install_one_hook_and_remove_it_last(tiny_llama):
    inputs = padded(tiny_llama)
    ffn = tiny_llama.model.model.layers[0].mlp
    with skip_sublayers(tiny_llama, ffn=[0]):
        once = hidden(tiny_llama, inputs)
        with skip_sublayers(tiny_llama, ffn=[0], attention=[1]):
            assert len(ffn._forward_hooks) == 1
        assert len(ffn._forward_hooks) == 1
        torch.testing.assert_close(hidden(tiny_llama, inputs), once, atol=0, rtol=0)
    assert not ffn._forward_hooks


def test_pre_hooks_that_rewrite_keyword_inputs_are_thread_local_too(tiny_llama):
    from attnscope.capture.hooks import local_hooks

    def halve(_module, args, kwargs):  # LlamaDecoderLayer takes hidden_states as a keyword or first argument
        if args:
            return (args[0] * 0.5, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] * 0.5}

    inputs = padded(tiny_llama)
    intact = hidden(tiny_llama, inputs)
    make = lambda: local_hooks([tiny_llama.model.model.layers[1]], halve, pre=True)
    with make():
        expected_changed = hidden(tiny_llama, inputs)
    assert not torch.allclose(expected_changed, intact)
    changed, unchanged = run_side_by_side(tiny_llama, inputs, make)
    assert all(torch.equal(run, intact) for run in unchanged)
    assert all(torch.equal(run, expected_changed) for run in changed)
    assert not tiny_llama.model.model.layers[1]._forward_pre_hooks
