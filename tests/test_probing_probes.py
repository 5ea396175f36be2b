"""Attention-only probes: features laid out as documented, and the probes beat their baselines on a synthetic signal."""

from __future__ import annotations

import numpy as np
import pytest

from attnscope.errors import AttnscopeError
from attnscope.probing.alignment import AlignedSentence
from attnscope.probing.probes import (
    MAX_OFFSET,
    ProbeResult,
    collect,
    evaluate_over_seeds,
    evaluate_probes,
    held_out_sentences,
    offset_features,
    pair_features,
)
from attnscope.probing.treebank import ROOT, sentence_from_units

RELATIONS = ("r0", "r1", "r2")
N_LAYERS, N_HEADS = 2, 3


def test_pair_features_are_every_head_forward_then_backward():
    attention = np.arange(2 * 3 * 4 * 4, dtype=np.float32).reshape(2, 3, 4, 4)  # [layer, head, word, word]
    features = pair_features(attention, np.array([0, 2]), np.array([3, 1]))
    assert features.shape == (2, 2 * 2 * 3)
    np.testing.assert_array_equal(features[0, :6], attention[:, :, 0, 3].ravel())
    np.testing.assert_array_equal(features[0, 6:], attention[:, :, 3, 0].ravel())
    np.testing.assert_array_equal(features[1, 6:], attention[:, :, 1, 2].ravel())


def test_offset_features_are_clipped_one_hot():
    features = offset_features(np.array([-30, -1, 0, 2, 30]))
    assert features.shape == (5, 2 * MAX_OFFSET + 1)
    assert features.argmax(axis=1).tolist() == [0, MAX_OFFSET - 1, MAX_OFFSET, MAX_OFFSET + 2, 2 * MAX_OFFSET]
    assert (features.sum(axis=1) == 1).all()


def test_train_and_test_sentences_are_a_seeded_split():
    split = held_out_sentences(50, 0.2, seed=3)
    assert split.sum() == 10 and (split == held_out_sentences(50, 0.2, seed=3)).all()
    assert not (split == held_out_sentences(50, 0.2, seed=4)).all()
    with pytest.raises(AttnscopeError):
        held_out_sentences(50, 1.5)


def random_tree(rng: np.random.Generator, n: int):
    """A random tree: words join in a random order, each attached to a word that joined before it."""
    order = rng.permutation(n)
    heads = [ROOT] * n
    for position, word in enumerate(order[1:], 1):
        heads[word] = int(order[rng.integers(position)])
    relations = [RELATIONS[rng.integers(3)] if h != ROOT else "root" for h in heads]
    return sentence_from_units([(f"w{w}", True, [(f"w{w}", heads[w], relations[w], "_")]) for w in range(n)])


def synthetic(rng: np.random.Generator, sentence, signal: bool) -> AlignedSentence:
    """Noise attention; with ``signal``, head ``r`` of layer 0 sends each word of relation ``r`` to its head."""
    n = len(sentence)
    attention = rng.random((N_LAYERS, N_HEADS, n, n)).astype(np.float32)
    if signal:
        for dep, head, relation in sentence.arcs():
            attention[0, RELATIONS.index(relation), dep, head] += 10.0
    attention /= attention.sum(axis=-1, keepdims=True)
    return AlignedSentence(sentence, attention, np.ones(n, dtype=bool))


def test_probes_beat_their_baselines_on_a_synthetic_signal():
    rng = np.random.default_rng(0)
    trees = [random_tree(rng, int(rng.integers(6, 12))) for _ in range(150)]
    is_test = held_out_sentences(len(trees), 0.2, seed=0)
    data = collect([synthetic(rng, tree, signal=True) for tree in trees], is_test)
    noise = collect([synthetic(rng, tree, signal=False) for tree in trees], is_test)  # a "re-initialised" model
    figures, sizes = evaluate_probes(data, noise)
    assert figures["edge_probe_acc"] > 0.95 > figures["edge_distance_acc"] + 0.1
    assert figures["edge_reinit_acc"] < 0.75
    assert figures["relation_probe_acc"] > 0.9 and figures["relation_distance_acc"] < 0.5
    assert figures["relation_majority_acc"] < 0.5 and figures["relation_reinit_acc"] < 0.5
    assert figures["uas"] > 0.9 and figures["uas_right_branching"] < 0.4 and figures["uas_reinit"] < 0.4
    assert figures["uas_distance"] < figures["uas"] - 0.3
    assert sizes["test_sentences"] == 30 and sizes["train_sentences"] == 120 and sizes["relation_classes"] == 3


def test_pairs_are_the_same_for_two_models_on_the_same_trees():
    rng = np.random.default_rng(1)
    trees = [random_tree(rng, 8) for _ in range(10)]
    is_test = held_out_sentences(10, 0.3, seed=0)
    first = collect([synthetic(rng, tree, True) for tree in trees], is_test).edge.arrays()
    second = collect([synthetic(rng, tree, False) for tree in trees], is_test).edge.arrays()
    assert (first["offsets"] == second["offsets"]).all() and (first["labels"] == second["labels"]).all()
    assert first["labels"].mean() == 0.5  # as many pairs without an arc as arcs


def test_over_five_seeds_each_split_is_its_own_and_figures_are_mean_and_range():
    rng = np.random.default_rng(0)
    trees = [random_tree(rng, int(rng.integers(6, 12))) for _ in range(120)]
    signal = [synthetic(rng, tree, signal=True) for tree in trees]
    noise = [synthetic(rng, tree, signal=False) for tree in trees]
    seeds = (0, 1, 2, 3, 4)
    per_seed, sizes = evaluate_over_seeds(signal, noise, seeds)
    # each seed's figures are exactly one split's: evaluate_probes on that seed's split and pairs
    for seed, figures in zip(seeds, per_seed):
        is_test = held_out_sentences(len(trees), 0.2, seed)
        assert figures == evaluate_probes(collect(signal, is_test, seed), collect(noise, is_test, seed), seed)[0]
    assert len({tuple(held_out_sentences(len(trees), 0.2, s)) for s in seeds}) == 5  # five different splits
    result = ProbeResult.over_seeds(per_seed, sizes, "synthetic", "gold", False, seeds)
    for key, spread in result.ranges().items():
        values = [figures[key] for figures in per_seed]
        assert spread == {"mean": round(sum(values) / 5, 4), "min": min(values), "max": max(values)}
        assert result.figures[key] == pytest.approx(sum(values) / 5)
    # the bands a planted signal must fall in on every seed, on any CPU: far above distance and noise
    low = result.ranges()
    assert low["edge_probe_acc"]["min"] > 0.9 and low["edge_reinit_acc"]["max"] < 0.8
    assert low["uas"]["min"] > 0.85 and low["uas_reinit"]["max"] < 0.45
    assert low["relation_probe_acc"]["min"] > 0.85 > low["relation_distance_acc"]["max"] + 0.3
    headline = result.headline()
    assert headline["seeds"] == list(seeds) and set(headline["over_seeds"]) == set(result.figures)
    frame = result.to_frame()
    assert (frame["min"] <= frame["test_accuracy"] + 1e-12).all() and (frame["test_accuracy"] <= frame["max"] + 1e-12).all()


def test_one_seed_keeps_the_figures_and_headline_of_a_single_split():
    rng = np.random.default_rng(2)
    trees = [random_tree(rng, 8) for _ in range(40)]
    signal = [synthetic(rng, tree, signal=True) for tree in trees]
    per_seed, sizes = evaluate_over_seeds(signal, None, (3,))
    direct = evaluate_probes(collect(signal, held_out_sentences(40, 0.2, 3), 3), None, 3)
    result = ProbeResult.over_seeds(per_seed, sizes, "m", "gold", False, (3,))
    assert (result.figures, result.sizes) == direct
    assert "over_seeds" not in result.headline() and "min" not in result.to_frame()
