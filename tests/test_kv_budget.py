"""KV budgets (issue 49): a cache whose streaming KV heads keep only the first ``sink`` keys and the ``window`` most
recent generates what masking the same keys on a full cache generates (tokens, rows to 1e-5), on tiny Llama (grouped
heads), Gemma 3 (sliding layers), Qwen2 and gpt-oss (learned sinks) configurations; with every head full it is plain
generation, with every head streaming a hand-written sink + window attention; it holds the bytes the budget promises;
bad budgets are refused in one line. Layers and heads are 0-indexed."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pandas as pd
import pytest
import torch

import attnscope
from attnscope.capture.attention import intervene
from attnscope.capture.generate import cache_keyword
from attnscope.capture.growing_cache import MIN_ROOM
from attnscope.capture.kv_budget import (
    KVBudget,
    KVLayout,
    budgeted_cache,
    budgeted_layer_class,
    choose_budget,
    kv_bytes,
    kv_layout,
    random_budget,
)
from attnscope.errors import AttnscopeError
from attnscope.experiments.interventions import SinkWindow

from .test_cli_errors import assert_one_error_line, exit_code
from .tiny_architectures import build_folder

PROMPT = "The cat sat on the mat and looked at the dog for a very long time."
SINK, WINDOW = 2, 4
NEW_TOKENS = 8  # prompt (19 tokens) + 8: each streaming head evicts at every step


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``tiny(model_type)``: a tiny perturbed model of that type (hidden 64, 2 layers, 4 heads, 2 KV heads), loaded
    with attnscope's attention function, built once."""
    built: dict[str, attnscope.LoadedModel] = {}

    def get(model_type: str) -> attnscope.LoadedModel:
        if model_type not in built:
            built[model_type] = attnscope.load_model(str(tiny_folder(model_type)))
        return built[model_type]

    folders: dict[str, str] = {}

    def tiny_folder(model_type: str) -> str:
        if model_type not in folders:
            folders[model_type] = str(build_folder(model_type, tmp_path_factory.mktemp(model_type)))
        return folders[model_type]

    get.folder = tiny_folder  # type: ignore[attr-defined]
    return get


def one_streamed_head_per_global_layer(layout: KVLayout) -> KVBudget:
    """KV head 0 of every global layer streams, the others stay full (a grouped layer holds both kinds)."""
    scores = np.ones((layout.n_layers, layout.n_kv_heads))
    scores[:, 0] = 0.0
    return choose_budget(scores, layout, share=(layout.n_kv_heads - 1) / layout.n_kv_heads, sink=SINK, window=WINDOW)


def streamed_query_heads(budget: KVBudget, n_heads: int) -> dict[int, list[int]]:
    """``{layer: [query head, ...]}``: every query head of each streamed KV group."""
    group = n_heads // budget.full.shape[1]
    return {int(layer): [h for kv in np.flatnonzero(budget.streamed[layer]) for h in range(kv * group, (kv + 1) * group)]
            for layer in range(budget.full.shape[0]) if budget.streamed[layer].any()}


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "qwen2", "gpt_oss"])
def test_the_budgeted_cache_generates_what_masking_a_full_cache_does(model_type, tiny):
    loaded = tiny(model_type)
    budget = one_streamed_head_per_global_layer(kv_layout(loaded))
    assert budget.streamed.any() and budget.full.any()
    budgeted = attnscope.generate(loaded, PROMPT, max_new_tokens=NEW_TOKENS, kv_budget=budget)
    with intervene(SinkWindow(streamed_query_heads(budget, budgeted.model.n_heads), SINK, WINDOW)):
        masked = attnscope.generate(loaded, PROMPT, max_new_tokens=NEW_TOKENS)
    plain = attnscope.generate(loaded, PROMPT, max_new_tokens=NEW_TOKENS)
    assert len(budgeted.tokens) > SINK + WINDOW + NEW_TOKENS  # eviction happens at every step
    assert budgeted.token_ids.tolist() == masked.token_ids.tolist()
    assert np.abs(budgeted.arrays["rows"] - masked.arrays["rows"]).max() <= 1e-5
    assert np.abs(budgeted.arrays["rows"] - plain.arrays["rows"]).max() > 1e-3  # streaming changed something
    if "sink_mass" in masked.arrays:  # gpt-oss: the learned sink is no key, kept by both
        assert np.abs(budgeted.arrays["sink_mass"] - masked.arrays["sink_mass"]).max() <= 1e-5
    assert budgeted.settings["kv_budget"]["streamed"] == [[int(l), int(h)] for l, h in np.argwhere(budget.streamed)]


@pytest.mark.parametrize("model_type", ["llama", "gpt_oss"])
def test_a_prompt_whose_rows_are_not_kept_equals_the_mask_too(model_type, tiny):
    """``prompt_rows=False``: the prompt's rows before its last run fused (SDPA; gpt-oss's learned sinks: eagerly),
    the rows kept are computed as before."""
    loaded = tiny(model_type)
    budget = one_streamed_head_per_global_layer(kv_layout(loaded))
    budgeted = attnscope.generate(loaded, PROMPT, max_new_tokens=NEW_TOKENS, kv_budget=budget, prompt_rows=False)
    with intervene(SinkWindow(streamed_query_heads(budget, budgeted.model.n_heads), SINK, WINDOW)):
        masked = attnscope.generate(loaded, PROMPT, max_new_tokens=NEW_TOKENS, prompt_rows=False)
    assert budgeted.first_row == budgeted.prompt_length - 1
    assert budgeted.token_ids.tolist() == masked.token_ids.tolist()
    assert np.abs(budgeted.arrays["rows"] - masked.arrays["rows"]).max() <= 1e-5


def test_attribution_under_a_budget_is_attribution_under_the_mask(tiny):
    """Each step's direct logit attribution and logit lens (from the heads' outputs) and the value norms equal those of
    the masked full cache; routes, which need an unbroken band of keys per query, are refused before the model runs."""
    from attnscope.attribution.generation_routes import StepRoutes
    from attnscope.attribution.steps import StepAttribution

    loaded = tiny("llama")
    budget = one_streamed_head_per_global_layer(kv_layout(loaded))
    budgeted = attnscope.generate(loaded, PROMPT, max_new_tokens=NEW_TOKENS, kv_budget=budget,
                                  recorders=[StepAttribution(lens=True)])
    with intervene(SinkWindow(streamed_query_heads(budget, budgeted.model.n_heads), SINK, WINDOW)):
        masked = attnscope.generate(loaded, PROMPT, max_new_tokens=NEW_TOKENS, recorders=[StepAttribution(lens=True)])
    for name in ("attribution_heads", "attribution_logits", "lens_probs", "value_norms"):
        assert np.abs(budgeted.arrays[name] - masked.arrays[name]).max() <= 1e-5, name
    with pytest.raises(AttnscopeError, match="unbroken band"):
        attnscope.generate(loaded, PROMPT, max_new_tokens=2, kv_budget=budget, recorders=[StepRoutes()])


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_windows_per_head_generate_what_their_masks_do_and_hold_their_bytes(model_type, tiny):
    """A budget whose streaming heads keep windows of different sizes (the curve's uniform budgets): the cache stores
    each head's own window, generates what masking each head's window does (tokens, rows to 1e-5), and holds the
    bytes :func:`kv_bytes` promises."""
    from attnscope.capture.kv_budget import KVBudget

    loaded = tiny(model_type)
    layout = kv_layout(loaded)
    full = np.zeros((layout.n_layers, layout.n_kv_heads), dtype=bool)
    recent = np.zeros(full.shape, dtype=int)
    recent[layout.global_layers] = [WINDOW, WINDOW + 3]  # KV head 0 keeps 4 recent keys, KV head 1 keeps 7
    budget = KVBudget(full, SINK, WINDOW, layout.windows, recent)
    budgeted = attnscope.generate(loaded, PROMPT, max_new_tokens=NEW_TOKENS, kv_budget=budget)
    group = budgeted.model.n_heads // layout.n_kv_heads
    masks = [SinkWindow({layer: list(range(kv * group, (kv + 1) * group)) for layer in layout.global_layers}, SINK,
                        int(recent[layout.global_layers[0], kv])) for kv in range(layout.n_kv_heads)]
    with intervene(*masks):
        masked = attnscope.generate(loaded, PROMPT, max_new_tokens=NEW_TOKENS)
    with intervene(SinkWindow({layer: list(range(budgeted.model.n_heads)) for layer in layout.global_layers}, SINK,
                              WINDOW)):
        one_window = attnscope.generate(loaded, PROMPT, max_new_tokens=NEW_TOKENS)
    assert budgeted.token_ids.tolist() == masked.token_ids.tolist()
    assert np.abs(budgeted.arrays["rows"] - masked.arrays["rows"]).max() <= 1e-5
    assert np.abs(budgeted.arrays["rows"] - one_window.arrays["rows"]).max() > 1e-3  # the wider window matters
    assert f"sink {SINK} + windows {WINDOW}-{WINDOW + 3}" in budgeted.method  # the step view's heading
    again = KVBudget.from_dict(budgeted.settings["kv_budget"])  # the explorer reads the budget back from the record
    assert np.array_equal(again.head_windows(), budget.head_windows()) and np.array_equal(again.full, budget.full)
    cache = budgeted_cache(loaded, budget)
    ids = torch.tensor([loaded.tokenizer(PROMPT)["input_ids"]])
    with torch.inference_mode():
        loaded.model(input_ids=ids, use_cache=True, **{cache_keyword(loaded.model.forward): cache})
    layer = cache.layers[layout.global_layers[0]]
    assert [part.shape[2] for part in layer.parts[2:]] == [SINK + WINDOW] * 2 + [SINK + WINDOW + 3] * 2
    assert cache.stored_bytes() == kv_bytes(budget, ids.shape[1], layout.head_dim)


def test_a_budgeted_layer_writes_its_full_heads_in_place_and_keeps_the_streams_sink_and_window():
    """KV heads 0 and 2 full, 1 streaming (sink 2 + window 3): through a prompt, steps and a block that outgrows the
    room, the full heads' keys and values equal the concatenation of everything given, a step writes them into the
    buffer the last step's view came from (no copy), views handed out earlier keep their values, and the streaming
    head holds its sink and window."""
    generator = torch.Generator().manual_seed(0)
    layer = budgeted_layer_class()([True, False, True], [0, 3, 0], 2)
    given_keys, given_values, views, buffer = [], [], [], None
    for n in [5, 1, 1, MIN_ROOM, 1, 1]:
        keys, values = torch.randn((1, 3, n, 4), generator=generator), torch.randn((1, 3, n, 4), generator=generator)
        given_keys.append(keys)
        given_values.append(values)
        states, _ = layer.update(keys, values)
        everything = torch.cat(given_keys, dim=2)
        assert torch.equal(states.full_keys, everything[:, [0, 2]])
        assert torch.equal(states.full_values, torch.cat(given_values, dim=2)[:, [0, 2]])
        grew = n > 1 or buffer is None
        assert grew or states.full_keys.untyped_storage().data_ptr() == buffer  # written in place
        buffer = states.full_keys.untyped_storage().data_ptr()
        views.append((states.full_keys, states.full_keys.clone()))
        kept = layer.positions[0].tolist()
        assert kept == [p for p in range(everything.shape[2]) if p < 2 or p >= everything.shape[2] - 3]
        assert torch.equal(layer.parts[2], everything[:, [1]][:, :, kept])
    assert all(torch.equal(view, copy) for view, copy in views)


def test_a_budget_leaves_the_layers_the_model_windows_as_they_are(tiny):
    """Gemma 3's layer 0 slides (window 4): neither full nor streaming; only the global layer 1 is budgeted."""
    layout = kv_layout(tiny("gemma3_text"))
    assert layout.windows[0] > 0 and layout.windows[1] == 0
    budget = choose_budget(np.ones((2, layout.n_kv_heads)), layout, share=1.0, sink=SINK, window=WINDOW)
    assert not budget.full[0].any() and budget.full[1].all() and not budget.streamed[0].any()


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_a_user_s_generate_with_the_cache_holds_the_promised_bytes(model_type, tiny):
    """transformers' own ``generate`` with the cache handed in: the same tokens as ``attnscope.generate``, streaming
    heads hold sink + window keys (not the text), and the bytes held are what :func:`kv_bytes` promises."""
    loaded = tiny(model_type)
    layout = kv_layout(loaded)
    budget = one_streamed_head_per_global_layer(layout)
    cache = budgeted_cache(loaded, budget)
    ids = torch.tensor([loaded.tokenizer(PROMPT)["input_ids"]])
    with torch.inference_mode(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = loaded.model.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                    **{cache_keyword(loaded.model.forward): cache})
    expected = attnscope.generate(loaded, PROMPT, max_new_tokens=NEW_TOKENS, kv_budget=budget)
    assert out[0].tolist() == expected.token_ids.tolist()
    held = out.shape[1] - 1  # generate never feeds its last token back
    layer = cache.layers[layout.global_layers[0]]
    assert layer.parts[2].shape[2] == SINK + WINDOW and layer.parts[0].shape[2] == held
    assert cache.stored_bytes() == kv_bytes(budget, held, layout.head_dim, torch.float32)
    full_cache = sum(2 * layout.n_kv_heads * held * layout.head_dim * 4 for window in layout.windows if not window)
    assert cache.stored_bytes() < full_cache + (kv_bytes(budget, held, layout.head_dim) if layout.windows[0] else 0)


def test_every_head_full_is_plain_generation_exactly(tiny):
    loaded = tiny("llama")
    layout = kv_layout(loaded)
    budget = choose_budget(np.zeros((layout.n_layers, layout.n_kv_heads)), layout, share=1.0, sink=SINK, window=WINDOW)
    budgeted = attnscope.generate(loaded, PROMPT, max_new_tokens=NEW_TOKENS, kv_budget=budget)
    plain = attnscope.generate(loaded, PROMPT, max_new_tokens=NEW_TOKENS)
    assert budgeted.token_ids.tolist() == plain.token_ids.tolist()
    assert np.array_equal(budgeted.arrays["rows"], plain.arrays["rows"])
    assert np.array_equal(budgeted.arrays["candidate_probs"], plain.arrays["candidate_probs"])


# ---- every head streaming against a hand-written sink + window attention ---------------------------------------
HAND = "kvbudget_hand_sink_window"


def hand_sink_window_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention written out: every head of every layer sees key ``j`` from query ``i`` only where
    ``j < SINK`` or ``i - WINDOW < j <= i`` (and the model's own mask says so)."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = query @ key.transpose(2, 3) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    n_queries, n_keys = query.shape[2], key.shape[2]
    i = torch.arange(n_keys - n_queries, n_keys)[:, None]
    j = torch.arange(n_keys)[None, :]
    kept = (j < SINK) | ((j <= i) & (j > i - WINDOW))
    scores = scores + attention_mask[:, :, :, :n_keys]
    scores = scores.masked_fill(~kept, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    return (probs @ value).transpose(1, 2).contiguous(), probs


def test_every_head_streaming_is_a_hand_written_sink_and_window_attention(tiny, tmp_path):
    """The budgeted generation's tokens are the argmax of a teacher-forced pass of its text under the hand-written
    attention, and its rows that pass's weights."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    loaded = tiny("llama")
    layout = kv_layout(loaded)
    budget = choose_budget(np.zeros((layout.n_layers, layout.n_kv_heads)), layout, share=0.0, sink=SINK, window=WINDOW)
    record = attnscope.generate(loaded, PROMPT, max_new_tokens=NEW_TOKENS, kv_budget=budget, prompt_rows=True)
    AttentionInterface.register(HAND, hand_sink_window_attention)
    AttentionMaskInterface.register(HAND, eager_mask)
    loaded.model.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=HAND).eval()
    with torch.inference_mode():
        out = reference(input_ids=torch.tensor([record.token_ids.tolist()]), output_attentions=True, use_cache=False)
    chosen = out.logits[0, record.prompt_length - 1 : -1].argmax(-1)
    assert chosen.tolist() == record.token_ids[record.prompt_length :].tolist()
    expected = torch.stack([layer[0] for layer in out.attentions]).float().numpy()  # [layer, head, q_pos, k_pos]
    assert np.abs(record.to_attention_record().attention - expected).max() <= 1e-5


# ---- choosing a budget -------------------------------------------------------------------------------------
LAYOUT = KVLayout(n_layers=3, n_kv_heads=2, head_dim=8, windows=(0, 16, 0))  # layer 1 slides: never chosen


def test_the_highest_scores_are_full_with_ties_to_the_lower_layer_and_nan_last():
    scores = np.array([[0.5, np.nan], [9.0, 9.0], [0.5, 0.7]])
    budget = choose_budget(scores, LAYOUT, share=0.5, sink=1, window=2)  # 2 of the 4 global heads
    assert budget.full.tolist() == [[True, False], [False, False], [False, True]]
    assert choose_budget(scores, LAYOUT, share=0.75, sink=1, window=2).full[0].tolist() == [True, False]
    assert budget.share == 0.5 and budget.streamed.tolist() == [[False, True], [False, False], [True, False]]


def test_a_budget_in_bytes_keeps_as_many_full_heads_as_fit():
    scores = np.array([[4.0, 3.0], [0.0, 0.0], [2.0, 1.0]])
    tokens, per_key = 100, 2 * 8 * 4
    streaming = (4 * 3 + 2 * 15) * per_key  # 4 global heads of sink 1 + window 2, 2 sliding heads of 15 keys
    budget = choose_budget(scores, LAYOUT, bytes=streaming + 2 * 97 * per_key + 5, tokens=tokens, sink=1, window=2)
    assert budget.full.tolist() == [[True, True], [False, False], [False, False]]
    assert kv_bytes(budget, tokens, 8) == streaming + 2 * 97 * per_key


def test_random_budgets_are_seeded_and_keep_the_share():
    first = random_budget(LAYOUT, share=0.5, seed=3, sink=1, window=2)
    assert np.array_equal(first.full, random_budget(LAYOUT, share=0.5, seed=3, sink=1, window=2).full)
    assert int(first.full.sum()) == 2 and not first.full[1].any()
    draws = {tuple(random_budget(LAYOUT, share=0.5, seed=seed, sink=1, window=2).full.ravel()) for seed in range(8)}
    assert len(draws) > 1


@pytest.mark.parametrize(("kwargs", "expect"), [
    ({"share": 1.5}, "between 0 and 1"),
    ({"share": float("nan")}, "between 0 and 1"),
    ({"bytes": 10, "tokens": 100}, "below what sink"),
    ({"share": 0.5, "window": 0}, "window >= 1"),
    ({"share": 0.5, "bytes": 10}, "one of them"),
])
def test_bad_budgets_are_refused(kwargs, expect):
    with pytest.raises(AttnscopeError, match=expect):
        choose_budget(np.zeros((3, 2)), LAYOUT, **{"sink": 1, "window": 2, **kwargs})


def test_scores_per_kv_group_are_the_highest_of_its_query_heads_whichever_way_they_come(tmp_path):
    """A ``HeadScores``, its per-head Parquet and its per-group Parquet give the same ``[layer, kv_head]``: the
    highest score of the group's query heads (2 per group here; a NaN head left out)."""
    from attnscope.analysis.head_functions import HeadScores
    from attnscope.capture.kv_budget import kv_head_scores

    retrieval = np.array([[0.1, 0.9, 0.3, 0.2], [0.5, 0.4, np.nan, 0.7]])
    scores = HeadScores(model="m", scores={"retrieval": retrieval}, n_kv_heads=2)
    expected = np.array([[0.9, 0.3], [0.5, 0.7]])
    assert np.allclose(kv_head_scores(scores), expected)
    assert np.allclose(kv_head_scores(scores.save(tmp_path / "head.parquet", "head")), expected)
    whole = HeadScores(model="m", scores={"retrieval": np.nan_to_num(retrieval)}, n_kv_heads=2)  # the group file's
    assert np.allclose(kv_head_scores(whole.save(tmp_path / "group.parquet", "kv_head")), expected)  # _max: NaN-less


def test_scores_of_another_model_are_refused():
    with pytest.raises(AttnscopeError, match="another model"):
        choose_budget(np.zeros((4, 2)), LAYOUT, share=0.5)


def test_a_model_without_attnscope_s_attention_is_refused(tiny):
    from attnscope.capture.kv_budget import BudgetedCache

    loaded = tiny("llama")
    budget = one_streamed_head_per_global_layer(kv_layout(loaded))
    eager = loaded.model.config.__class__(**loaded.model.config.to_dict())
    eager._attn_implementation = "eager"
    with pytest.raises(AttnscopeError, match="attnscope's attention function"):
        BudgetedCache(eager, budget)
    with pytest.raises(AttnscopeError, match="KV budget is for"):
        budgeted_cache(loaded, KVBudget(np.ones((3, 2), dtype=bool), SINK, WINDOW, (0, 0, 0)))


def test_a_cache_handed_to_another_attention_function_fails_in_one_line(tiny):
    loaded = tiny("llama")
    cache = budgeted_cache(loaded, one_streamed_head_per_global_layer(kv_layout(loaded)))
    ids = torch.tensor([loaded.tokenizer(PROMPT)["input_ids"]])
    loaded.model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode(), pytest.raises(AttnscopeError, match="only with attnscope's attention function"):
            loaded.model(input_ids=ids, use_cache=True, **{cache_keyword(loaded.model.forward): cache})
    finally:
        loaded.model.set_attn_implementation("attnscope")


# ---- the command line ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scores_files(tiny, tmp_path_factory):
    """Per-query-head score tables as ``head-functions --save`` writes them: the tiny Llama's shape, and another."""
    root = tmp_path_factory.mktemp("kv-scores")
    n_layers, n_heads = 2, 4

    def table(layers: int, path) -> str:
        layer, head = np.meshgrid(np.arange(layers), np.arange(n_heads), indexing="ij")
        pd.DataFrame({"layer": layer.ravel(), "head": head.ravel(), "kv_head": head.ravel() // 2,
                      "window": 0, "retrieval": np.linspace(0, 1, layers * n_heads)}).to_parquet(path)
        return str(path)

    return {"model": tiny.folder("llama"), "scores": table(n_layers, root / "ok.parquet"),
            "other": table(5, root / "other.parquet")}


def test_generate_with_a_kv_budget_on_the_command_line(scores_files, tmp_path, capsys):
    html = tmp_path / "steps.html"
    code = exit_code(["generate", PROMPT, "-m", scores_files["model"], "-n", "4", "--kv-budget", "0.5",
                      "--kv-scores", scores_files["scores"], "--kv-sink", "2", "--kv-window", "4", "--json",
                      "--save", str(tmp_path / "gen.safetensors"), "--html", str(html)])
    out = capsys.readouterr().out
    assert code == 0
    assert json.loads(out.splitlines()[-1])["kv_budget"]["streamed"] == [[0, 0], [0, 1]]
    assert "KV budget" in html.read_text(encoding="utf-8")  # the step view's heading names it
    record = attnscope.GenerationRecord.load(tmp_path / "gen.safetensors")
    assert record.settings["kv_budget"]["streamed"] == [[0, 0], [0, 1]]  # the lowest scores stream
    assert "KV budget" in record.method


@pytest.mark.parametrize(("args", "expect"), [
    (["--kv-budget", "1.5"], "between 0 and 1"),
    (["--kv-budget", "-0.2"], "between 0 and 1"),
    (["--kv-budget", "lots"], "--kv-budget takes"),
    (["--kv-budget", "100"], "below what sink + window"),
    (["--kv-budget", "0.5", "--kv-scores", "{other}"], "another model"),
    (["--kv-budget", "0.5", "--kv-window", "64"], "covers the whole text"),
    (["--kv-budget", "0.5", "--kv-window", "0"], "window >= 1"),
    (["--kv-budget", "0.5", "--kv-score", "induction"], "no score 'induction'"),
    (["--kv-budget", "0.5", "--kv-scores", "{missing}"], "no scores file"),
])
def test_bad_kv_budgets_are_one_line_exit_2_and_write_nothing(args, expect, scores_files, tmp_path, capsys):
    given = {"--kv-scores"} & set(args)
    argv = ["generate", PROMPT, "-m", scores_files["model"], "-n", "4", "--kv-sink", "2",
            *([] if given else ["--kv-scores", scores_files["scores"]]),
            *[arg.format(missing=tmp_path / "none.parquet", **scores_files) for arg in args],
            "--save", str(tmp_path / "out" / "gen.safetensors")]
    assert_one_error_line(exit_code(argv), capsys.readouterr().err, expect)
    assert not (tmp_path / "out").exists()


def test_a_share_out_of_range_is_named_before_the_missing_scores_file(scores_files, capsys):
    """The budget's own value is checked first: without --kv-scores, a share of 1.5 is still called out of range."""
    argv = ["generate", PROMPT, "-m", scores_files["model"], "-n", "4", "--kv-budget", "1.5"]
    assert_one_error_line(exit_code(argv), capsys.readouterr().err, "between 0 and 1")


def test_a_groups_locality_is_its_lowest_query_head_and_a_group_file_holds_only_the_max(tmp_path):
    """The streaming choice reads the share a sink + window keeps; a KV group streams only as well as its worst query
    head (the min), from a ``HeadScores`` or a per-head file; a per-group file (max and mean only) says so. The curve
    reads the per-group file's retrieval score, as the cache does."""
    from attnscope.analysis.head_functions import HeadScores
    from attnscope.capture.kv_budget import kv_head_scores
    from attnscope.experiments.kv_curve import CurveSettings, _given_scores

    name = "locality_k4_w64"
    locality = np.array([[0.1, 0.9, 0.3, 0.2], [0.5, 0.4, np.nan, 0.7]])
    scores = HeadScores(model="m", scores={name: locality, "retrieval": locality}, n_kv_heads=2)
    expected = np.array([[0.1, 0.2], [0.4, 0.7]])
    assert np.allclose(kv_head_scores(scores, name, reduce="min"), expected)
    assert np.allclose(kv_head_scores(scores.save(tmp_path / "head.parquet", "head"), name, reduce="min"), expected)
    group_file = HeadScores(model="m", scores={name: np.nan_to_num(locality), "retrieval": np.nan_to_num(locality)},
                            n_kv_heads=2).save(tmp_path / "group.parquet", "kv_head")
    with pytest.raises(AttnscopeError, match="holds each group's max"):
        kv_head_scores(group_file, name, reduce="min")
    layout = KVLayout(n_layers=2, n_kv_heads=2, head_dim=8, windows=(0, 0), group=2)
    given = _given_scores(group_file, layout, CurveSettings())
    assert list(given) == ["retrieval"] and np.allclose(given["retrieval"], [[0.9, 0.3], [0.5, 0.7]])
