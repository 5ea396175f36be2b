"""Property-based tests of the explorer's API against its own OpenAPI schema (schemathesis).

Every check schemathesis enables by default runs on every generated request, valid or not
(``enabled_checks`` lists them): no 5xx; documented status codes, content types and headers;
response bodies that match their schema; schema-violating requests rejected (so the server
coerces nothing the schema forbids, e.g. ``0`` for ``false``); unsupported methods answered 405
with an ``Allow`` header; and valid requests accepted. The server offers an encoder (minilm) and a
decoder without a chat template (a tiny Llama), so the schema ties options to models: only the
decoder generates and only without ``chat``, a ``kind`` the model has, no second text for the
measures of a model that is no encoder-decoder (see ``attnscope.serve.schema``). Only the last
check is adjusted: a request the schema allows may still be refused with 422 for what depends on
the input and the model together (more tokens than the limit, a head or layer the model does not
have, fewer than two sentences as the model's tokenizer cuts the text); any other 4xx on valid data fails. And a schema-violating request whose body is over the
server's size limit is rightly refused with 413 before it is parsed: schemathesis does not count 413
as a rejection (a prompt over its ``maxLength`` written with escapes can pass 1 MB).
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import jsonschema
import pytest
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import CHECKS
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

from attnscope.serve.app import create_app
from attnscope.serve.guard import AllowedHosts

from .conftest import build_tiny_model

# the schema is read when the module is collected; the models load on the first request.
# schemathesis's ASGI client sends "Host: testserver"
HOSTS = AllowedHosts.listening_on(extra=["testserver"])
TINY_LLAMA = str(build_tiny_model("llama", Path(tempfile.mkdtemp(prefix="attnscope-schema-")) / "tiny-llama"))
APP = create_app(["minilm", TINY_LLAMA], installed_aliases=False, preload=False, hosts=HOSTS)
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
# the sentences of a text depend on how the model's tokenizer cuts it (the sentence view needs two at least)
MODEL_DEPENDENT = re.compile(r"tokens long|there is no (head|layer) |(head|layer) \d+ does not exist|'s limit of \d+ tokens"
                             r"|is outside|is after query|the text has (no|\d+) sentence|covers the whole text of \d+ tokens")


def valid_data_is_accepted(ctx, response, case):
    """``positive_data_acceptance``, but a 422 for a model-dependent limit is an accepted answer."""
    if response.status_code == 422 and MODEL_DEPENDENT.search(response.json()["detail"]):
        return None
    return positive_data_acceptance(ctx, response, case)


def invalid_data_is_rejected(ctx, response, case):
    """``negative_data_rejection``, but 413 (the body is over the size limit) is a rejection too."""
    if response.status_code == 413:
        return None
    return negative_data_rejection(ctx, response, case)


def enabled_checks() -> list[str]:
    """The names of the checks ``call_and_validate`` runs by default (as schemathesis chooses them)."""
    config = schema.config.checks_config_for(operation=next(schema.get_all_operations()).ok(), phase=None)
    return sorted(check.__name__ for check in CHECKS.get_all()
                  if not isinstance(check, type) and config.get_by_name(name=check.__name__).enabled)


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_server_does_what_its_schema_says(case):
    response = case.call_and_validate(excluded_checks=[positive_data_acceptance, negative_data_rejection],
                                      additional_checks=[valid_data_is_accepted, invalid_data_is_rejected])
    # the checks above raise on a failure; what they leave is an answer the schema documents (405 to a method
    # the path does not have, which schemathesis also sends), never a 5xx
    if response.request.method.upper() == case.operation.method.upper():
        answered = case.operation.responses.find_by_status_code(response.status_code) is not None
    else:
        answered = response.status_code == 405
    assert answered and response.status_code < 500, (f"{response.request.method} {case.operation.path}: "
                                                      f"{response.status_code}, documented "
                                                      f"{case.operation.responses.status_codes}")


def test_the_checks_include_response_conformance_and_data_acceptance():
    assert {"not_a_server_error", "status_code_conformance", "content_type_conformance",
            "response_schema_conformance", "response_headers_conformance", "negative_data_rejection",
            "positive_data_acceptance", "unsupported_method"} <= set(enabled_checks()), enabled_checks()


def body_validator(app, name: str) -> jsonschema.Draft202012Validator:
    """A validator of request body ``name`` as the app's published schema states it."""
    from fastapi.testclient import TestClient

    document = TestClient(app, base_url="http://testserver").get("/openapi.json").json()
    return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", **document})


# the three requests schemathesis found (issue 25, item 8): allowed by the schema, refused by a server of minilm
FOUND = [("GenerateRequest", {"prompt": "Write one sentence about the sea.", "model": None}),
         ("InterveneRequest", {"text": "I went to the store.", "kind": "cross", "layers": [0], "model": None}),
         ("MixingRequest", {"text": "I went to the store.", "pair": "I bought milk.", "method": "alti", "model": None})]


@pytest.mark.parametrize(("body", "request_"), FOUND, ids=[body for body, _ in FOUND])
def test_the_schema_of_an_encoder_only_server_refuses_what_the_server_refuses(body, request_):
    app = create_app(["minilm"], installed_aliases=False, preload=False, hosts=HOSTS)
    from fastapi.testclient import TestClient

    paths = TestClient(app, base_url="http://testserver").get("/openapi.json").json()["paths"]
    if body == "GenerateRequest":
        assert "/api/generate" not in paths  # no model here generates
        return
    assert not body_validator(app, body).is_valid(request_)
    assert body_validator(app, body).is_valid({**request_, "kind": "self"} if body == "InterveneRequest"
                                              else {**request_, "pair": None})


def test_generation_defaults_to_the_first_model_that_generates_and_chat_needs_a_template():
    from fastapi.testclient import TestClient

    validator = body_validator(APP, "GenerateRequest")
    assert validator.is_valid({"prompt": "Hi", "model": None}) and not validator.is_valid({"prompt": "Hi",
                                                                                          "model": "minilm"})
    assert not validator.is_valid({"prompt": "Hi", "chat": True})  # the tiny Llama has no chat template
    answer = TestClient(APP, base_url="http://testserver").post("/api/generate", json={"prompt": "Hi",
                                                                                       "max_new_tokens": 2})
    assert answer.status_code == 200 and answer.json()["model"] == Path(TINY_LLAMA).name


def test_a_request_that_leaves_out_the_model_is_tied_to_the_default_model():
    """What schemathesis found next: no ``model`` key at all is the default model (minilm), whose
    measures take no second text, though another model offered (the toy translator) reads one."""
    app = create_app(["minilm", "toy-translator"], installed_aliases=False, preload=False, hosts=HOSTS)
    validator = body_validator(app, "MixingRequest")
    request = {"text": "I went to the store.", "pair": "I bought milk.", "method": "alti"}
    assert not validator.is_valid(request) and validator.is_valid({**request, "model": "toy-translator"})
    assert validator.is_valid({key: value for key, value in request.items() if key != "pair"})


def test_an_empty_model_name_is_refused_as_the_schema_says():
    """What schemathesis found next: "" was taken for the default model, though the schema allows only
    the offered names (or null)."""
    from fastapi.testclient import TestClient

    client = TestClient(APP, base_url="http://testserver")
    assert client.post("/api/analyze", json={"model": "", "text": "hi"}).status_code == 404
    assert not body_validator(APP, "AnalyzeRequest").is_valid({"model": "", "text": "hi"})
