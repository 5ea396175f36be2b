"""Context-mixing measures against direct computations on tiny random models (BERT and MPNet: post-LN encoders;
Llama: pre-LN causal decoder with grouped key/value heads; BART: an encoder-decoder's encoder),
and on hand-made tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnscope import AttnscopeError, extract, load_model
from attnscope.analysis.mixing import (
    METHODS,
    LayerTensors,
    alti_map,
    block_terms,
    globenc_map,
    mixing_from_tensors,
    normalise_rows,
)
from attnscope.analysis.rollout import attention_rollout
from attnscope.experiments.interventions import ValueZeroing
from attnscope.experiments.mixing import (
    capture_layers,
    encode_text,
    input_side,
    mixing,
    mixing_measures,
    value_zeroing_distances,
)

TEXT = "The cat sat on the mat and looked at the dog."

# the module the attention block's output leaves (post-LN: the first LayerNorm; pre-LN: the residual sum,
# read as block input + attention module output)
FIRST_NORM = {"bert": "encoder.layer.{}.attention.output.LayerNorm", "bart": "model.encoder.layers.{}.self_attn_layer_norm",
              "mpnet": "encoder.layer.{}.attention.LayerNorm"}
ATTENTION = {"llama": "model.layers.{}.self_attn"}
BLOCK = {"bert": "encoder.layer.{}", "llama": "model.layers.{}", "bart": "model.encoder.layers.{}",
         "mpnet": "encoder.layer.{}"}


def _sharpened(loaded):
    """The tiny model with its linear layers drawn at unit gain (seeded): the configs' 0.02 initialisation
    mixes so little that value zeroing would move outputs by 1e-7, below float32's resolution."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in loaded.model.modules():
            if isinstance(module, torch.nn.Linear):
                fan_in = module.weight.shape[1]
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) / fan_in**0.5)
                if module.bias is not None:
                    module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=generator))
    return loaded


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    loaded = {}

    def get(kind: str):
        if kind not in loaded:
            loaded[kind] = _sharpened(load_model(str(tiny_model_dir(kind))))
        return loaded[kind]

    return get


@pytest.fixture(scope="module")
def captured(tiny):
    return {kind: capture_layers(tiny(kind), TEXT) for kind in ("bert", "llama", "bart", "mpnet")}


def _run_with_hooks(loaded, layer: int, kind: str) -> dict[str, torch.Tensor]:
    """One plain forward pass with our own hooks: the block's input, the attention block's output, the block's output."""
    model = loaded.model
    seen: dict[str, torch.Tensor] = {}

    def keep(name: str, pick):
        def hook(*arguments) -> None:
            seen.setdefault(name, pick(*arguments)[0])
        return hook

    block = model.get_submodule(BLOCK[kind].format(layer))
    handles = [block.register_forward_pre_hook(keep("input", lambda m, a, kw: a[0] if a else kw["hidden_states"]),
                                               with_kwargs=True),
               block.register_forward_hook(keep("output", lambda m, i, out: out[0] if isinstance(out, tuple) else out))]
    if kind in FIRST_NORM:
        handles.append(model.get_submodule(FIRST_NORM[kind].format(layer)).register_forward_hook(
            keep("block", lambda m, i, out: out)))
    else:
        handles.append(model.get_submodule(ATTENTION[kind].format(layer)).register_forward_hook(
            keep("attention", lambda m, i, out: out[0])))
    try:
        _, inputs = encode_text(loaded, TEXT)
        with torch.inference_mode():
            input_side(loaded)(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    if "block" not in seen:
        seen["block"] = seen["input"] + seen["attention"]  # pre-LN: residual + attention
    return seen


@pytest.mark.parametrize("kind", ["bert", "llama", "bart", "mpnet"])
def test_alti_terms_sum_to_the_attention_blocks_output(tiny, captured, kind):
    loaded = tiny(kind)
    for layer, tensors in enumerate(captured[kind].layers):
        reference = _run_with_hooks(loaded, layer, kind)
        terms, rest = block_terms(tensors)
        np.testing.assert_allclose(terms.sum(axis=1) + rest, reference["block"].double().numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(tensors.residual, reference["input"].double().numpy(), rtol=1e-4, atol=1e-5)


def _bert_layer(loaded, layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """T_i(x_j) and y_i of a BERT layer straight from its weights (query, key, value, dense, LayerNorm), by loops."""
    prefix = f"encoder.layer.{layer}.attention."
    modules = {name: loaded.model.get_submodule(prefix + name) for name in
               ("self.query", "self.key", "self.value", "output.dense", "output.LayerNorm")}
    weights = {name: (m.weight.detach().double().numpy(), m.bias.detach().double().numpy()) for name, m in modules.items()}
    n_heads, d = loaded.config.num_attention_heads, x.shape[1]
    d_head = d // n_heads
    q, k, v = (x @ weights[f"self.{n}"][0].T + weights[f"self.{n}"][1] for n in ("query", "key", "value"))
    w_o, b_o = weights["output.dense"]
    n = x.shape[0]
    summed = np.zeros((n, n, d))
    for h in range(n_heads):
        cols = slice(h * d_head, (h + 1) * d_head)
        logits = q[:, cols] @ k[:, cols].T / np.sqrt(d_head)
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        for i in range(n):
            for j in range(n):
                summed[i, j] += probs[i, j] * (v[j, cols] @ w_o[:, cols].T)
    summed[np.arange(n), np.arange(n)] += x
    total = summed.sum(1) + b_o  # the LayerNorm's input
    gamma, beta = weights["output.LayerNorm"]
    scale = np.sqrt(total.var(-1) + modules["output.LayerNorm"].eps)[:, None]
    terms = gamma * (summed - summed.mean(-1, keepdims=True)) / scale[:, :, None]
    return terms, gamma * (total - total.mean(-1, keepdims=True)) / scale + beta


def test_alti_and_globenc_match_their_definitions_on_bert(tiny, captured):
    loaded = tiny("bert")
    for layer, tensors in enumerate(captured["bert"].layers):
        terms, y = _bert_layer(loaded, layer, tensors.residual)
        np.testing.assert_allclose(block_terms(tensors)[0], terms, atol=1e-5)
        n = len(y)
        # ALTI: c_ij = max(0, ||y_i||_1 - ||y_i - T_i(x_j)||_1), rows normalised
        alti = np.array([[max(0.0, np.abs(y[i]).sum() - np.abs(y[i] - terms[i, j]).sum()) for j in range(n)]
                         for i in range(n)])
        np.testing.assert_allclose(alti_map(tensors), alti / alti.sum(1, keepdims=True), atol=1e-5)
        # GlobEnc: the same terms through the second LayerNorm (its scale from its real input), norms, rows normalised
        second = tensors.after_ffn
        assert second is not None
        through = second.weight * (terms - terms.mean(-1, keepdims=True)) / second.scale[:, None, None]
        norms = np.linalg.norm(through, axis=-1)
        np.testing.assert_allclose(globenc_map(tensors), norms / norms.sum(1, keepdims=True), atol=1e-5)


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_key_chunks_give_the_same_maps_as_one_piece(captured, kind, monkeypatch):
    """Long inputs are measured a few keys at a time (bounded memory); the maps must not change."""
    from attnscope.analysis import mixing as measures

    layer = captured[kind].layers[-1]
    whole = {name: mixing_from_tensors(name, [layer], captured[kind].tokens).layers for name in
             ("norm", "norm_residual", "alti")}
    whole_terms = block_terms(layer)[0]
    d_model = layer.residual.shape[-1]
    monkeypatch.setattr(measures, "TERM_ELEMENTS", 3 * len(captured[kind].tokens) * d_model)  # 3 keys per chunk
    for name, expected in whole.items():
        np.testing.assert_allclose(mixing_from_tensors(name, [layer], captured[kind].tokens).layers, expected,
                                   rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(block_terms(layer)[0], whole_terms, rtol=1e-12, atol=1e-12)


def _zeroed_rerun(loaded, kind: str, layer: int, position: int) -> torch.Tensor:
    """The whole model re-run with one value vector zeroed at one layer; that block's output ``[pos, d_model]``."""
    outputs: list[torch.Tensor] = []
    block = loaded.model.get_submodule(BLOCK[kind].format(layer))
    handle = block.register_forward_hook(lambda m, i, out: outputs.append(out[0] if isinstance(out, tuple) else out))
    site_kind = "encoder" if loaded.is_encoder_decoder else "self"
    try:
        from attnscope import intervene

        _, inputs = encode_text(loaded, TEXT)
        with torch.inference_mode(), intervene(ValueZeroing(layer, torch.tensor([position]), site_kind)):
            input_side(loaded)(**inputs)
    finally:
        handle.remove()
    return outputs[0][0]


@pytest.mark.parametrize("kind", ["bert", "llama", "bart", "mpnet"])
def test_value_zeroing_matches_rerunning_the_model_with_that_value_zeroed(tiny, captured, kind):
    loaded = tiny(kind)
    distances = value_zeroing_distances(captured[kind])
    intact = captured[kind].outputs
    n = len(captured[kind].tokens)
    for layer, position in [(0, 2), (len(intact) - 1, n - 3), (1, 0)]:
        zeroed = _zeroed_rerun(loaded, kind, layer, position)
        cosine = torch.nn.functional.cosine_similarity(zeroed.double(), intact[layer].double(), dim=-1)
        np.testing.assert_allclose(distances[layer, :, position], (1 - cosine).numpy(), rtol=1e-3, atol=1e-7)
        assert distances[layer, :, position].max() > 1e-3  # zeroing a value changes something
    if kind == "llama":  # causal: zeroing a key never reaches the queries before it
        assert np.all(np.triu(distances, k=1) == 0)


def test_norm_matches_kobayashis_norms_from_capture(tiny):
    loaded = tiny("bert")
    record = extract(loaded, TEXT, norms=True)
    mix = mixing(loaded, TEXT, method="norm")
    assert mix.heads is not None
    np.testing.assert_allclose(mix.heads, record.norms, rtol=1e-4, atol=1e-6)
    assert mix.layers.max() > 0 and not np.allclose(mix.layers.sum(-1), 1.0)  # Kobayashi et al. do not normalise
    # the layer map is the norm of the head sum, at most the sum of the heads' norms (triangle inequality)
    assert np.all(mix.layers <= mix.heads.sum(1) + 1e-9)


@pytest.mark.parametrize("kind", ["bert", "llama", "bart"])
def test_rows_and_rollout_as_each_paper_defines(tiny, kind):
    measures = mixing_measures(tiny(kind), TEXT)
    assert set(measures) == set(METHODS)
    for name, mix in measures.items():
        n = len(mix.tokens)
        assert mix.layers.shape[1:] == (n, n) and mix.rollout.shape == mix.layers.shape
        np.testing.assert_allclose(mix.rollout.sum(-1), 1.0, atol=1e-9)
        if name != "norm":
            np.testing.assert_allclose(mix.layers.sum(-1), 1.0, atol=1e-9)
        if kind == "llama":
            assert np.all(np.triu(mix.layers, k=1) == 0)
    # rollout: residual-free measures compose with 0.5 I (Abnar & Zuidema), the others multiply as they are
    record = extract(tiny(kind), TEXT)
    np.testing.assert_allclose(measures["attention"].rollout, attention_rollout(record).matrix, atol=1e-5)
    alti = measures["alti"]
    np.testing.assert_allclose(alti.rollout[1], alti.layers[1] @ alti.layers[0], atol=1e-12)


def test_hand_made_layer_without_mixing_is_the_identity():
    n, d = 4, 6
    rng = np.random.default_rng(0)
    layer = LayerTensors(attention=np.eye(n)[None], transformed=np.zeros((1, n, d)), out_bias=np.zeros(d),
                         residual=rng.normal(size=(n, d)))
    np.testing.assert_allclose(alti_map(layer), np.eye(n))
    np.testing.assert_allclose(globenc_map(layer), np.eye(n))
    # a head that copies token 0 to everyone, with a value 3x larger than each residual: ALTI gives it weight
    copying = LayerTensors(attention=np.tile(np.eye(n)[:1], (n, 1))[None], transformed=np.tile(3 * np.ones(d), (1, n, 1)),
                           out_bias=np.zeros(d), residual=np.ones((n, d)))
    alti = alti_map(copying)
    assert np.all(alti[1:, 0] > alti[1:, 1:].max(axis=1))
    np.testing.assert_allclose(normalise_rows(np.zeros((2, 2))), 0.0)


def test_record_gives_attention_only(tiny):
    loaded = tiny("bert")
    record = extract(loaded, TEXT)
    from_record = mixing(record, method="attention")
    from_model = mixing(loaded, TEXT, method="attention")
    np.testing.assert_allclose(from_record.layers, from_model.layers, atol=1e-6)
    with pytest.raises(AttnscopeError, match="needs the model"):
        mixing(record, method="alti")
    with pytest.raises(AttnscopeError, match="unknown mixing method"):
        mixing(loaded, TEXT, method="gradients")
    with pytest.raises(AttnscopeError, match="empty"):
        mixing(loaded, "  ", method="alti")
    assert mixing(loaded, TEXT, method="globenc").method == "norm_residual"
    with pytest.raises(AttnscopeError, match="distances"):
        mixing_from_tensors("value_zeroing", [], ())


def test_plot_measure_draws_the_rollout(tiny_model_dir, tmp_path, capsys):
    from attnscope.cli import main

    folder = str(tiny_model_dir("bert"))
    figure = tmp_path / "alti.png"
    assert main(["plot", TEXT, "--model", folder, "--measure", "alti", "-o", str(figure)]) == 0
    assert figure.read_bytes()[:4] == b"\x89PNG"
    assert main(["plot", TEXT, "--model", folder, "--measure", "globenc", "--layer", "7", "-o",
                 str(tmp_path / "bad.png")]) == 2
    assert "--layer: layer 7 does not exist: the model has 2 layers" in capsys.readouterr().err
    record = tmp_path / "rec.safetensors"
    extract(load_model(folder), TEXT).save(record)
    assert main(["plot", "--record", str(record), "--measure", "alti", "-o", str(tmp_path / "r.png")]) == 2
    assert "needs the model" in capsys.readouterr().err
    assert main(["plot", "--record", str(record), "--measure", "attention", "-o", str(tmp_path / "r.png")]) == 0
