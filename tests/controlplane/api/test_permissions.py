"""Every endpoint against every kind of caller: who gets in, who gets 401 or 403.

Detail paths use an id that does not exist and writes send an empty body, so a caller who is let
in gets 404 or 400 and nothing is written: these tests check the permission layer only.
"""

import base64

import pytest
from rest_framework.test import APIClient

from tests.controlplane.api.helpers import PASSWORD, assert_error

MISSING = 999_999_999
READERS = {"admin", "operator", "auditor"}
OPERATORS = {"admin", "operator"}
ADMIN = {"admin"}
TENANT_READERS = {"admin", "auditor"}

# (method, path, the roles allowed; "tenant" is an API key)
ENDPOINTS = [
    ("get", "/api/v1/clusters/", READERS),
    ("post", "/api/v1/clusters/", ADMIN),
    ("get", "/api/v1/clusters/{id}/", READERS),
    ("get", "/api/v1/nodes/", READERS),
    ("post", "/api/v1/nodes/", ADMIN),
    ("get", "/api/v1/nodes/{id}/", READERS),
    ("get", "/api/v1/pools/", READERS),
    ("post", "/api/v1/pools/", ADMIN),
    ("get", "/api/v1/pools/{id}/", READERS),
    ("patch", "/api/v1/pools/{id}/", OPERATORS),
    ("post", "/api/v1/pools/{id}/scale/", OPERATORS),
    ("post", "/api/v1/pools/{id}/autoscale/", OPERATORS),
    ("post", "/api/v1/pools/{id}/start-instance/", OPERATORS),
    ("get", "/api/v1/instances/", READERS),
    ("get", "/api/v1/instances/{id}/", READERS),
    ("post", "/api/v1/instances/{id}/drain/", OPERATORS),
    ("post", "/api/v1/instances/{id}/stop/", OPERATORS),
    ("post", "/api/v1/instances/{id}/resume/", OPERATORS),
    ("get", "/api/v1/scaling-events/", READERS),
    ("get", "/api/v1/scaling-events/{id}/", READERS),
    ("get", "/api/v1/traffic-classes/", READERS),
    ("post", "/api/v1/traffic-classes/", ADMIN),
    ("get", "/api/v1/traffic-classes/{id}/", READERS),
    ("get", "/api/v1/ttl-policies/", READERS),
    ("post", "/api/v1/ttl-policies/", ADMIN),
    ("get", "/api/v1/ttl-policies/current/", READERS),
    ("get", "/api/v1/ttl-policies/{id}/", READERS),
    ("get", "/api/v1/ep-layouts/", READERS),
    ("post", "/api/v1/ep-layouts/", ADMIN),
    ("get", "/api/v1/ep-layouts/{id}/", READERS),
    ("post", "/api/v1/ep-layouts/{id}/activate/", ADMIN),
    ("get", "/api/v1/ep-rebalance-policies/", READERS),
    ("post", "/api/v1/ep-rebalance-policies/", ADMIN),
    ("get", "/api/v1/ep-rebalance-policies/{id}/", READERS),
    ("patch", "/api/v1/ep-rebalance-policies/{id}/", ADMIN),
    ("get", "/api/v1/tenants/", TENANT_READERS),
    ("post", "/api/v1/tenants/", ADMIN),
    ("get", "/api/v1/tenants/{id}/", TENANT_READERS),
    ("patch", "/api/v1/tenants/{id}/", ADMIN),
    ("get", "/api/v1/keys/", TENANT_READERS | {"tenant"}),
    ("post", "/api/v1/keys/", ADMIN),
    ("get", "/api/v1/keys/{id}/", TENANT_READERS | {"tenant"}),
    ("post", "/api/v1/keys/{id}/revoke/", ADMIN | {"tenant"}),
    ("get", "/api/v1/usage/", TENANT_READERS | {"tenant"}),
    ("get", "/api/v1/usage/{id}/", TENANT_READERS | {"tenant"}),
]
ENDPOINT_IDS = [f"{method.upper()} {path}" for method, path, _ in ENDPOINTS]


def call(client, method: str, path: str):
    body = {} if method in ("post", "patch") else None
    return getattr(client, method)(path.format(id=MISSING), body)


def test_the_table_covers_every_endpoint_in_the_schema(client_as):
    schema = client_as("anonymous").get("/api/v1/schema/?format=json").json()
    in_schema = {(method, path) for path, item in schema["paths"].items() for method in item}
    assert in_schema == {(method, path) for method, path, _ in ENDPOINTS}


@pytest.mark.parametrize(("method", "path", "allowed"), ENDPOINTS, ids=ENDPOINT_IDS)
def test_anonymous_gets_401_everywhere(client_as, method, path, allowed):
    response = call(client_as("anonymous"), method, path)

    assert_error(response, 401, "authentication_error")
    assert response["WWW-Authenticate"] == 'Bearer realm="api"'


@pytest.mark.parametrize("role", ["admin", "superuser", "operator", "auditor", "tenant"])
@pytest.mark.parametrize(("method", "path", "allowed"), ENDPOINTS, ids=ENDPOINT_IDS)
def test_each_role_gets_in_exactly_where_allowed(client_as, role, method, path, allowed):
    # given
    client = client_as("tenant:acme" if role == "tenant" else role)

    # when
    response = call(client, method, path)

    # then
    if (role if role != "superuser" else "admin") not in allowed:
        assert_error(response, 403, "permission_denied")
    elif method == "get" and "{id}" not in path:
        assert response.status_code == 200, response.content
    else:
        assert response.status_code in (400, 404), response.content


@pytest.mark.parametrize(
    "header", ["Bearer sk-sluice-not-a-key", "Bearer", "Bearer two keys", "Basic bm9ib2R5Om5vdGhpbmc="]
)
def test_bad_credentials_get_401(client_as, make_api_key, header):
    make_api_key("acme")
    client = client_as("anonymous")
    client.credentials(HTTP_AUTHORIZATION=header)

    assert_error(client.get("/api/v1/keys/"), 401, "authentication_error")


def test_basic_auth_authenticates_users(client_as, make_user):
    make_user("auditor", username="audrey")
    client = client_as("anonymous")
    client.credentials(HTTP_AUTHORIZATION=_basic("audrey", PASSWORD))

    assert client.get("/api/v1/pools/").status_code == 200
    assert_error(client.post("/api/v1/clusters/", {"name": "x"}), 403, "permission_denied")


def test_a_user_without_a_role_gets_nothing(client_as, django_user_model):
    client = client_as("anonymous")
    client.force_login(django_user_model.objects.create_user("nobody"))

    assert_error(client.get("/api/v1/pools/"), 403, "permission_denied")


def test_session_writes_need_the_csrf_token(make_user):
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(make_user("admin"))

    error = assert_error(client.post("/api/v1/clusters/", {"name": "x"}), 403, "permission_denied")
    assert "CSRF" in error["message"]


def _basic(username: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{username}:{password}".encode()).decode()
