"""The OpenAPI schema is valid, and the API honours it under generated requests (schemathesis)."""

import base64
from collections import Counter
from collections.abc import Callable

import pytest
import schemathesis
from django.core import signals
from django.core.management import call_command
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

from tests.controlplane.api.helpers import PASSWORD

# Checks left out, as the API is lenient where they are strict. Requests the schema allows can still be
# refused (a duplicate name, min > max, a target outside the pool's bounds), and DRF accepts some that it
# does not: a number for a string field, a malformed `limit` (which means the default).
LENIENT_CHECKS = [positive_data_acceptance, negative_data_rejection]
GENERATED = settings(
    max_examples=10,
    deadline=None,
    derandomize=True,  # the same requests every run
    suppress_health_check=list(HealthCheck),
)


def test_the_schema_validates_without_warnings(tmp_path):
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(tmp_path / "schema.yaml"))


@pytest.fixture
def wsgi_app(db):
    """The whole Django app, in this test's transaction (so whatever schemathesis writes is rolled back).

    Django closes "obsolete" connections around each request, which inside a test transaction means
    ending it; the test client skips that the same way.
    """
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield get_wsgi_application()
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


@pytest.fixture
def api_schema(wsgi_app):
    return schemathesis.openapi.from_wsgi("/api/v1/schema/?format=json", wsgi_app)


def _fuzz(api_schema, mode: GenerationMode, send: Callable) -> tuple[dict[str, str], Counter]:
    """`send(case)` for each operation's generated cases: ({operation: failure}, response statuses)."""
    failures, statuses = {}, Counter()
    for result in api_schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy(generation_mode=mode))
        @GENERATED
        def run(case):
            statuses[send(case).status_code] += 1

        try:
            run()
        except (Exception, BaseExceptionGroup) as failure:  # schemathesis groups its check failures
            failures[operation.label] = str(failure)[:3000]
    return failures, statuses


def _report(failures: dict[str, str]) -> str:
    return "\n\n".join(f"{label}: {failure}" for label, failure in failures.items())


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_an_admin_gets_no_server_error_and_only_documented_responses(api_schema, make_user, mode):
    # given
    make_user("superuser", username="root")
    headers = {"Authorization": "Basic " + base64.b64encode(f"root:{PASSWORD}".encode()).decode()}

    def send(case):
        # Every other check runs: no 5xx, only documented status codes, bodies (errors too) as documented.
        return case.call_and_validate(headers=headers, excluded_checks=LENIENT_CHECKS)

    # when
    failures, statuses = _fuzz(api_schema, mode, send)

    # then
    assert not failures, _report(failures)
    assert 401 not in statuses and statuses[200] > 0, statuses


def test_anonymous_requests_all_get_401(api_schema):
    def send(case):
        response = case.call()
        assert response.status_code == 401, (case.method, case.formatted_path, response.text)
        return response

    failures, _ = _fuzz(api_schema, GenerationMode.POSITIVE, send)

    assert not failures, _report(failures)


def test_the_schema_and_its_docs_are_public(client):
    schema = client.get("/api/v1/schema/?format=json")
    docs = client.get("/api/v1/docs/")

    assert schema.status_code == 200
    assert {"apiKey", "basicAuth", "cookieAuth"} == set(schema.json()["components"]["securitySchemes"])
    assert docs.status_code == 200 and b"swagger" in docs.content.lower()
