"""Is a route faithful (``attnscope routes --evaluate``): the head and token scores read off a route equal a hand
computation on a hand-built graph; the unpruned flow equals full-matrix rollout of the importances written here and
the kept-edge flow of the graph kept at tau 0; the check's numbers for one prompt are recomputed here (erasure by
hand, Spearman by scipy); the command writes its files and refuses bad input in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

import attnscope
from attnscope.attribution.route_scores import head_scores, route_flow, route_scores, token_scores
from attnscope.attribution.routes import Edge, Node, Routes, routes_and_tensors
from attnscope.experiments.routes_check import HEAD_SCORES, TOKEN_SCORES, check_routes, ranked_positions
from attnscope.experiments.tasks import ioi_next_tokens

from .conftest import SENTENCES
from .test_cli_errors import assert_one_error_line, exit_code, must_not_run


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return attnscope.load_model(str(tiny_model_dir("llama")))


def _attention(layer: int, source: int, target: int, heads: tuple[float, ...]) -> Edge:
    return Edge(Node(layer, source, "residual"), Node(layer, target, "attention"), sum(heads), "attention", heads)


def _ffn(layer: int, position: int, ffn: float | None, kept: float | None) -> list[Edge]:
    attention, block, out = Node(layer, position, "attention"), Node(layer, position, "ffn"), Node(layer + 1, position,
                                                                                                     "residual")
    edges = [] if ffn is None else [Edge(attention, block, ffn, "ffn"), Edge(block, out, ffn, "ffn")]
    return edges + ([] if kept is None else [Edge(attention, out, kept, "residual")])


def _residual(layer: int, position: int, share: float) -> Edge:
    return Edge(Node(layer, position, "residual"), Node(layer, position, "attention"), share, "residual")


def hand_graph() -> Routes:
    """Two layers, two heads, three tokens, the route of position 2. Layer 1: the feed-forward block (0.3) and the
    residual (0.7) both kept; token 0 reaches position 2 (heads 0.4 + 0.1), position 2 itself (0.0 + 0.1) and the
    residual (0.4). Layer 0 at position 2: only the residual around the feed-forward block is kept (0.9); token 1
    (0.6 + 0.0) and the residual (0.4); at position 0: both halves (0.5, 0.5), itself (0.2 + 0.1), residual 0.7."""
    edges = [*_ffn(1, 2, 0.3, 0.7), _attention(1, 0, 2, (0.4, 0.1)), _attention(1, 2, 2, (0.0, 0.1)),
             _residual(1, 2, 0.4), *_ffn(0, 2, None, 0.9), _attention(0, 1, 2, (0.6, 0.0)), _residual(0, 2, 0.4),
             *_ffn(0, 0, 0.5, 0.5), _attention(0, 0, 0, (0.2, 0.1)), _residual(0, 0, 0.7)]
    return Routes("hand", ("a", "b", "c"), 2, "d", 0.04, 2, 2, tuple(edges))


def test_token_scores_of_a_hand_built_graph_equal_the_hand_computation():
    # mass 1 at the output; attention(1, 2) gets 0.3 (through the feed-forward node, which passes all it gets) + 0.7;
    # residual(1, 0) gets 0.5, residual(1, 2) 0.1 + 0.4; attention(0, 2) gets 0.5 * 0.9 = 0.45, attention(0, 0)
    # 0.5 * (0.5 + 0.5); token 0: 0.5 * (0.3 + 0.7), token 1: 0.45 * 0.6, token 2: 0.45 * 0.4
    np.testing.assert_allclose(token_scores(hand_graph()), [0.5, 0.27, 0.18], atol=1e-12)


def test_head_scores_of_a_hand_built_graph_equal_the_hand_computation():
    np.testing.assert_allclose(head_scores(hand_graph()), [[0.6 + 0.2, 0.0 + 0.1], [0.4 + 0.0, 0.1 + 0.1]], atol=1e-12)


def rollout_by_hand(tensors, position: int) -> tuple[np.ndarray, np.ndarray]:
    """Every row's importances as full matrices, rolled out top-down: token scores and flow head scores."""
    n = tensors.residuals[0].shape[0]
    mass = np.eye(n)[position]
    heads = []
    for layer in reversed(range(tensors.n_layers)):
        found = tensors.importance(layer, list(range(n)))
        per_head = found.heads.double().numpy()  # [row, source, head]
        mixing = per_head.sum(-1) + np.diag(found.residual.double().numpy())  # [row, source]
        at_attention = mass * (found.ffn + found.ffn_residual).double().numpy()
        heads.append(np.einsum("r,rsh->h", at_attention, per_head))
        mass = at_attention @ mixing
    return mass, np.stack(heads[::-1])


def test_the_unpruned_flow_equals_full_rollout_and_the_graph_kept_at_tau_zero(tiny_llama):
    graph, tensors = routes_and_tensors(tiny_llama, SENTENCES[2], tau=0.0)
    tokens, heads = route_flow(tensors, graph.position)
    by_hand_tokens, by_hand_heads = rollout_by_hand(tensors, graph.position)
    # float32 importances: rows computed in other chunks (here every row at once) differ by float32 rounding
    np.testing.assert_allclose(tokens, by_hand_tokens, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(heads, by_hand_heads, rtol=1e-5, atol=1e-9)
    assert tokens.sum() == pytest.approx(1.0, abs=1e-5) and (tokens >= 0).all()
    np.testing.assert_allclose(token_scores(graph), tokens, atol=1e-6)  # every edge with any importance is kept
    pruned = attnscope.routes(tiny_llama, SENTENCES[2], tau=0.1)
    assert token_scores(pruned).sum() <= 1.0 + 1e-9
    assert set(np.flatnonzero(head_scores(pruned))) <= set(np.flatnonzero(heads > 0))


def erasure_by_hand(loaded, ids: list[int], target: int, ranked: np.ndarray) -> np.ndarray:
    def log_prob(tokens: list[int]) -> float:
        with torch.inference_mode():
            logits = loaded.model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1].double()
        return float(logits.log_softmax(-1)[target])

    whole = log_prob(ids)
    return np.array([whole - log_prob(ids[:j] + ids[j + 1:]) for j in ranked])


def test_the_checks_numbers_for_one_prompt_are_recomputed_independently(tiny_llama):
    check = check_routes(tiny_llama, tasks=("ioi",), n_prompts=3, n_resamples=50)
    data = json.loads(json.dumps(check.to_dict()))
    n_layers, n_heads = tiny_llama.config.num_hidden_layers, tiny_llama.config.num_attention_heads
    rows = check.prompts["ioi"]
    assert len(rows) == 3 and data["tasks"]["ioi"]["n_prompts"] == 3 == data["tasks"]["ioi"]["n_token_prompts"]
    prompt = ioi_next_tokens(tiny_llama, 3)[1]
    row = rows[1]
    ranked = ranked_positions(tiny_llama, prompt.ids)
    assert set(row.heads) == set(HEAD_SCORES) and set(row.tokens) == set(TOKEN_SCORES)
    assert all(s.shape == (n_layers, n_heads) for s in [*row.heads.values(), row.patching])
    assert all(s.shape == ranked.shape for s in [*row.tokens.values(), row.erasure]) and len(ranked) >= 3
    scores = route_scores(tiny_llama, list(prompt.ids))
    erasure = erasure_by_hand(tiny_llama, list(prompt.ids), prompt.target, ranked)
    np.testing.assert_allclose(row.erasure, erasure, atol=1e-4)
    kept = data["per_prompt"]["ioi"][1]
    assert kept["tokens_spearman"]["route_flow"] == pytest.approx(
        spearmanr(scores.flow_tokens[ranked], erasure).statistic, abs=1e-4)
    assert kept["heads_spearman"]["route_flow"] == pytest.approx(
        spearmanr(scores.flow_heads.ravel(), row.patching.ravel()).statistic, abs=1e-4)
    assert kept["heads_spearman_magnitude"]["dla"] == pytest.approx(
        spearmanr(np.abs(row.heads["dla"]).ravel(), np.abs(row.patching).ravel()).statistic, abs=1e-4)
    assert kept["tokens_spearman_magnitude"]["route_flow"] == pytest.approx(
        spearmanr(scores.flow_tokens[ranked], np.abs(erasure)).statistic, abs=1e-4)
    summary = data["tasks"]["ioi"]
    means = np.mean([p["tokens_spearman"]["alti"] for p in data["per_prompt"]["ioi"]])
    assert summary["tokens"]["alti"]["spearman"][0] == pytest.approx(means, abs=1e-4)
    for interval in (summary["heads"]["route"]["spearman"], summary["tokens"]["route"]["spearman"]):
        assert interval[1] <= interval[0] <= interval[2]


def test_the_evaluate_command_writes_its_json_and_figure(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert exit_code(["routes", "--evaluate", "--prompts", "2", "--tasks", "ioi", "--bootstrap", "20", "-m",
                      str(tiny_model_dir("llama")), "-o", str(out)]) == 0
    data = json.loads((out / "routes_check.json").read_text())
    assert set(data["tasks"]) == {"ioi"} and data["tasks"]["ioi"]["n_prompts"] == 2 and data["tau"] == 0.04
    assert (out / "routes_check.png").stat().st_size > 0 and (out / "routes_check.svg").stat().st_size > 0
    assert "route flow (unpruned): Spearman" in capsys.readouterr().out


EVALUATE_CASES = {
    "an encoder model": (["--evaluate", "--model", "{bert}"], "not a decoder-only"),
    "an unknown task": (["--evaluate", "--tasks", "brown,trivia"], "unknown task(s) trivia"),
    "one prompt": (["--evaluate", "--prompts", "1"], "at least 2 prompts"),
    "a text as well": (["--evaluate", "the cat sat"], "leave out a text"),
    "a position": (["--evaluate", "--position", "3"], "leave out --position"),
    "a page option": (["--evaluate", "--png"], "leave out --png"),
    "a bad tau": (["--evaluate", "--tau", "1.5"], "tau must be"),
    "check options without --evaluate": (["the cat sat", "--quick"], "--quick go with --evaluate"),
}


@pytest.mark.parametrize("name", list(EVALUATE_CASES))
def test_bad_evaluate_input_is_one_line(name, tiny_model_dir, tmp_path, capsys, monkeypatch):
    extra, expect = EVALUATE_CASES[name]
    must_not_run(monkeypatch, "attnscope.experiments.routes_check.prompt_scores")
    argv = ["routes", "--model", str(tiny_model_dir("llama")),
            *[value.format(bert=tiny_model_dir("bert")) for value in extra], "-o", str(tmp_path / "out")]
    assert_one_error_line(exit_code(argv), capsys.readouterr().err, expect)
    assert not (tmp_path / "out").exists()
