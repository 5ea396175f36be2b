"""Per-step work of a generation with recorders (issue 47, item 2): what each decoding step does beyond plain decoding
stays small, and the paths that moved out of the steps compute what they computed before. Timings belong in
benchmarks/generate_long.py; these tests count the work and compare results with direct computations. Tiny Llama
with grouped key/value heads; layers and heads 0-indexed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnscope
import attnscope.capture.generate as generate_module
from attnscope.attribution.terms import per_source_terms
from attnscope.capture.recorders import expand_kv_heads, per_head_out_proj

PROMPT = "The cat sat on the mat. The dog sat on the rug. The cat"
NEW_TOKENS = 70


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    loaded = attnscope.load_model(str(tiny_model_dir("llama")))
    generator = torch.Generator().manual_seed(0)  # default initialisation leaves attention almost uniform
    with torch.no_grad():
        for parameter in loaded.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return loaded


def test_value_norms_are_taken_once_per_layer_and_equal_the_norms_of_the_cached_values(tiny_llama, monkeypatch):
    """Each step used to take its new key's ``||v W_O^h||`` in its own small products (five operations per layer and
    step); the values are now kept and their norms taken at the end. The norms equal ``||v_j W_O^h||`` computed
    directly from the key/value cache of a plain cached run of the same text."""
    calls = []
    original = generate_module.value_norms

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(generate_module, "value_norms", counted)
    record = attnscope.generate(tiny_llama, PROMPT, max_new_tokens=NEW_TOKENS, progress=False)
    n_layers = record.arrays["rows"].shape[0]
    assert record.n_steps == NEW_TOKENS and len(calls) == n_layers, "a product per layer, not per layer and step"
    with torch.inference_mode():
        cache = tiny_llama.model(input_ids=torch.tensor([record.token_ids.tolist()]), use_cache=True).past_key_values
    sites = sorted((s for s in tiny_llama.sites.values() if s.kind == "self"), key=lambda s: s.layer)
    n_heads = record.arrays["value_norms"].shape[1]
    for site in sites:
        values = expand_kv_heads(cache.layers[site.layer].values, n_heads)[0].double()  # [head, position, d_head]
        assert cache.layers[site.layer].values.shape[1] < n_heads, "the check needs grouped key/value heads"
        per_head = per_head_out_proj(site, n_heads).double()  # [head, d_head, d_model]
        expected = torch.linalg.vector_norm(values @ per_head, dim=-1).numpy()  # [head, position]
        np.testing.assert_allclose(record.arrays["value_norms"][site.layer], expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("n_kv_heads", [1, 3, 6])
def test_per_source_terms_of_grouped_values_equal_the_expanded_product(n_kv_heads):
    """What each source adds to a head's logit term, from grouped values (a generation's attribution keeps them so)
    equals the product of the values expanded to the query heads, in float64, as single-pass attribution computes it."""
    generator = torch.Generator().manual_seed(n_kv_heads)
    n_heads, n_sources, d_head = 6, 11, 8
    values = torch.randn((n_kv_heads, n_sources + 3, d_head), generator=generator)  # more sources than asked
    readout = torch.randn((n_heads, d_head), generator=generator)
    expanded = expand_kv_heads(values[None], n_heads)[0][:, :n_sources].double()  # [head, source, d_head]
    expected = (expanded @ readout.double()[:, :, None])[..., 0]
    got = per_source_terms(values.double(), readout, n_sources)
    assert got.dtype == torch.float64 and got.shape == (n_heads, n_sources)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(per_source_terms(values, readout, n_sources), expected, rtol=1e-12, atol=1e-12)
