"""Context-mixing measures in the views: the payload's packed maps against ``mixing_measures``, the
schema, ``view_text``, ``attnscope view --measure`` and the explorer's ``POST /api/mixing``.
(The pages in a real browser: tests/test_measure_views_browser.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from attnscope import AttnscopeError, extract, load_model
from attnscope.analysis.mixing import REFERENCES
from attnscope.capture.tokens import TruncationWarning
from attnscope.experiments.mixing import mixing_measures
from attnscope.present import build_payload, payload_schema
from attnscope.present.payload import unpack
from attnscope.text_view import view_text

jsonschema = pytest.importorskip("jsonschema")

TEXT = "The cat sat on the mat."
METHODS = ("alti", "norm_residual", "value_zeroing")


@pytest.fixture(scope="module")
def minilm_measures(minilm):
    return extract(minilm, TEXT, qkv=True, norms=True), mixing_measures(minilm, TEXT, METHODS)


def validate(payload) -> None:
    jsonschema.Draft202012Validator(payload_schema()).validate(json.loads(json.dumps(payload)))


def assert_decodes_to(packed, expected: np.ndarray) -> None:
    """Decoded within half a step of the per-layer scale: 1/510 of each layer's largest value."""
    decoded = unpack(packed)
    assert decoded.shape == expected.shape
    bound = expected.reshape(len(expected), -1).max(axis=1)[:, None, None] / 510
    assert np.all(np.abs(decoded - expected) <= bound * 1.001 + 1e-7)


def test_payload_ships_each_measure_and_its_rollout_within_the_quantization_bound(minilm_measures):
    record, measures = minilm_measures
    payload = build_payload(record, mixing=measures)
    validate(payload)
    shipped = payload["kinds"][0]["mixing"]
    assert [entry["method"] for entry in shipped] == list(METHODS)
    for entry in shipped:
        measure = measures[entry["method"]]
        assert entry["reference"] == REFERENCES[entry["method"]]
        assert entry["layers"]["shape"] == [6, len(record.tokens), len(record.tokens)]  # [layer, q_pos, k_pos]: no heads
        assert_decodes_to(entry["layers"], measure.layers)
        assert_decodes_to(entry["rollout"], measure.rollout)
    rows = unpack(shipped[0]["rollout"]).sum(-1)  # the rollout's rows sum to 1, up to 0.002 per entry
    assert np.allclose(rows, 1.0, atol=len(record.tokens) * 0.5 / 255)


def test_include_layers_ships_those_layers_of_each_measure(minilm_measures):
    record, measures = minilm_measures
    payload = build_payload(record, mixing=[measures["alti"]], include_layers=[1, 4])
    validate(payload)
    entry = payload["kinds"][0]["mixing"][0]
    assert_decodes_to(entry["layers"], measures["alti"].layers[[1, 4]])
    assert_decodes_to(entry["rollout"], measures["alti"].rollout[[1, 4]])  # rollout through model layers 1 and 4


def test_a_page_without_measures_has_no_mixing_entry_and_still_follows_the_schema(minilm_measures):
    record, _ = minilm_measures
    payload = build_payload(record)
    validate(payload)
    assert "mixing" not in payload["kinds"][0]


def test_the_schema_rejects_a_mixing_map_with_a_head_axis(minilm_measures):
    record, measures = minilm_measures
    payload = json.loads(json.dumps(build_payload(record, mixing=[measures["alti"]])))
    payload["kinds"][0]["mixing"][0]["layers"]["shape"] = [6, 1, 9, 9]
    with pytest.raises(jsonschema.ValidationError):
        validate(payload)


def test_measures_of_another_text_are_one_clear_error(minilm, minilm_measures):
    record, _ = minilm_measures
    other = mixing_measures(minilm, "A different sentence entirely.", ["alti"])
    with pytest.raises(AttnscopeError, match="computed on another input"):
        build_payload(record, mixing=other)


def test_view_text_on_a_decoder_and_an_encoder_decoders_encoder(tiny_model_dir):
    llama = load_model(str(tiny_model_dir("llama")))
    page = view_text(llama, TEXT, measures=("globenc", "alti"))
    validate(page.payload)
    expected = mixing_measures(llama, TEXT, ["norm_residual", "alti"])
    for entry in page.payload["kinds"][0]["mixing"]:
        assert_decodes_to(entry["layers"], expected[entry["method"]].layers)
        assert np.allclose(np.triu(unpack(entry["layers"]), 1), 0)  # causal: no later key
    bart = load_model(str(tiny_model_dir("bart")))
    page = view_text(bart, TEXT, "ein Ziel", measures=("alti",))  # the pair is the target: the encoder never sees it
    validate(page.payload)
    kinds = {kind["kind"]: kind for kind in page.payload["kinds"]}
    assert "mixing" in kinds["encoder"] and all("mixing" not in kinds[k] for k in ("decoder", "cross"))
    assert_decodes_to(kinds["encoder"]["mixing"][0]["layers"], mixing_measures(bart, TEXT, ["alti"])["alti"].layers)


def test_view_text_refuses_a_second_sentence_for_the_measures(tiny_model_dir):
    bert = load_model(str(tiny_model_dir("bert")))
    with pytest.raises(AttnscopeError, match="take one text"):
        view_text(bert, TEXT, "Second sentence.", measures=("alti",))
    with pytest.raises(AttnscopeError, match="unknown mixing method"):
        view_text(bert, TEXT, measures=("attentiveness",))


# ---- attnscope view --measure --------------------------------------------------------------------
def payload_of(page_path) -> dict:
    text = page_path.read_text(encoding="utf-8")
    start = text.index('type="application/json"')
    body = text[text.index(">", start) + 1 : text.index("</script>", start)]
    return json.loads(body)


def test_cli_view_measure_ships_the_measures(tiny_model_dir, tmp_path, capsys):
    from attnscope.cli import main

    folder = str(tiny_model_dir("bert"))
    out = tmp_path / "views.html"
    assert main(["view", TEXT, "--model", folder, "--measure", "alti", "--measure", "globenc", "-o", str(out)]) == 0
    assert "measures alti, norm_residual" in capsys.readouterr().out
    shipped = payload_of(out)["kinds"][0]["mixing"]
    expected = mixing_measures(load_model(folder), TEXT, ["alti", "norm_residual"])
    assert [entry["method"] for entry in shipped] == ["alti", "norm_residual"]
    for entry in shipped:
        assert_decodes_to(entry["rollout"], expected[entry["method"]].rollout)


def test_cli_view_measure_on_a_text_cut_by_max_tokens(tiny_model_dir, tmp_path, capsys):
    """--max-tokens cuts the text for the measures as for the record (one truncation warning, not two)."""
    from attnscope.cli import main

    folder = str(tiny_model_dir("bert"))
    out = tmp_path / "views.html"
    assert main(["view", TEXT, "--model", folder, "--max-tokens", "5", "--measure", "alti", "-o", str(out)]) == 0
    assert capsys.readouterr().err.count("truncated to 5") == 1
    shipped = payload_of(out)["kinds"][0]["mixing"][0]
    with pytest.warns(TruncationWarning, match="truncated to 5 .chosen; the model takes up to"):
        expected = mixing_measures(load_model(folder), TEXT, ["alti"], max_length=5)["alti"]
    assert expected.rollout.shape[-1] == 5
    assert_decodes_to(shipped["rollout"], expected.rollout)


def test_cli_view_measure_bad_inputs_get_one_line(tiny_model_dir, tmp_path, capsys):
    from attnscope.cli import main

    folder = str(tiny_model_dir("bert"))
    record = tmp_path / "rec.safetensors"
    extract(load_model(folder), TEXT).save(record)
    cases = [
        (["--record", str(record), "--measure", "alti"], "needs the model"),
        ([TEXT, "--model", folder, "--pair", "Second.", "--measure", "alti"], "--measure takes one text"),
        ([TEXT, "--model", folder, "--long", "--measure", "alti"], "the long view"),
    ]
    for arguments, message in cases:
        out = tmp_path / "bad.html"
        assert main(["view", *arguments, "-o", str(out)]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("attnscope: error:")]
        assert len(errors) == 1 and message in errors[0], errors
        assert not out.exists()
    # attention needs no more than the record holds
    out = tmp_path / "attention.html"
    assert main(["view", "--record", str(record), "--measure", "attention", "-o", str(out)]) == 0
    entry = payload_of(out)["kinds"][0]["mixing"][0]
    attention = np.asarray(extract(load_model(folder), TEXT).attention, dtype=np.float64).mean(axis=1)
    assert entry["method"] == "attention"
    assert_decodes_to(entry["layers"], attention)


# ---- the explorer's POST /api/mixing ---------------------------------------------------------------
@pytest.fixture(scope="module")
def client(minilm):
    testclient = pytest.importorskip("fastapi.testclient")
    from attnscope.serve.app import create_app

    return testclient.TestClient(create_app(loaded=[minilm]), base_url="http://127.0.0.1:8765",
                                 raise_server_exceptions=False)


def test_api_mixing_answers_the_packed_measure(client, minilm_measures):
    record, measures = minilm_measures
    assert [m["method"] for m in client.get("/api/models").json()["measures"]] == [
        "attention", "norm", "norm_residual", "alti", "value_zeroing"]
    answer = client.post("/api/mixing", json={"text": TEXT, "method": "value_zeroing"})
    assert answer.status_code == 200
    data = answer.json()
    assert data["tokens"] == list(record.tokens) and data["method"] == "value_zeroing"
    assert_decodes_to(data["mixing"]["layers"], measures["value_zeroing"].layers)
    assert_decodes_to(data["mixing"]["rollout"], measures["value_zeroing"].rollout)
    alias = client.post("/api/mixing", json={"text": TEXT, "method": "globenc"}).json()
    assert alias["method"] == "norm_residual"
    assert_decodes_to(alias["mixing"]["layers"], measures["norm_residual"].layers)


@pytest.mark.parametrize("body, message", [
    ({"text": TEXT, "method": "attentiveness"}, "method: Input should be"),
    ({"text": "   ", "method": "alti"}, "text is empty"),
    ({"text": TEXT}, "method: Field required"),
    ({"text": TEXT, "pair": "Another one.", "method": "alti"}, "take one text"),
])
def test_api_mixing_bad_input_gets_a_422_with_one_line(client, body, message):
    answer = client.post("/api/mixing", json=body)
    assert answer.status_code == 422
    detail = answer.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail and message in detail, detail


def test_the_notebook_widget_ships_the_measures_whole_beside_its_lazy_layers(minilm_measures):
    pytest.importorskip("anywidget")
    from attnscope.present.widget import widget

    record, measures = minilm_measures
    payload = widget(record, mixing=[measures["alti"]]).payload
    kind = payload["kinds"][0]
    assert kind["attention"]["lazy"] and kind["attention"]["data"] == ""  # fetched from the kernel per layer
    assert_decodes_to(kind["mixing"][0]["layers"], measures["alti"].layers)  # small: shipped at once
    validate(payload)
