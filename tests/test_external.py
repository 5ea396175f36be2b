"""Bring your own attention: ``AttentionRecord.from_attentions`` on what transformers' eager
``output_attentions=True`` returns (and a TransformerLens-shaped cache), checked against attnscope's
own capture of the same input; ``view(rec, layer=, heads=, include_layers=)`` against the record.

TransformerLens is not installed here: its ``ActivationCache`` is stood in for by a plain dict of
the same keys and shapes (``blocks.{layer}.attn.hook_pattern`` -> ``[batch, head, q_pos, k_pos]``),
which is all ``from_attentions`` reads of it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnscope import AttentionRecord, AttnscopeError, classify_heads, extract, head_statistics, load_model
from attnscope.models.loading import _auto_class, resolve_source
from attnscope.present import view
from attnscope.present.payload import payload_schema, unpack

PAIR = ("I went to the store.", "At the store, I bought fresh strawberries.")
STEP = 1 / 255  # one quantization step of the shipped weights


def eager(folder):
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    return _auto_class(config).from_pretrained(folder, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def minilm_pair(minilm):
    """attnscope's capture of PAIR, and BertViz-style inputs for the same text from the eager model."""
    captured = extract(minilm, *PAIR)
    model = eager(resolve_source("minilm"))
    inputs = minilm.tokenizer(*PAIR, return_tensors="pt")
    with torch.inference_mode():
        outputs = model(**inputs, output_attentions=True)
    tokens = minilm.tokenizer.convert_ids_to_tokens(inputs["input_ids"][0])
    sentence_b_start = int(inputs["token_type_ids"][0].tolist().index(1))
    return captured, outputs, tokens, sentence_b_start


def test_output_attentions_tuple_makes_the_same_record_as_extract(minilm_pair):
    captured, outputs, tokens, sentence_b_start = minilm_pair
    rec = AttentionRecord.from_attentions(outputs.attentions, tokens, sentence_b_start=sentence_b_start)
    expected = torch.cat(outputs.attentions).numpy()  # [layer, head, q_pos, k_pos]
    np.testing.assert_array_equal(rec.attention, expected)
    np.testing.assert_allclose(rec.attention, captured.attention, atol=1e-6, rtol=0)
    assert rec.tokens == captured.tokens
    assert rec.special_mask.tolist() == captured.special_mask.tolist()  # [CLS]/[SEP] recognised by their form
    assert rec.sentence_ids.tolist() == captured.sentence_ids.tolist()
    assert rec.word_ids.tolist() == captured.word_ids.tolist()  # "straw ##berries" is one word
    assert (rec.model.n_layers, rec.model.n_heads, rec.model.causal, rec.model.d_head) == (6, 12, False, 0)
    # every statistic and classifier reads it as it reads the captured record
    ours, theirs = head_statistics(rec), head_statistics(captured)
    assert set(ours.values) == set(theirs.values)
    for name, expected_values in theirs.values.items():
        np.testing.assert_allclose(ours.values[name], expected_values, atol=1e-5, equal_nan=True, err_msg=name)
    np.testing.assert_array_equal(classify_heads(rec).labels, classify_heads(captured).labels)
    payload = view(rec).payload  # and every view draws it: head and model (no q/k, so no neuron view)
    assert payload["views"] == ["head", "model"] and payload["model"]["d_head"] == 0
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(payload, payload_schema())


def test_whole_output_object_and_model_facts(minilm_pair, minilm):
    captured, outputs, tokens, _ = minilm_pair
    rec = AttentionRecord.from_attentions(outputs, tokens, model=minilm.model)  # a ModelOutput is a mapping
    np.testing.assert_array_equal(rec.attention, torch.cat(outputs.attentions).numpy())
    assert rec.model.model_type == "bert" and rec.model.d_head == captured.model.d_head == 32


def test_transformerlens_style_cache(minilm_pair):
    _, outputs, tokens, _ = minilm_pair
    cache = {f"blocks.{layer}.attn.hook_pattern": pattern for layer, pattern in enumerate(outputs.attentions)}
    cache["blocks.0.hook_resid_pre"] = torch.zeros(1, len(tokens), 384)  # other hooks are ignored
    shuffled = dict(reversed(list(cache.items())))  # layers come back in numeric order, not key order
    rec = AttentionRecord.from_attentions(shuffled, tokens)
    np.testing.assert_array_equal(rec.attention, torch.cat(outputs.attentions).numpy())


def test_causal_model_is_recognised_from_its_weights(tiny_model_dir):
    folder = tiny_model_dir("llama")
    loaded = load_model(str(folder))
    captured = extract(loaded, PAIR[1])
    inputs = {"input_ids": torch.from_numpy(captured.token_ids.copy())[None]}
    with torch.inference_mode():
        outputs = eager(folder)(**inputs, output_attentions=True)
    rec = AttentionRecord.from_attentions(outputs.attentions, captured.tokens)
    assert rec.model.causal and captured.model.causal
    np.testing.assert_allclose(rec.attention, captured.attention, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(classify_heads(rec).labels, classify_heads(captured).labels)


def test_encoder_decoder_output(tiny_model_dir):
    folder = tiny_model_dir("bart")
    captured = extract(load_model(str(folder)), PAIR[0], "Ich ging zum Laden.")
    inputs = {"input_ids": torch.from_numpy(captured.token_ids.copy())[None],
              "decoder_input_ids": torch.from_numpy(captured.arrays["target.token_ids"].copy())[None]}
    with torch.inference_mode():
        outputs = eager(folder)(**inputs, output_attentions=True)
    rec = AttentionRecord.from_attentions(outputs, captured.tokens, target_tokens=captured.target_tokens)
    assert rec.kinds == captured.kinds == ("encoder", "decoder", "cross")
    assert rec.model.is_encoder_decoder and not rec.model.causal
    for kind in rec.kinds:
        np.testing.assert_allclose(rec.get(kind), captured.get(kind), atol=1e-6, rtol=0, err_msg=kind)
    with pytest.raises(AttnscopeError, match="target_tokens"):
        AttentionRecord.from_attentions(outputs, captured.tokens)


def test_saved_and_loaded_record_keeps_what_was_given(minilm_pair, tmp_path):
    _, outputs, tokens, start = minilm_pair
    rec = AttentionRecord.from_attentions(outputs.attentions, tokens, sentence_b_start=start)
    back = AttentionRecord.load(rec.save(tmp_path / "external.safetensors"))
    np.testing.assert_array_equal(back.attention, rec.attention)
    assert back.model == rec.model and back.tokens == rec.tokens


@pytest.mark.parametrize(("change", "message"), [
    (lambda a, t: (a, t[:-1]), r"\[q_pos 19, k_pos 19\] but the tokens given make it \[18, 18\]"),
    (lambda a, t: (a[:3] + (a[3][:, :2],), t), "all of one shape"),
    (lambda a, t: ({"logits": a[0]}, t), "found no attention"),
    (lambda a, t: (42, t), "cannot read attention from a int"),
])
def test_bad_input_gives_one_clear_error(minilm_pair, change, message):
    _, outputs, tokens, _ = minilm_pair
    attentions, tokens = change(tuple(outputs.attentions), tokens)
    with pytest.raises(AttnscopeError, match=message):
        AttentionRecord.from_attentions(attentions, tokens)


def test_view_opens_on_the_layer_and_heads_asked_and_ships_only_included_layers(minilm_pair):
    captured, *_ = minilm_pair
    page = view(captured, layer=4, heads=[5, 1], include_layers=[0, 4, 2])
    payload = page.payload
    assert payload["layers"] == [0, 2, 4]
    assert payload["start"] == {"layer": 4, "heads": [1, 5]}
    shipped = unpack(payload["kinds"][0]["attention"])  # [included layer, head, q_pos, k_pos]
    np.testing.assert_allclose(shipped, captured.attention[[0, 2, 4]], atol=STEP / 2 + 1e-7)
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(payload, payload_schema())
    full = view(captured).payload
    assert "layers" not in full and "start" not in full
    assert len(page.to_html()) < len(view(captured, "head").to_html())
    with pytest.raises(AttnscopeError, match="layer 3 is not among the layers shown"):
        view(captured, layer=3, include_layers=[0, 4])
    with pytest.raises(AttnscopeError, match="heads"):
        view(captured, heads=[12])
    with pytest.raises(AttnscopeError, match="include_layers"):
        view(captured, include_layers=[6])


def test_page_says_what_it_draws_without_javascript(minilm_pair):
    captured, *_ = minilm_pair
    fragment = view(captured).fragment("x")
    root = fragment[: fragment.index("</div>")]
    assert "head, model view of" in root and "6 layers x 12 heads, 19 tokens" in root
    assert "needs JavaScript" in root
