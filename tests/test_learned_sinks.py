"""Learned attention sinks (gpt-oss): a learned logit per head in each softmax's denominator, with no value
behind it. Captured weights equal transformers' eager ``output_attentions=True``, the sink mass equals a
direct computation, and every path (eager, chunked / planned, streamed, generation rows, fused) and every
consumer that assumed rows sum to 1 (record checks, rollout, the sink report, the views) is right for it.
Tiny random gpt-oss built from its config (``tests/tiny_architectures.py``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnscope import AttentionRecord, extract, load_model
from attnscope.analysis.rollout import attention_rollout
from attnscope.analysis.sinks import sink_report
from attnscope.capture.extract import extract_to_file
from attnscope.capture.generate import generate
from attnscope.capture.plan import CapturePlan, QuerySelection
from attnscope.errors import AttnscopeError
from attnscope.present.html import view
from attnscope.present.payload import build_payload, unpack
from attnscope.present.steps import generation_payload, steps_view

from .tiny_architectures import (
    EAGER_WITHOUT_SINK,
    TEXT,
    TOLERANCE,
    build_folder,
    check_type,
    compare,
    eager_attentions,
    tiny_config,
)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A tiny gpt-oss (2 layers, 4 heads, 2 key/value heads, one sliding layer), loaded by attnscope, with
    its record (queries and keys kept) and transformers' eager attentions of the same input."""
    folder = build_folder("gpt_oss", tmp_path_factory.mktemp("gpt_oss"))
    loaded = load_model(str(folder))
    record = extract(loaded, TEXT, qkv=True)
    eager = eager_attentions(folder, record.token_ids.tolist(), None)
    return folder, loaded, record, eager


def direct_sink_mass(loaded, record: AttentionRecord) -> np.ndarray:
    """``[layer, head, q_pos]``: softmax over ``[q.k * scaling (causal, windowed), sink logit]``, its last
    column, from the captured queries and keys and each module's ``sinks`` parameter."""
    n = len(record.tokens)
    sites = sorted(loaded.sites.items(), key=lambda item: item[1].layer)
    masses = []
    for layer, (module, _site) in enumerate(sites):
        q = torch.from_numpy(np.asarray(record.queries[layer], dtype=np.float64))  # [head, q_pos, d_head]
        k = torch.from_numpy(np.asarray(record.keys[layer], dtype=np.float64))
        scores = q @ k.transpose(-1, -2) * record.model.scaling  # [head, q_pos, k_pos]
        distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]
        window = record.model.window(layer)
        visible = (distance >= 0) & ((distance < window) if window else True)
        scores = scores.masked_fill(~visible, -torch.inf)
        sinks = module.sinks.detach().double()[:, None, None].expand(-1, n, 1)
        masses.append(torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., -1].numpy())
    return np.stack(masses)


def test_captured_weights_equal_eager_and_rows_sum_to_one_minus_the_sink_mass(gpt_oss):
    _, _, record, eager = gpt_oss
    error, reason = compare({"self": record.attention}, eager)
    assert error <= TOLERANCE, reason
    assert record.model.learned_sinks and record.sink_mass.shape == record.attention.shape[:3]
    # eager drops the sink column: its rows sum to less than 1, by the sink mass
    eager_rows = np.stack([layer.sum(-1) for layer in eager["self"]])  # [layer, head, q_pos]
    np.testing.assert_allclose(record.sink_mass, 1.0 - eager_rows, atol=TOLERANCE)
    assert record.sink_mass.min() > 1e-3  # the perturbed sinks take a visible share


def test_the_sink_mass_equals_a_direct_computation(gpt_oss):
    _, loaded, record, _ = gpt_oss
    np.testing.assert_allclose(record.sink_mass, direct_sink_mass(loaded, record), atol=1e-6)


def test_the_model_output_outside_a_capture_keeps_its_sinks(gpt_oss):
    """No capture: the attention function runs without recording, and must still add the sinks (SDPA has none)."""
    import transformers

    folder, loaded, record, _ = gpt_oss
    eager = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    ids = torch.tensor([record.token_ids.tolist()])
    with torch.inference_mode():
        ours, theirs = loaded.model(input_ids=ids).logits, eager(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_planned_and_streamed_captures_keep_the_same_rows_and_sink_mass(gpt_oss, tmp_path):
    _, loaded, record, _ = gpt_oss
    n = len(record.tokens)
    plan = CapturePlan(heads=(1, 3), queries=QuerySelection("list", given=(2, 5, n - 1)), statistics=True, chunk=2)
    rows = [2, 5, n - 1]
    for partial in (extract(loaded, TEXT, plan=plan), extract_to_file(loaded, TEXT, path=tmp_path / "r.safetensors",
                                                                       plan=plan)):
        np.testing.assert_allclose(partial.held("sink_mass"), record.sink_mass[:, [1, 3]][:, :, rows], atol=1e-6)
        np.testing.assert_allclose(partial.held("attention"), record.attention[:, [1, 3]][:, :, rows], atol=1e-6)
        np.testing.assert_allclose(partial.statistics["first"], record.attention[:, [1, 3]][:, :, rows, 0], atol=1e-6)
    AttentionRecord.open(tmp_path / "r.safetensors", values=True)  # the streamed file passes the checks


def test_generation_rows_and_their_sink_mass_equal_a_full_capture_of_the_text(gpt_oss, tmp_path):
    _, loaded, _, _ = gpt_oss
    for prompt_rows in (True, False):  # every row, or only the steps' (the prompt's first rows run without rows)
        gen = generate(loaded, TEXT, max_new_tokens=3, prompt_rows=prompt_rows, norms=False)
        attention, sink_mass = capture_ids(loaded, gen.token_ids.tolist())  # the same ids, no re-tokenizing
        for position in range(gen.first_row, len(gen.tokens)):
            np.testing.assert_allclose(gen.row(position), attention[:, :, position, : position + 1], atol=1e-5)
            np.testing.assert_allclose(gen.row_sink_mass(position), sink_mass[:, :, position], atol=1e-5)
        loaded_back = type(gen).load(gen.save(tmp_path / f"g{prompt_rows}.safetensors"))  # the checks pass
        np.testing.assert_array_equal(loaded_back.arrays["sink_mass"], gen.arrays["sink_mass"])
    payload = generation_payload(gen, compress=False)
    np.testing.assert_allclose(unpack(payload["sink_mass"]), np.stack(
        [gen.step_sink_mass(step) for step in range(gen.n_steps)], axis=-1), atol=1e-3)


def capture_ids(loaded, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Attention ``[layer, head, q_pos, k_pos]`` and sink mass ``[layer, head, q_pos]`` of exactly these
    token ids in one forward pass (a full capture through the same attention function)."""
    from attnscope.capture.attention import capture

    with torch.inference_mode(), capture(loaded.sites) as session:
        loaded.model(input_ids=torch.tensor([ids]))
    layers = session.layers("self")
    return (np.stack([c.attention[0].numpy() for c in layers]), np.stack([c.sink_mass[0].numpy() for c in layers]))


def test_a_saved_record_keeps_its_sink_mass_and_a_damaged_one_is_refused(gpt_oss, tmp_path):
    _, _, record, _ = gpt_oss
    loaded_back = AttentionRecord.load(record.save(tmp_path / "r.safetensors"))
    np.testing.assert_array_equal(loaded_back.sink_mass, record.sink_mass)
    assert loaded_back.model.learned_sinks
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    with safe_open(tmp_path / "r.safetensors", "np") as handle:
        metadata = handle.metadata()
    arrays = load_file(tmp_path / "r.safetensors")
    arrays["self.sink_mass"] = arrays["self.sink_mass"] * 0.5
    save_file(arrays, tmp_path / "bad.safetensors", metadata=metadata)
    with pytest.raises(AttnscopeError, match="rows should sum to 1 minus their sink mass"):
        AttentionRecord.load(tmp_path / "bad.safetensors")
    del arrays["self.sink_mass"]
    save_file(arrays, tmp_path / "missing.safetensors", metadata=metadata)
    with pytest.raises(AttnscopeError, match="no self.sink_mass array, though the model info says it has learned sinks"):
        AttentionRecord.load(tmp_path / "missing.safetensors")


def test_word_level_rows_still_sum_to_one_minus_their_sink_mass(gpt_oss):
    _, _, record, _ = gpt_oss
    words = record.to_word_level()
    np.testing.assert_allclose(words.attention.sum(-1) + words.sink_mass, 1.0, atol=1e-5)


def test_rollout_keeps_each_rows_sink_mass_on_the_query_itself(gpt_oss):
    _, _, record, _ = gpt_oss
    rollout = attention_rollout(record).matrix
    np.testing.assert_allclose(rollout.sum(-1), 1.0, atol=1e-9)
    n = len(record.tokens)
    expected = np.eye(n)
    for layer in range(record.n_layers):  # Abnar & Zuidema with the sink's share staying on the query
        heads = record.attention[layer].astype(np.float64) + np.eye(n) * record.sink_mass[layer][..., None]
        expected = (0.5 * heads.mean(0) + 0.5 * np.eye(n)) @ expected
    np.testing.assert_allclose(rollout[-1], expected, atol=1e-9)


def test_the_sink_report_puts_the_learned_sink_mass_beside_the_first_token(gpt_oss):
    _, _, record, _ = gpt_oss
    report = sink_report([record, record])
    np.testing.assert_allclose(report.measures["learned"], record.sink_mass[:, :, 1:].mean(-1), atol=1e-9)
    assert "learned sink" in report.to_text()
    assert report.to_dict()["summary"]["mean_learned"] == pytest.approx(float(record.sink_mass[:, :, 1:].mean()),
                                                                        abs=1e-6)


def test_the_head_views_payload_ships_the_sink_mass(gpt_oss):
    _, _, record, _ = gpt_oss
    payload = build_payload(record, "head", compress=False)
    shipped = unpack(payload["kinds"][0]["sink_mass"])
    np.testing.assert_allclose(shipped, record.sink_mass, atol=1e-3)  # float16
    import jsonschema

    from attnscope.present.payload import payload_schema

    jsonschema.validate(payload, payload_schema())


# one type per way transformers writes learned sinks: gpt-oss's sink column dropped from eager's weights,
# Granite's rows renormalised without it (the sink scales the output), MiMo's sinks on its sliding layers only
@pytest.mark.parametrize("model_type", ["gpt_oss", "granite_swa", "mimo_v2_flash"])
def test_types_with_learned_sinks_are_captured_exactly(model_type, tmp_path):
    result = check_type(model_type, tmp_path)
    assert result["outcome"] == "equal", result
    assert (model_type in EAGER_WITHOUT_SINK) == (model_type == "granite_swa")


def granite_with_sliding_layers(model_type: str):
    """A tiny Granite SWA in its default pattern on 4 layers (one full, then three sliding over 4 keys: the input has
    16), without rotary positions (NoPE) on the second and fourth, as its config allows."""
    config = tiny_config(model_type)
    config.num_hidden_layers = 4
    config.layer_types = ["full_attention"] + ["sliding_attention"] * 3
    config.layer_rope_theta = [10000.0, 0, 10000.0, 0]
    return config


def mixed_values(folder, token_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer of the eager model: its values ``[head, k_pos, d_head]`` (each query head's key/value head) and what
    its attention hands the output projection ``[head, q_pos, d_head]``, heard with hooks."""
    import transformers

    from attnscope.models.loading import _auto_class

    config = transformers.AutoConfig.from_pretrained(folder)
    model = _auto_class(config).from_pretrained(folder, attn_implementation="eager").eval()
    heard = {}
    for layer, block in enumerate(model.base_model.layers):
        block.self_attn.v_proj.register_forward_hook(lambda _, __, out, layer=layer: heard.__setitem__(("v", layer),
                                                                                                      out[0]))
        block.self_attn.o_proj.register_forward_pre_hook(lambda _, args, layer=layer: heard.__setitem__(("o", layer),
                                                                                                       args[0][0]))
    with torch.inference_mode():
        model.base_model(input_ids=torch.tensor([token_ids]))
    per_head = lambda states, n: states.view(states.shape[0], n, -1).transpose(0, 1)  # [pos, n * d] -> [n, pos, d]
    group = config.num_attention_heads // config.num_key_value_heads
    return [(per_head(heard["v", layer], config.num_key_value_heads).repeat_interleave(group, 0),
             per_head(heard["o", layer], config.num_attention_heads)) for layer in range(config.num_hidden_layers)]


@pytest.mark.parametrize("model_type", sorted(EAGER_WITHOUT_SINK))
def test_granites_sliding_layers_are_what_the_model_mixes_values_with(model_type, tmp_path):
    """Granite's sliding-window types, windows shorter than the input on 3 of 4 layers: each recorded row equals
    eager's (renormalised without the sink) times the share the sink leaves the keys, and the recorded weights times
    the values are what each layer's attention hands its output projection, which checks that share without
    attnscope's own sink mass (eager's rows leave the sink out: a comparison with them alone differs by it)."""
    config = granite_with_sliding_layers(model_type)
    result = check_type(model_type, tmp_path, config)
    assert result["outcome"] == "equal", result
    record = extract(load_model(str(tmp_path)), TEXT)
    assert record.attention.shape[-1] > config.sliding_window
    for weights, (values, mixed) in zip(record.attention, mixed_values(tmp_path, record.token_ids.tolist()),
                                        strict=True):
        torch.testing.assert_close(torch.tensor(weights) @ values, mixed, atol=1e-5, rtol=1e-5)


def test_deepseek_v4s_compressed_keys_are_refused_in_one_line(tmp_path):
    """Its compressed-attention layers attend over more keys than there are tokens."""
    result = check_type("deepseek_v4", tmp_path)
    assert result["outcome"] == "refused", result
    assert "attend over different numbers of keys" in result["reason"] and "docs/ARCHITECTURE.md" in result["reason"]




def opened(browser, path, drawn: str):
    """A page on ``path`` once ``drawn`` (a selector's dataset.drawn) is set, with its console errors."""
    page = browser.new_page(viewport={"width": 1100, "height": 800})
    page.errors = []
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    page.on("console", lambda message: message.type == "error" and page.errors.append(message.text))
    page.goto(path.as_uri())
    page.wait_for_function(f"() => document.querySelector('{drawn}')?.dataset.drawn")
    return page


def test_the_step_view_shows_each_steps_learned_sink(browser, gpt_oss, tmp_path):
    _, loaded, _, _ = gpt_oss
    gen = generate(loaded, TEXT, max_new_tokens=3, norms=False)
    page = opened(browser, steps_view(gen).save(tmp_path / "steps.html"), ".attnscope-steps")
    shown = lambda: float(page.get_attribute("[data-role=sink]", "data-mass"))
    assert shown() == pytest.approx(float(gen.step_sink_mass(0).mean()), abs=1e-3)  # all layers and heads
    page.select_option("[data-role=layer]", "1")
    page.select_option("[data-role=head]", "2")
    page.keyboard.press("ArrowRight")
    page.wait_for_function("() => document.querySelector('.attnscope-steps').dataset.step === '1'")
    assert shown() == pytest.approx(float(gen.step_sink_mass(1)[1, 2]), abs=1e-3)  # float16
    assert "learned sink" in page.text_content("[data-role=sink]") and page.errors == []


def test_the_head_view_writes_the_learned_sink_of_each_head(browser, gpt_oss, tmp_path):
    _, _, record, _ = gpt_oss
    page = opened(browser, view(record, "head").save(tmp_path / "head.html"), ".attnscope-root")
    app = 'AttnscopeViews.instances["attnscope-view"]'
    written = f"{app}.views.head.scene.ofType('text').filter(t => t.meta && t.meta.role === 'sink')[0].meta.masses"
    layer = int(page.evaluate(f"{app}.state.layer"))
    masses = {m["head"]: m["mass"] for m in page.evaluate(written)}  # mean over the queries shown
    np.testing.assert_allclose([masses[h] for h in range(record.n_heads)], record.sink_mass[layer].mean(-1), atol=1e-3)
    page.evaluate(f"{app}.selectToken(4)")
    page.wait_for_function(f"() => {app}.state.selected === 4")
    page.wait_for_function(f"() => ({written}).length && {app}.views.head.focus()")
    masses = {m["head"]: m["mass"] for m in page.evaluate(written)}
    np.testing.assert_allclose([masses[h] for h in range(record.n_heads)], record.sink_mass[layer, :, 4], atol=1e-3)
    assert page.errors == []


def test_a_previous_token_head_that_parks_most_of_its_softmax_in_the_sink_is_still_one(gpt_oss):
    """Classified on what the head gives the tokens: 10% of each row on the previous token, 90% in the sink."""
    from dataclasses import replace

    from attnscope.analysis.patterns import classify_heads

    _, _, record, _ = gpt_oss
    n = len(record.tokens)
    previous = np.eye(n, k=-1)
    previous[0, 0] = 1.0  # the first query sees only itself
    attention = np.broadcast_to(0.1 * previous, record.attention.shape).astype(np.float32)
    arrays = {**record.arrays, "self.attention": attention, "self.sink_mass": np.full(attention.shape[:3], 0.9,
                                                                                     dtype=np.float32)}
    for name in ("self.queries", "self.keys", "self.values"):
        arrays.pop(name)
    patterns = classify_heads(replace(record, arrays=arrays))
    assert set(np.asarray(patterns.labels).ravel()) == {"previous_word"}


def test_eager_attention_of_a_sink_model_brought_from_elsewhere_keeps_its_sink_mass(gpt_oss, tmp_path):
    """``from_attentions`` of transformers' eager weights (the sink column dropped): each row's missing share."""
    _, _, record, eager = gpt_oss
    brought = AttentionRecord.from_attentions([layer[None] for layer in eager["self"]], record.tokens)
    assert brought.model.learned_sinks
    np.testing.assert_allclose(brought.sink_mass, record.sink_mass, atol=TOLERANCE)
    AttentionRecord.load(brought.save(tmp_path / "brought.safetensors"))  # passes the record checks


def test_sinks_computed_per_query_are_kept_on_every_path(tmp_path):
    """Inkling 2 computes one sink logit per query from its input (``sinks``, ``[batch, head, q_pos, 1]``), not one
    per head: a planned capture, chunk by chunk, keeps the full capture's rows and sink mass."""
    loaded = load_model(str(build_folder("inkling2_text", tmp_path)))
    record = extract(loaded, TEXT)
    assert record.sink_mass is not None and float(record.sink_mass.max()) > 0
    rows = [2, 5, len(record.tokens) - 1]
    plan = CapturePlan(heads=(1, 3), queries=QuerySelection("list", given=tuple(rows)), chunk=2)
    partial = extract(loaded, TEXT, plan=plan)
    np.testing.assert_allclose(partial.held("sink_mass"), record.sink_mass[:, [1, 3]][:, :, rows], atol=1e-6)
    np.testing.assert_allclose(partial.held("attention"), record.attention[:, [1, 3]][:, :, rows], atol=1e-6)
