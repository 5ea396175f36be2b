"""The cache layer that grows in place (capture/growing_cache.py) holds what transformers' concatenating layer holds,
through prompts, steps, buffer growth, crops and batch selection; generation swaps it in for the cache generate
prepares, and only then."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

import attnscope
from attnscope.capture.growing_cache import MIN_ROOM, GrowingLayer, growing_caches


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return attnscope.load_model(str(tiny_model_dir("llama")))


def states(generator: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn((2, 3, n, 4), generator=generator), torch.randn((2, 3, n, 4), generator=generator)


def test_a_growing_layer_returns_what_concatenation_returns():
    generator = torch.Generator().manual_seed(0)
    growing, plain = GrowingLayer(), DynamicLayer()
    for n in [7, 1, 1, MIN_ROOM, 1, 30, 1]:  # the prompt, steps, and a block that outgrows the buffer
        new = states(generator, n)
        got, expected = growing.update(*new), plain.update(*new)
        for g, e in zip(got, expected):
            assert torch.equal(g, e)
        assert growing.get_seq_length() == plain.get_seq_length()
    growing.crop(-5)
    plain.crop(-5)
    growing.batch_select_indices(torch.tensor([1]))
    plain.batch_select_indices(torch.tensor([1]))
    new = (states(generator, 2)[0][:1], states(generator, 2)[1][:1])
    for g, e in zip(growing.update(*new), plain.update(*new)):
        assert torch.equal(g, e)


def test_earlier_views_keep_their_values_as_the_layer_grows():
    """A recorder may hold the keys a call was given; later steps write after them, never over them."""
    generator = torch.Generator().manual_seed(1)
    layer = GrowingLayer()
    first, _ = layer.update(*states(generator, 3))
    kept = first.clone()
    for _ in range(MIN_ROOM):
        layer.update(*states(generator, 1))
    assert torch.equal(first, kept)


def test_generate_grows_its_own_cache_in_place_and_leaves_a_given_cache_alone(tiny_llama):
    seen = []
    model = tiny_llama.model
    prepare = type(model)._prepare_cache_for_generation

    def spy(self, generation_config, model_kwargs, *args, **kwargs):
        result = prepare(self, generation_config, model_kwargs, *args, **kwargs)
        seen.append(model_kwargs.get("cache"))
        return result

    original = type(model)._prepare_cache_for_generation
    type(model)._prepare_cache_for_generation = spy
    try:
        record = attnscope.generate(tiny_llama, "the cat sat", max_new_tokens=3, progress=False)
        with growing_caches(model):
            given = DynamicCache(config=model.config)
            model.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False, cache=given)
        model.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)  # outside: as before
    finally:
        type(model)._prepare_cache_for_generation = original
    assert record.n_steps == 3
    assert all(isinstance(layer, GrowingLayer) for layer in seen[0].layers)
    assert not any(isinstance(layer, GrowingLayer) for layer in given.layers)
    assert not any(isinstance(layer, GrowingLayer) for layer in seen[-1].layers)
