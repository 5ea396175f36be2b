"""The notebook widget, kernel side: a lazy payload, layers answered on request (checked against the
record), the selection's traitlets, the text shown where no kernel runs. The page side is in
tests/test_widget_browser.py (a real Jupyter server and Chromium) and tests/test_notebook.py
(docs/widget.ipynb executed by nbclient on a real kernel)."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("anywidget", reason="the notebook extra is not installed (pip install -e '.[notebook]')")

from attnscope import AttentionWidget, extract, load_model, widget
from attnscope.present import view
from attnscope.present.payload import payload_schema, unpack

PAIR = ("I went to the store.", "At the store, I bought fresh strawberries.")
STEP = 1 / 255


@pytest.fixture(scope="module")
def record(minilm):
    return extract(minilm, *PAIR, qkv=True, norms=True)


@pytest.fixture
def answered(record):
    """A widget whose messages to the page are kept in a list instead of going to a comm."""
    shown = widget(record, layer=2, heads=[4, 1])
    sent: list[dict] = []
    shown.send = lambda content, buffers=None: sent.append(content)
    return shown, sent


def ask(shown, sent, **request):
    shown._answer(shown, {"type": "fetch", "id": len(sent) + 1, **request}, [])
    return sent[-1]


def test_payload_carries_no_weights_and_is_small(record):
    shown = widget(record)
    kind = shown.payload["kinds"][0]
    assert kind["attention"]["lazy"] and kind["attention"]["data"] == ""
    assert kind["attention"]["shape"] == list(record.attention.shape)
    assert kind["vectors"]["queries"]["data"] == "" and kind["norms"]["lazy"]
    assert len(json.dumps(shown.payload)) < len(view(record).to_html()) / 20
    assert shown.payload["views"] == ["head", "model", "neuron"] and shown.view == "head"
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(shown.payload, payload_schema())  # the written schema covers the lazy form


def test_each_requested_layer_is_the_records(answered, record):
    shown, sent = answered
    reply = ask(shown, sent, kind=0, field="attention", layer=3)
    layer = unpack(reply["packed"])  # [1, head, q_pos, k_pos]
    assert reply["id"] == 1 and layer.shape == (1, *record.attention.shape[1:])
    np.testing.assert_allclose(layer[0], record.attention[3], atol=STEP / 2 + 1e-7)
    norms = unpack(ask(shown, sent, kind=0, field="norms", layer=1)["packed"])[0]
    np.testing.assert_allclose(norms, record.norms[1], atol=record.norms[1].max() / 510 * 1.001)
    queries = unpack(ask(shown, sent, kind=0, field="queries", layer=5)["packed"])[0]
    np.testing.assert_allclose(queries, record.queries[5], rtol=1e-3, atol=1e-3)  # float16


def test_bad_requests_get_an_error_reply_not_an_exception(answered):
    shown, sent = answered
    assert "outside 0-5" in ask(shown, sent, kind=0, field="attention", layer=6)["error"]
    assert "error" in ask(shown, sent, kind=3, field="attention", layer=0)
    assert "error" in ask(shown, sent, kind=0, field="values", layer=0)
    shown._answer(shown, {"type": "something else"}, [])
    assert len(sent) == 3


def test_selection_traitlets_are_checked_and_observable(answered, record):
    shown, _ = answered
    assert (shown.layer, shown.heads, shown.selected_token) == (2, [1, 4], None)
    seen = []
    shown.observe(lambda change: seen.append((change.name, change.new)), names=["layer", "heads", "selected_token"])
    shown.layer = 5
    shown.heads = [7, 0]
    store = record.tokens.index("store")
    shown.selected_token = store
    assert seen == [("layer", 5), ("heads", [0, 7]), ("selected_token", store)]
    import traitlets

    for name, value in [("layer", 6), ("heads", [12]), ("heads", []), ("selected_token", 19), ("view", "long")]:
        with pytest.raises(traitlets.TraitError):
            setattr(shown, name, value)
    assert (shown.layer, shown.heads) == (5, [0, 7])


def test_without_a_kernel_it_shows_one_line_and_saves_as_html(answered, tmp_path):
    shown, _ = answered
    data, _ = shown._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in data
    assert "head, model, neuron view of" in data["text/plain"] and "needs a running kernel" in data["text/plain"]
    assert data["text/html"].count("<div") == 1 and len(data["text/html"]) < 500
    page = shown.to_view()
    assert page.payload["start"] == {"layer": 2, "heads": [1, 4]}
    assert page.save(tmp_path / "w.html").stat().st_size > 10_000


def test_encoder_decoder_widget_answers_every_kind(tiny_model_dir):
    record = extract(load_model(str(tiny_model_dir("bart"))), "I went to the store.", "Ich ging.")
    shown = widget(record)
    assert isinstance(shown, AttentionWidget)
    sent: list[dict] = []
    shown.send = lambda content, buffers=None: sent.append(content)
    for index, kind in enumerate(record.kinds):
        layer = unpack(ask(shown, sent, kind=index, field="attention", layer=1)["packed"])[0]
        np.testing.assert_allclose(layer, record.get(kind)[1], atol=STEP / 2 + 1e-7, err_msg=kind)
