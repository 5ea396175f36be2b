"""Property-based tests of the explorer's API against its own OpenAPI schema (schemathesis):
whatever the generated input, valid or not, the server answers without a 5xx, with a documented
status code and a response of the documented content type."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

from attnscope.serve.app import create_app

# the schema is read when the module is collected; the model loads on the first request
schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(["minilm"], installed_aliases=False, preload=False))


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_generated_input_gets_a_server_error(case):
    case.call_and_validate(checks=[not_a_server_error, status_code_conformance, content_type_conformance])
