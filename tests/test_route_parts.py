"""The routes' proximities found without forming every part (attribution/route_parts.py) equal the proximities of
the formed parts, ``|y| − |y − z|`` summed per coordinate in float64, with grouped heads, frozen norms (scaled, and
centred like a LayerNorm's), coordinates of the sum that are exactly 0, and parts that overshoot the sum."""

from __future__ import annotations

import pytest
import torch

from attnscope.attribution import route_parts
from attnscope.attribution.route_parts import OutWeights, layers_part_proximities, part_proximities, value_peaks
from attnscope.attribution.terms import FrozenNorm

N_HEADS, N_KV, D_HEAD, D_MODEL, N_KEYS, N_ROWS = 6, 2, 8, 48, 70, 5


def by_forming(probs, values, weight, whole, frozen) -> torch.Tensor:
    """Every part formed in float64 ``[head, row, key, d_model]``, through the row's norm; proximity ``[row, key,
    head]``."""
    group = N_HEADS // N_KV
    outputs = torch.stack([values[h // group].double() @ weight[h].double() for h in range(N_HEADS)])  # [h, k, m]
    parts = probs.double()[..., None] * outputs[:, None]  # [head, row, key, d_model]
    if frozen:
        gains = torch.stack([f.gain for f in frozen]).double()[None, :, None, :]
        if frozen[0].centred:
            parts = parts - parts.mean(-1, keepdim=True)
        parts = parts * gains
    y = whole.double()[None, :, None, :]
    return (y.abs() - (y - parts).abs()).sum(-1).clamp_min(0.0).permute(1, 2, 0)


def case(seed: int, *, zeros: bool = False):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn((N_HEADS, N_ROWS, N_KEYS), generator=generator) * 3
    logits[:, :, 0] += 4.0  # a sink most heads attend to strongly: heavy parts
    logits[:, :, -20:] -= 12.0  # keys every head nearly ignores, as most keys of a long text: no prefix needed there
    probs = logits.softmax(-1)
    values = torch.randn((N_KV, N_KEYS, D_HEAD), generator=generator)
    weight = torch.randn((N_HEADS, D_HEAD, D_MODEL), generator=generator) / D_HEAD**0.5
    whole = torch.randn((N_ROWS, D_MODEL), generator=generator)
    whole[:, :3] *= 1e-3  # coordinates a light part can overshoot
    if zeros:
        whole[:, 5:8] = 0.0
    return probs, values, weight, whole


def frozen_norms(kind: str, whole: torch.Tensor) -> list[FrozenNorm]:
    if kind == "none":
        return []
    gains = torch.linspace(0.5, 2.0, D_MODEL, dtype=torch.float64)
    return [FrozenNorm(gains * (1.0 + r), kind == "centred", None, 1.0 + r) for r in range(whole.shape[0])]


@pytest.mark.parametrize("kind", ["none", "scaled", "centred"])
@pytest.mark.parametrize("zeros", [False, True])
def test_proximities_equal_those_of_the_formed_parts(kind, zeros):
    probs, values, weight, whole = case(7, zeros=zeros)
    frozen = frozen_norms(kind, whole)
    weights = OutWeights.of(weight, N_KV)
    got = part_proximities(probs, values, weights, value_peaks(values, weights), whole, frozen, budget=1 << 12)
    expected = by_forming(probs, values, weight, whole, frozen)
    assert got.shape == (N_ROWS, N_KEYS, N_HEADS)
    torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=1e-5)


def test_the_case_takes_every_path(monkeypatch):
    """The shortcut is exercised: a prefix shorter than every coordinate, computed at some keys and not at others,
    some heavy parts formed in full and most parts light (a test whose parts were all formed would check nothing
    new)."""
    probs, values, weight, whole = case(7)
    weights = OutWeights.of(weight, N_KV)
    seen = {}
    formed, prefix = route_parts._formed, route_parts._prefix

    def spy_formed(result, by_key, values, joined, whole, gains, centred, heavy, budget):
        seen["heavy"] = int(heavy.sum())
        return formed(result, by_key, values, joined, whole, gains, centred, heavy, budget)

    def spy_prefix(near, by_key, values, joined, whole, gains, centred, order, lengths, reaching, budget):
        seen["lengths"], seen["reaching"] = lengths, int(reaching.sum())
        return prefix(near, by_key, values, joined, whole, gains, centred, order, lengths, reaching, budget)

    monkeypatch.setattr(route_parts, "_formed", spy_formed)
    monkeypatch.setattr(route_parts, "_prefix", spy_prefix)
    part_proximities(probs, values, weights, value_peaks(values, weights), whole, [], budget=1 << 12)
    assert 0 < seen["heavy"] < probs.numel() // 4
    assert 0 < seen["lengths"][0] < D_MODEL and 0 < seen["reaching"] < N_KEYS


def test_peaks_are_the_largest_coordinate_of_each_heads_output():
    _, values, weight, _ = case(3)
    group = N_HEADS // N_KV
    expected = torch.stack([(values[h // group] @ weight[h]).abs().amax(-1) for h in range(N_HEADS)])
    torch.testing.assert_close(value_peaks(values, OutWeights.of(weight, N_KV)), expected)


@pytest.mark.parametrize("kind", ["none", "scaled", "centred"])
@pytest.mark.parametrize("budget", [1 << 16, 1 << 9])  # every layer at once; one layer's rows a few at a time
def test_several_layers_at_once_equal_each_layers_formed_parts(kind, budget):
    """Three layers with their own weights, values, rows and norms in one call (a generation's step computes its
    position's row at every layer together): each layer's proximities equal its parts formed in float64, whether
    its blocks hold several layers or a few rows of one."""
    cases = [case(seed, zeros=seed == 11) for seed in (7, 11, 13)]
    frozen = [frozen_norms(kind, whole) for *_, whole in cases]
    weights = [OutWeights.of(weight, N_KV) for _, _, weight, _ in cases]
    gains = torch.stack([torch.stack([f.gain.float() for f in norms]) if norms else torch.ones_like(c[3])
                         for norms, c in zip(frozen, cases)])
    got = layers_part_proximities(torch.stack([c[0] for c in cases]), torch.stack([c[1] for c in cases]),
                                  torch.stack([w.joined for w in weights]),
                                  torch.stack([value_peaks(c[1], w) for c, w in zip(cases, weights)]),
                                  torch.stack([c[3] for c in cases]), gains, kind == "centred", budget)
    assert got.shape == (3, N_ROWS, N_KEYS, N_HEADS)
    for layer, ((probs, values, weight, whole), norms) in enumerate(zip(cases, frozen)):
        expected = by_forming(probs, values, weight, whole, norms)
        torch.testing.assert_close(got[layer].double(), expected, atol=2e-6, rtol=1e-5)
