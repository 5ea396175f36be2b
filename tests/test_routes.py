"""Information-flow routes: the chunked, top-down computation equals a naive one written here (every part
``[q_pos, k_pos, head, d_model]`` materialised, the proximity and normalisation of Ferrando & Voita 2024 applied
directly) to 1e-5 on a tiny Llama with grouped heads, a tiny Gemma 3 whose sliding window is shorter than the
text, SmolLM2, Gemma 3 270M and Qwen2.5 0.5B (where installed); the walk keeps exactly the edges a naive walk over those numbers keeps; a previous-token head
feeding an induction head, set by hand in a two-layer GPT-2, is found as the route; the CLI refuses bad input in
one line."""

from __future__ import annotations

import json
import math
from collections import defaultdict, deque
from dataclasses import replace

import pytest
import torch

import attnscope
from attnscope import cli, load_model
from attnscope.attribution.routes import TAU, Node, route_tensors, routes, routes_and_tensors, walk
from attnscope.attribution.terms import blocks_by_layer
from attnscope.capture.attention import capture
from attnscope.cli.attribution import DEFAULT_TAU
from attnscope.models.loading import resolve_source
from attnscope.models.registry import ALIASES

from .conftest import SENTENCES, VOCAB, build_tiny_model

TOLERANCE = 1e-5
TEXT = SENTENCES[2]  # 17 tokens: longer than the tiny Gemma's window of 4


def _gemma3_config() -> object:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                            head_dim=8, intermediate_size=37, sliding_window=4, query_pre_attn_scalar=16,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention"], vocab_size=VOCAB,
                            pad_token_id=0, bos_token_id=101, eos_token_id=102, architectures=["Gemma3ForCausalLM"])


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tmp_path_factory):
    made: dict[str, object] = {}

    def get(kind: str):
        if kind not in made:
            folder = (tiny_model_dir("llama") if kind == "llama" else
                      build_tiny_model(kind, tmp_path_factory.mktemp(f"routes-{kind}"), _gemma3_config()))
            made[kind] = load_model(str(folder))
        return made[kind]
    return get


# ---- the naive reference -----------------------------------------------------------------------------------
def _rms_gain(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Gemma's RMS norm at inputs ``x`` ``[pos, d]`` as a per-row gain ``[pos, d]``: (1 + w) / rms(x)."""
    eps = float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 1e-6)))
    return (1.0 + norm.weight.double()) * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps)


@torch.no_grad()
def naive_importance(loaded, ids: list[int]) -> list[dict[str, torch.Tensor]]:
    """Per layer, every row: ``heads`` [q_pos, k_pos, head], ``residual``, ``ffn``, ``ffn_residual`` [q_pos], from the
    full attention (attnscope's eager capture), plain torch hooks on the blocks, the output projections and any
    post-attention norm, and every part materialised (float64)."""
    blocks = blocks_by_layer(loaded)
    kept: dict[tuple[str, int], torch.Tensor] = {}
    handles = []
    for layer, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(
            lambda m, a, kw, layer=layer: kept.__setitem__(("x", layer), (a[0] if a else kw["hidden_states"])[0]),
            with_kwargs=True))
        handles.append(block.register_forward_hook(
            lambda m, i, o, layer=layer: kept.__setitem__(("x", layer + 1), (o[0] if isinstance(o, tuple) else o)[0])))
        post = getattr(block, "post_attention_layernorm", None) if "gemma" in loaded.config.model_type else None
        if post is not None:
            handles.append(post.register_forward_hook(
                lambda m, i, o, layer=layer: kept.__setitem__(("post", layer), o[0])))
    sites = {site.layer: site for site in loaded.sites.values() if site.kind == "self"}
    for layer, site in sites.items():
        handles.append(site.out_proj.register_forward_hook(
            lambda m, i, o, layer=layer: kept.__setitem__(("o", layer), o[0])))
    try:
        with torch.inference_mode(), capture(loaded.sites, qkv=True) as session:
            loaded.model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    layers = session.layers("self")
    result = []
    for layer, captured in enumerate(layers):
        alpha = captured.attention[0].double()  # [head, q, k]
        values = captured.values[0].double()  # [head, k, d_head], expanded to the query heads
        n_heads, d_head = values.shape[0], values.shape[-1]
        weight = sites[layer].out_proj.weight.double()  # [d_model, head * d_head]
        f = torch.stack([values[h] @ weight[:, h * d_head:(h + 1) * d_head].T for h in range(n_heads)])  # [h, k, d]
        parts = torch.einsum("hij,hjd->ijhd", alpha, f)  # [q, k, head, d_model]
        x, after = kept[("x", layer)].double(), kept[("x", layer + 1)].double()
        if ("post", layer) in kept:
            norm = blocks[layer].post_attention_layernorm
            parts = parts * _rms_gain(norm, kept[("o", layer)])[:, None, None, :]
            y = x + kept[("post", layer)].double()
        else:
            y = x + kept[("o", layer)].double()
        l1 = lambda v: v.abs().sum(-1)
        heads = (l1(y)[:, None, None] - l1(y[:, None, None, :] - parts)).clamp_min(0)
        residual = (l1(y) - l1(y - x)).clamp_min(0)
        total = heads.sum((1, 2)) + residual
        ffn = (l1(after) - l1(y)).clamp_min(0)  # the ffn part is after - y: ||after - part|| = ||y||
        kept_y = (l1(after) - l1(after - y)).clamp_min(0)
        result.append({"heads": _share(heads, total[:, None, None]), "residual": _share(residual, total),
                       "ffn": _share(ffn, ffn + kept_y), "ffn_residual": _share(kept_y, ffn + kept_y)})
    return result


def _share(proximity: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Proximity over the row's total; a row whose proximities are all 0 (0/0) has importances 0 (the documented
    rule: no edge of it is kept)."""
    return torch.where(total > 0, proximity / total, torch.zeros_like(proximity))


def naive_walk(rows: list[dict[str, torch.Tensor]], position: int, tau: float) -> set[tuple]:
    """The edges (source, target, via) kept top-down from ``position`` over the naive importances, following kept
    edges only: a row's attention node is expanded when one of its feed-forward block's edges is kept."""
    kept: set[tuple] = set()
    reached = {position}
    for layer in reversed(range(len(rows))):
        below = set()
        for i in reached:
            r = rows[layer]
            attention, out = Node(layer, i, "attention"), Node(layer + 1, i, "residual")
            if r["ffn"][i] > tau:
                kept |= {(attention, Node(layer, i, "ffn"), "ffn"), (Node(layer, i, "ffn"), out, "ffn")}
            if r["ffn_residual"][i] > tau:
                kept.add((attention, out, "residual"))
            if r["ffn"][i] <= tau and r["ffn_residual"][i] <= tau:
                continue  # nothing kept leaves this attention node upward
            if r["residual"][i] > tau:
                kept.add((Node(layer, i, "residual"), attention, "residual"))
                below.add(i)
            for j in (r["heads"][i].sum(-1) > tau).nonzero()[:, 0].tolist():
                kept.add((Node(layer, j, "residual"), attention, "attention"))
                below.add(j)
        reached = below
    return kept


def _ids(loaded, text: str) -> list[int]:
    return list(loaded.tokenizer(text)["input_ids"])


def chunked_vs_naive_error(loaded, text: str) -> float:
    """The largest |chunked - naive| importance over every row and layer of ``text`` (benchmarks/routes.py too)."""
    ids = _ids(loaded, text)
    expected = naive_importance(loaded, ids)
    tensors, _ = route_tensors(loaded, ids, len(ids) - 1)
    error = 0.0
    for layer, reference in enumerate(expected):
        got = tensors.importance(layer, range(len(ids)))
        for name in ("heads", "residual", "ffn", "ffn_residual"):
            difference = float((getattr(got, name).double() - reference[name]).abs().max())
            error = max(error, float("inf") if math.isnan(difference) else difference)  # a NaN fails the bound
    return error


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_chunked_importance_equals_the_naive_parts(tiny, kind):
    loaded = tiny(kind)
    assert chunked_vs_naive_error(loaded, TEXT) <= TOLERANCE


@pytest.mark.parametrize("name", ["smollm2", "gemma3", "qwen0.5b"])
def test_chunked_importance_equals_the_naive_parts_on_shipped_models(name):
    if not ALIASES[name].installed:
        pytest.skip(f"{name} is not installed")
    text = "The capital of France is Paris, and the capital of Italy is"
    loaded = load_model(name)
    assert chunked_vs_naive_error(loaded, text) <= TOLERANCE
    assert across_vs_naive_error(loaded, text) <= TOLERANCE


def across_vs_naive_error(loaded, text: str) -> float:
    """The largest |batched - naive| importance over the rows of a few positions at every layer, each position's rows
    computed together (``importance_across``, as a generation's step computes its own position's)."""
    ids = _ids(loaded, text)
    expected = naive_importance(loaded, ids)
    tensors, _ = route_tensors(loaded, ids, len(ids) - 1)
    error = 0.0
    for position in (0, len(ids) // 2, len(ids) - 1):
        for layer, got in enumerate(tensors.importance_across(range(tensors.n_layers), position)):
            assert got.positions == (position,)
            for name in ("heads", "residual", "ffn", "ffn_residual"):
                difference = float((getattr(got, name)[0].double() - expected[layer][name][position]).abs().max())
                error = max(error, float("inf") if math.isnan(difference) else difference)
    return error


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_one_positions_rows_at_every_layer_together_equal_the_naive_parts(tiny, kind):
    """The tiny Gemma 3's layers see different bands of keys (sliding, full, sliding) and freeze their own
    post-attention norms: one batch still gives each layer's own numbers."""
    assert across_vs_naive_error(tiny(kind), TEXT) <= TOLERANCE


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_the_walk_keeps_the_naive_walks_edges(tiny, kind):
    loaded = tiny(kind)
    ids = _ids(loaded, TEXT)
    for tau in (0.02, TAU, 0.1, 0.3, 0.6):
        graph = routes(loaded, TEXT, tau=tau)
        got = {(e.source, e.target, e.via) for e in graph.edges}
        assert got == naive_walk(naive_importance(loaded, ids), len(ids) - 1, tau), tau
        assert all(e.importance > tau for e in graph.edges)


def reachable_from_output(graph) -> tuple[set[tuple], set[Node]]:
    """The edges ``(source, target, via)`` and nodes from which a path of ``graph``'s edges leads to its output node:
    a breadth-first search down from the output over the edges alone (not the walk's code)."""
    into = defaultdict(list)
    for edge in graph.edges:
        into[edge.target].append(edge)
    nodes, edges, queue = {graph.output}, set(), deque([graph.output])
    while queue:
        for edge in into[queue.popleft()]:
            edges.add((edge.source, edge.target, edge.via))
            if edge.source not in nodes:
                nodes.add(edge.source)
                queue.append(edge.source)
    return edges, nodes


# the cases (SmolLM2: a 0/0 row at layer 10 of " the" at tau 0.04; position 7 at tau 0.6), and the last of IOI
ROUTED = (("The keys to the cabinet that my grandmother left in the old house", -1),
          ("When Mary and John went to the store, John gave a drink to", 7),
          ("When Mary and John went to the store, John gave a drink to", -1))
ROUTED_TAUS = (0.6, 0.5, 0.1, TAU, 0.02)  # >= 0.5 (one part at most per row) down to below the paper's


@pytest.fixture(scope="module")
def qwen():
    if not ALIASES["qwen0.5b"].installed:
        pytest.skip("qwen0.5b is not installed")
    return load_model("qwen0.5b")


@pytest.mark.parametrize("model", ["smollm2", pytest.param("qwen", marks=pytest.mark.slow)])
def test_every_edge_and_node_of_a_route_leads_to_the_prediction(request, model):
    loaded = request.getfixturevalue(model)
    for text, position in ROUTED:
        graph, tensors = routes_and_tensors(loaded, text, position, tau=ROUTED_TAUS[0])
        for tau in ROUTED_TAUS:  # routes()'s walk again over the same pass (one forward pass per prompt)
            if tau != graph.tau:
                graph = replace(graph, tau=tau, edges=tuple(walk(tensors, graph.position, tau)))
            edges, nodes = reachable_from_output(graph)
            assert edges == {(e.source, e.target, e.via) for e in graph.edges}, (text, position, tau)
            assert len(edges) == len(graph.edges) and nodes == set(graph.nodes), (text, position, tau)
            assert all(e.importance > tau for e in graph.edges)


def test_each_rows_importance_sums_to_one_and_heads_split_the_edge(tiny):
    loaded = tiny("gemma3")
    ids = _ids(loaded, TEXT)
    tensors, _ = route_tensors(loaded, ids, len(ids) - 1)
    for layer in range(tensors.n_layers):
        rows = tensors.importance(layer, [0, 5, len(ids) - 1])
        torch.testing.assert_close(rows.heads.sum((1, 2)) + rows.residual, torch.ones(3), atol=1e-5, rtol=0)
        torch.testing.assert_close(rows.ffn + rows.ffn_residual, torch.ones(3), atol=1e-5, rtol=0)
        # keys outside the sliding window (4) of a sliding layer get nothing
        if layer != 1:
            assert float(rows.heads[2, : len(ids) - 4].abs().max()) == 0.0
    for edge in routes(loaded, TEXT, tau=0.02).edges:
        if edge.via == "attention":
            assert sum(edge.heads) == pytest.approx(edge.importance, abs=1e-5)


def test_the_result_converts_and_saves(tiny, tmp_path):
    graph = attnscope.routes(tiny("llama"), TEXT, position=-2, tau=0.05)
    assert graph.position == len(graph.tokens) - 2 and graph.edges
    assert graph.output in graph.nodes
    frame = graph.to_frame()
    assert len(frame) == len(graph.edges) and set(frame["via"]) <= {"attention", "residual", "ffn"}
    network = graph.to_networkx()
    assert network.number_of_edges() == len(graph.edges) and network.number_of_nodes() == len(graph.nodes)
    saved = json.loads(graph.save(tmp_path / "r.json").read_text())
    assert len(saved["edges"]) == len(graph.edges) and saved["tau"] == 0.05
    assert "<table" in graph._repr_html_()
    figure = graph.plot(tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 0 and figure.axes


# ---- a planted circuit ---------------------------------------------------------------------------------------
TOKENS, POSITIONS, PREV, OUT = 0, 8, 16, 24  # where each kind of information lives in the 48-wide residual stream
SHARP, WRITE = 4.0, 0.2  # query scale (attention nearly one-hot) and the output projection's scale


def _hand_built_gpt2(folder, set_weights):
    """A two-layer GPT-2 (48 wide, two heads, 8 tokens) whose weights are all 0 but the norms' gains (1) and the
    token embeddings (token t is the unit vector at TOKENS + t), then ``set_weights(model)``; saved to ``folder``."""
    import transformers

    model = zeroed_gpt2(n_embd=48, vocab_size=8, n_positions=16)
    with torch.no_grad():
        model.transformer.wte.weight[:, TOKENS:TOKENS + 8] = torch.eye(8)
        set_weights(model)
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(resolve_source("minilm")).save_pretrained(folder)
    return folder


def zeroed_gpt2(**sizes):
    """A two-layer, two-head GPT-2 of ``sizes`` (``n_embd``, ``vocab_size``, ``n_positions``, ...) with every weight 0
    but the layer norms' gains (1), no dropout: a blank to plant heads in."""
    import transformers

    config = transformers.GPT2Config(n_layer=2, n_head=2, n_inner=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=0, architectures=["GPT2LMHeadModel"],
                                     **sizes)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        for block in model.transformer.h:
            block.ln_1.weight.fill_(1.0)
            block.ln_2.weight.fill_(1.0)
        model.transformer.ln_f.weight.fill_(1.0)
    return model


def _planted_gpt2(folder):
    """Two layers, two heads each (head 1 silent), no MLP. Layer 0 head 0 is a previous-token head: it reads the
    position, attends to the one before and writes that token's identity into PREV. Layer 1 head 0 is an induction
    head: a query with token t attends to the position whose PREV holds t and writes that position's token into OUT."""
    return _hand_built_gpt2(folder, _plant_induction)


def _plant_induction(model) -> None:
    """The previous-token head (layer 0, head 0) and the induction head (layer 1, head 0) of :func:`_planted_gpt2`."""
    d = 48
    model.transformer.wpe.weight[:8, POSITIONS:POSITIONS + 8] = torch.eye(8)
    previous, induction = (block.attn for block in model.transformer.h)
    for p in range(1, 8):  # query at p looks for key p - 1
        previous.c_attn.weight[POSITIONS + p, p - 1] = SHARP
    for p in range(8):
        previous.c_attn.weight[POSITIONS + p, d + p] = 1.0
    for t in range(8):
        previous.c_attn.weight[TOKENS + t, 2 * d + t] = 1.0  # value: the token
        previous.c_proj.weight[t, PREV + t] = WRITE
        induction.c_attn.weight[TOKENS + t, t] = SHARP  # query: my token
        induction.c_attn.weight[PREV + t, d + t] = 1.0  # key: the token before you
        induction.c_attn.weight[TOKENS + t, 2 * d + t] = 1.0  # value: your token
        induction.c_proj.weight[t, OUT + t] = WRITE


def test_a_planted_induction_circuit_is_the_route(tmp_path):
    loaded = load_model(str(_planted_gpt2(tmp_path / "planted")))
    ids = [5, 1, 2, 3, 4, 1]  # ... A B ... A: the induction head at the last A reads B's position (2)
    graph = routes(loaded, ids, tau=TAU)
    attention = {(e.target.layer, e.source.position, e.target.position): e for e in graph.edges if e.via == "attention"}
    into_last = {key: edge for key, edge in attention.items() if key[0] == 1 and key[2] == 5}
    assert set(into_last) == {(1, 2, 5)}  # layer 1: only B's position reaches the last token
    assert (0, 1, 2) in attention  # layer 0: the first A reaches B's position (previous-token head)
    for key in ((1, 2, 5), (0, 1, 2)):
        edge = attention[key]
        assert edge.heads[0] > 0.99 * edge.importance and edge.importance > 0.1, (key, edge)
    assert not any(e.via == "ffn" for e in graph.edges)  # no MLP: its output is zero


CANCELLED = 3  # the token whose stream layer 0's feed-forward block cancels past zero


def _cancel_token(model) -> None:
    """Layer 0's feed-forward output is its bias, the constant ``-1.5 e_k`` (k: token CANCELLED's coordinate); the
    attention blocks and layer 1's feed-forward block stay silent (zero weights: every part is 0)."""
    model.transformer.h[0].mlp.c_proj.bias[TOKENS + CANCELLED] = -1.5


def test_a_row_whose_importance_is_undefined_ends_the_route(tmp_path):
    # No position embedding, silent attention: at token CANCELLED layer 0 turns y = e_k into y + ffn = -0.5 e_k,
    # nearer 0 than to either part (||y + ffn||_1 = 0.5 <= ||y||_1 = 1, ||ffn||_1 = 1.5): both proximities are 0.
    loaded = load_model(str(_hand_built_gpt2(tmp_path / "cancelling", _cancel_token)))
    graph, tensors = routes_and_tensors(loaded, [5, 1, CANCELLED], tau=TAU)
    rows = tensors.importance(0, [0, 1, 2])
    # tokens 5 and 1 (y = e_t): ||e_t - 1.5 e_k||_1 = 2.5, so proximities 2.5 - 1 (ffn) and 2.5 - 1.5 (residual)
    torch.testing.assert_close(rows.ffn[:2], torch.full((2,), 0.6), atol=1e-6, rtol=0)
    torch.testing.assert_close(rows.ffn_residual[:2], torch.full((2,), 0.4), atol=1e-6, rtol=0)
    assert float(rows.ffn[2]) == 0.0 and float(rows.ffn_residual[2]) == 0.0  # 0/0: read as 0, nothing kept
    # layer 1 carries the last stream up unchanged (residual shares 1); layer 0's 0/0 row ends the route there
    attention, entering = Node(1, 2, "attention"), Node(1, 2, "residual")
    assert {(e.source, e.target, e.via) for e in graph.edges} == {(entering, attention, "residual"),
                                                                  (attention, graph.output, "residual")}
    assert set(graph.nodes) == {entering, attention, graph.output}


# ---- refusals ------------------------------------------------------------------------------------------------
def test_routes_refuse_encoders_and_bad_arguments(minilm, tiny):
    with pytest.raises(attnscope.AttnscopeError, match="not a decoder-only"):
        routes(minilm, "The cat sat.")
    with pytest.raises(attnscope.AttnscopeError, match="outside the prompt"):
        routes(tiny("llama"), "The cat sat.", position=40)
    with pytest.raises(attnscope.AttnscopeError, match="tau must be"):
        routes(tiny("llama"), "The cat sat.", tau=1.0)
    assert DEFAULT_TAU == TAU


@pytest.mark.parametrize(("extra", "says"), [(["--tau", "1.5"], "tau must be"), (["--tau", "nan"], "finite"),
                                             (["--position", "x"], "token position"),
                                             (["--position", "99"], "outside the prompt"),
                                             (["-o", "routes.txt"], ".html")])
def test_cli_bad_input_is_one_line(tiny_model_dir, tmp_path, capsys, extra, says):
    try:
        code = cli.main(["routes", "--model", str(tiny_model_dir("llama")), "The cat sat.", *extra])
    except SystemExit as stop:  # argparse's own errors exit with attnscope's line
        code = stop.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and says in err[-1] and err[-1].startswith("attnscope: error:")
    assert not any("Traceback" in line for line in err)


def test_cli_writes_the_page_figure_and_json(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "r.html"
    code = cli.main(["routes", "--model", str(tiny_model_dir("llama")), TEXT, "--png", "--json", "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    assert "<img" in out.read_text() and out.with_suffix(".png").exists()
    assert json.loads(out.with_suffix(".json").read_text())["edges"]
    assert "wrote" in capsys.readouterr().out



# ---- each generated token's route ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_generation_routes_equal_one_pass_over_the_final_text(tiny, kind, tmp_path):
    from attnscope.attribution import StepRoutes
    from attnscope.records import GenerationRecord

    loaded = tiny(kind)
    gen = attnscope.generate(loaded, TEXT, max_new_tokens=4, recorders=[StepRoutes()], progress=False)
    again = GenerationRecord.load(gen.save(tmp_path / "gen.safetensors"))  # the record's checks know the arrays
    assert_generation_routes_are_one_pass_routes(loaded, again)


def assert_generation_routes_are_one_pass_routes(loaded, gen) -> None:
    """Each step's route of the generation ``gen`` equals the route of one pass over its final text at that step's
    position (edges and importances to 1e-5)."""
    from attnscope.attribution import step_routes

    ids = [int(i) for i in gen.token_ids]
    for step in range(gen.n_steps):
        position = gen.prompt_length - 1 + step
        expected = {(e.source, e.target, e.via): e for e in routes(loaded, ids, position=position).edges}
        got = {(e.source, e.target, e.via): e for e in step_routes(gen, step).edges}
        assert got.keys() == expected.keys(), step
        for key, edge in got.items():
            assert edge.importance == pytest.approx(expected[key].importance, abs=1e-5)
            if edge.heads:
                assert edge.heads == pytest.approx(expected[key].heads, abs=1e-5)


def test_routes_under_a_sink_window_restriction_walk_the_restricted_model(tiny):
    """Under an intervention that restricts keys (``SinkWindow``), the route recorder is handed the restricted mask:
    the rows it recomputes equal the naive parts of the restricted model's attention (captured eagerly under the same
    intervention), and each generated token's route the one-pass route of the restricted model; a restriction that leaves a gap (a sink) or that only some heads of a layer get is refused."""
    from attnscope.attribution import StepRoutes
    from attnscope.capture.attention import intervene
    from attnscope.errors import AttnscopeError
    from attnscope.experiments.interventions import SinkWindow

    loaded = tiny("llama")
    n_heads = loaded.config.num_attention_heads
    every_head = {layer: list(range(n_heads)) for layer in range(loaded.config.num_hidden_layers)}
    with intervene(SinkWindow(every_head, 0, 3)):  # a window of 3 keys: one band per row, shorter than causal
        assert chunked_vs_naive_error(loaded, TEXT) <= TOLERANCE
        gen = attnscope.generate(loaded, TEXT, max_new_tokens=2, recorders=[StepRoutes()], progress=False)
        assert_generation_routes_are_one_pass_routes(loaded, gen)  # generation's recorder, one step at a time
    ids = _ids(loaded, TEXT)
    for restriction, says in ((SinkWindow(every_head, 1, 3), "leaves gaps"),
                              (SinkWindow({0: [0]}, 0, 3), "every head of a layer")):
        with intervene(restriction), pytest.raises(AttnscopeError, match=says):
            routes(loaded, ids)
