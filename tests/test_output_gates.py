"""Output gates (Qwen3-Next's gated attention): a model that multiplies its heads' output by a gate before the
output projection adds ``gate_i * alpha_ij f(x_j)`` for key j at query i. ``||alpha f(x)||`` in records and
the context-mixing measures include the gate, checked against a direct computation on a tiny random
qwen3_next (``tests/tiny_architectures.py``) and on hand-built tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnscope import extract, load_model
from attnscope.analysis.mixing import LayerTensors, block_terms, head_terms, norm_maps
from attnscope.capture.plan import CapturePlan, QuerySelection
from attnscope.capture.recorders import per_head_out_proj
from attnscope.errors import AttnscopeError

from .tiny_architectures import TEXT, build_folder


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    folder = build_folder("qwen3_next", tmp_path_factory.mktemp("qwen3_next"))
    return folder, load_model(str(folder))


def direct_gated_terms(loaded, ids: list[int]) -> list[dict[str, torch.Tensor]]:
    """Per attention site (by layer), from the model's own modules in an eager run: the weights ``[head, q, k]``
    (eager ``output_attentions``), the gate ``sigmoid`` of the second half of ``q_proj`` and the values, each
    ``[head, pos, d_head]``, every head's vector per (query, key) ``(g_i * v_j) W_O^h`` ``[head, q, k, d_model]``
    and what the output projection returned ``[q, d_model]``."""
    import transformers

    eager = transformers.AutoModelForCausalLM.from_pretrained(loaded.model.name_or_path,
                                                              attn_implementation="eager").eval()
    sites = sorted(loaded.sites.values(), key=lambda s: s.layer)
    modules = [eager.get_submodule(site.name) for site in sites]
    seen: dict[int, dict[str, torch.Tensor]] = {}

    def hidden_of(index):
        def hook(module, args, kwargs):
            seen.setdefault(index, {})["hidden"] = kwargs.get("hidden_states", args[0] if args else None)[0]
        return hook

    def projected_of(index):
        def hook(module, inputs, output):
            seen.setdefault(index, {})["projected"] = output[0]
        return hook

    handles = [m.register_forward_pre_hook(hidden_of(i), with_kwargs=True) for i, m in enumerate(modules)]
    handles += [m.o_proj.register_forward_hook(projected_of(i)) for i, m in enumerate(modules)]
    try:
        with torch.inference_mode():
            out = eager(input_ids=torch.tensor([ids]), output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    weights = [a[0] for a in out.attentions if isinstance(a, torch.Tensor)]
    return [_direct_terms(module, seen[index], weights[index]) for index, module in enumerate(modules)]


@torch.inference_mode()
def _direct_terms(module, seen: dict[str, torch.Tensor], attention: torch.Tensor) -> dict[str, torch.Tensor]:
    hidden = seen["hidden"]  # [pos, d_model]
    n, d_head = hidden.shape[0], module.head_dim
    _, gate = torch.chunk(module.q_proj(hidden).view(n, -1, d_head * 2), 2, dim=-1)  # [pos, head, d_head]
    gate = torch.sigmoid(gate).transpose(0, 1)  # [head, pos, d_head]
    values = module.v_proj(hidden).view(n, -1, d_head).transpose(0, 1)  # [kv_head, pos, d_head]
    values = values.repeat_interleave(gate.shape[0] // values.shape[0], dim=0)  # [head, pos, d_head]
    w_o = module.o_proj.weight.T.reshape(gate.shape[0], d_head, -1)  # [head, d_head, d_model]
    vectors = torch.einsum("hqd,hkd,hdm->hqkm", gate, values, w_o)  # (g_i * v_j) W_O^h
    return {"attention": attention, "vectors": vectors, "projected": seen["projected"]}


def test_norms_include_the_gate_and_the_vectors_sum_to_the_layers_output(qwen3_next):
    _, loaded = qwen3_next
    record = extract(loaded, TEXT, norms=True, qkv=True)
    direct = direct_gated_terms(loaded, record.token_ids.tolist())
    assert len(direct) == record.norms.shape[0]
    for layer, terms in enumerate(direct):
        attention, vectors = terms["attention"], terms["vectors"]
        np.testing.assert_allclose(record.attention[layer], attention.numpy(), atol=1e-5)
        expected = (attention[..., None] * vectors).norm(dim=-1)  # ||alpha_ij g_i * f(x_j)||, [head, q, k]
        np.testing.assert_allclose(record.norms[layer], expected.numpy(), rtol=1e-4, atol=1e-6)
        # the vectors the norms measure are what the layer adds: summed over heads and keys, the projection's output
        added = (attention[..., None] * vectors).sum(dim=(0, 2))  # [q, d_model]
        torch.testing.assert_close(added, terms["projected"], atol=1e-5, rtol=1e-4)
        site = sorted(loaded.sites.values(), key=lambda s: s.layer)[layer]
        values = torch.from_numpy(np.array(record.values[layer]))  # [head, k, d_head]
        ungated = attention * (values @ per_head_out_proj(site, values.shape[0])).norm(dim=-1)[:, None, :]
        assert not np.allclose(record.norms[layer], ungated.numpy(), atol=1e-4)  # the gate is not a no-op here


def test_a_planned_capture_with_norms_refuses_a_gated_model_in_one_line(qwen3_next):
    _, loaded = qwen3_next
    with pytest.raises(AttnscopeError, match="multiplies its heads' output by a gate"):
        extract(loaded, TEXT, norms=True, plan=CapturePlan(queries=QuerySelection("last", n=2)))


def test_the_mixing_measures_use_the_gated_vectors():
    rng = np.random.default_rng(0)
    heads, n, d_head, d_model = 3, 5, 4, 6
    attention = rng.dirichlet(np.ones(n), size=(heads, n))  # [head, q, k]
    gate, values = rng.uniform(0, 1, (heads, n, d_head)), rng.normal(size=(heads, n, d_head))
    w_o = rng.normal(size=(heads, d_head, d_model))
    layer = LayerTensors(attention=attention, transformed=np.einsum("hkd,hdm->hkm", values, w_o),
                         out_bias=np.zeros(d_model), residual=rng.normal(size=(n, d_model)),
                         gate=gate, values=values, out_proj=w_o)
    vectors = np.array([[[attention[h, i, j] * (gate[h, i] * values[h, j]) @ w_o[h] for j in range(n)]
                         for i in range(n)] for h in range(heads)])  # [head, q, k, d_model], term by term
    np.testing.assert_allclose(head_terms(layer), vectors, atol=1e-12)
    per_head, summed = norm_maps(layer)
    np.testing.assert_allclose(per_head, np.linalg.norm(vectors, axis=-1), atol=1e-12)
    np.testing.assert_allclose(summed, np.linalg.norm(vectors.sum(0), axis=-1), atol=1e-12)
    terms, _ = block_terms(layer)
    expected = vectors.sum(0) + np.eye(n)[:, :, None] * layer.residual[:, None, :]  # the residual joins token i
    np.testing.assert_allclose(terms, expected, atol=1e-12)


def test_a_generation_of_a_gated_model_keeps_no_per_key_norms(qwen3_next):
    """A generation record's norms are per key; a gate makes them per query too, so none are kept."""
    from attnscope import generate

    _, loaded = qwen3_next
    gen = generate(loaded, TEXT, max_new_tokens=2)
    assert not gen.has_norms and gen.n_steps == 2


# gated attention as transformers writes it: an elementwise sigmoid gate from q_proj (Qwen3-Next, Qwen3.5),
# a gate projection of its own (AFMoE), a softplus gate (Laguna), one gate per head (LFM3)
@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text", "afmoe", "laguna", "lfm3"])
def test_the_gated_vectors_read_from_any_gated_model_add_up_to_its_attention_output(model_type, tmp_path):
    """sum over heads and keys of a_ij (g_i * v_j) W_O^h, plus the projection's bias, is what the output projection
    returned: the gate read between the attention function and the projection is the model's."""
    from attnscope.capture.attention import capture
    from attnscope.capture.hooks import local_hooks

    loaded = load_model(str(build_folder(model_type, tmp_path)))
    ids = torch.tensor([loaded.tokenizer(TEXT)["input_ids"]])
    projected = {}
    projections = {site.out_proj: site for site in loaded.sites.values()}
    keep = lambda module, inputs, output: projected.__setitem__(projections[module], output[0])
    with torch.inference_mode(), local_hooks(projections, keep), capture(loaded.sites, qkv=True) as session:
        loaded.model(input_ids=ids)
    assert any(session.captured[(site.kind, site.layer)].gate is not None for site in loaded.sites.values())
    for site in loaded.sites.values():
        captured = session.captured[(site.kind, site.layer)]
        gate = torch.ones_like(captured.values[:, :, :1]) if captured.gate is None else captured.gate  # [1, h, q, d]
        per_head = per_head_out_proj(site, captured.n_heads)  # [head, d_head, d_model]
        gated = gate[0, :, :, None, :] * captured.values[0, :, None, :, :]  # [head, q, k, d_head]
        added = torch.einsum("hqk,hqkd,hdm->qm", captured.attention[0], gated, per_head)
        bias = getattr(site.out_proj, "bias", None)
        torch.testing.assert_close(added + (0 if bias is None else bias), projected[site], atol=1e-4, rtol=1e-4)
