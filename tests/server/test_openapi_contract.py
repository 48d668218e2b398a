"""schemathesis against the server's own OpenAPI schema: no 5xx, no response that violates the
schema (bodies, status codes, content types), for generated valid and invalid requests.

The schema is read from the live server inside the test (schemathesis' pytest fixture loader
does not run under pytest 9), then each operation's Hypothesis strategy drives the calls.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from flashrec_core.testing.server_process import ServerProcess

from .conftest import API_KEY

OPERATIONS = ["POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models",
              "GET /v1/catalogs", "GET /health", "GET /ready", "GET /metrics"]  # fmt: skip
MUTATING = ["POST /v1/catalogs/{name}", "DELETE /v1/catalogs/{name}"]


@pytest.fixture(scope="module")
def own_server(checkpoint):
    """Generated catalog uploads may replace the default catalog: not on the shared server."""
    from .conftest import server_args

    with ServerProcess(server_args(checkpoint)) as proc:
        yield proc


@pytest.mark.parametrize("label", OPERATIONS)
def test_operation_honours_its_schema(server: ServerProcess, label: str) -> None:
    _check(server, label)


@pytest.mark.parametrize("label", MUTATING)
def test_catalog_operations_honour_their_schema(own_server: ServerProcess, label: str) -> None:
    _check(own_server, label)


def _check(server: ServerProcess, label: str) -> None:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    [operation] = [r.ok() for r in schema.get_all_operations() if r.ok().label == label]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    # Whether a schema-valid body is accepted depends on the loaded model and catalog (n <= the
    # catalog's SIDs, the prompt <= the context in tokens, max_tokens >= the SID depth, token ids
    # < the vocabulary), which a static schema cannot state: such rejections must still be
    # documented 400s in the OpenAI error shape, which the remaining checks enforce.
    excluded = [schemathesis.checks.positive_data_acceptance]

    @given(case=operation.as_strategy())
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    def call(case) -> None:
        if isinstance(case.body, dict) and isinstance(case.body.get("timeout"), (int, float)):
            # a deadline shorter than a step answers 504 by design (test_api covers it): keep
            # generated deadlines long enough that the check looks at everything else
            case.body["timeout"] = max(case.body["timeout"], 60.0)
        case.call_and_validate(
            base_url=server.url, headers=headers, timeout=60, excluded_checks=excluded
        )

    call()
