"""Property-based tests of the explorer's API against its own OpenAPI schema (schemathesis).

Every check schemathesis enables by default runs on every generated request, valid or not
(``enabled_checks`` lists them): no 5xx; documented status codes, content types and headers;
response bodies that match their schema; schema-violating requests rejected (so the server
coerces nothing the schema forbids, e.g. ``0`` for ``false``); unsupported methods answered 405
with an ``Allow`` header; and valid requests accepted. Only that last check is adjusted: a request
the schema allows may still be refused with 422 for what depends on the chosen model and cannot
be written into one schema (more tokens than the limit, a head, layer or attention kind the
model does not have, generation with a model that does not generate or has no chat template, a
second sentence for the context-mixing measures of a model that is no encoder-decoder);
any other 4xx on valid data fails.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import CHECKS
from schemathesis.specs.openapi.checks import positive_data_acceptance

from attnscope.serve.app import create_app
from attnscope.serve.guard import AllowedHosts

# the schema is read when the module is collected; the model loads on the first request.
# schemathesis's ASGI client sends "Host: testserver"
APP = create_app(["minilm"], installed_aliases=False, preload=False, hosts=AllowedHosts.listening_on(extra=["testserver"]))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
MODEL_DEPENDENT = re.compile(r"tokens long|there is no (head|layer) |has no '\w+' attention|"
                             r"not a decoder-only language model|has no chat template|'s limit of \d+ tokens|"
                             r"measures take one text")


def valid_data_is_accepted(ctx, response, case):
    """``positive_data_acceptance``, but a 422 for a model-dependent limit is an accepted answer."""
    if response.status_code == 422 and MODEL_DEPENDENT.search(response.json()["detail"]):
        return None
    return positive_data_acceptance(ctx, response, case)


def enabled_checks() -> list[str]:
    """The names of the checks ``call_and_validate`` runs by default (as schemathesis chooses them)."""
    config = schema.config.checks_config_for(operation=next(schema.get_all_operations()).ok(), phase=None)
    return sorted(check.__name__ for check in CHECKS.get_all()
                  if not isinstance(check, type) and config.get_by_name(name=check.__name__).enabled)


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_the_server_does_what_its_schema_says(case):
    case.call_and_validate(excluded_checks=[positive_data_acceptance], additional_checks=[valid_data_is_accepted])


def test_the_checks_include_response_conformance_and_data_acceptance():
    assert {"not_a_server_error", "status_code_conformance", "content_type_conformance",
            "response_schema_conformance", "response_headers_conformance", "negative_data_rejection",
            "positive_data_acceptance", "unsupported_method"} <= set(enabled_checks()), enabled_checks()
