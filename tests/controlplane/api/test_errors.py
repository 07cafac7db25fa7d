"""The one error body, for each status the API answers with."""

import pytest

from controlplane.topology import services
from controlplane.topology.models import ScalingEvent
from tests.controlplane.api.helpers import assert_error


def test_400_carries_field_level_messages(client_as):
    error = assert_error(client_as("admin").post("/api/v1/clusters/", {}), 400, "validation_error")

    assert error["fields"] == {"name": ["This field is required."]}


def test_400_for_a_body_that_is_not_json(client_as):
    response = client_as("admin").post("/api/v1/clusters/", "{not json", content_type="application/json")

    assert_error(response, 400, "parse_error")


def test_400_for_a_body_that_is_not_an_object(client_as):
    response = client_as("admin").post("/api/v1/clusters/", [1, 2])

    error = assert_error(response, 400, "validation_error")
    assert error["fields"] == {} and "dictionary" in error["message"]


def test_nested_field_errors_are_dotted_paths(client_as, make_pool):
    pool = make_pool(num_experts=2, expert_slots_per_rank=2)
    body = {"pool": pool.id, "num_logical_experts": 2, "placement": [[[0, "x"]]]}

    error = assert_error(client_as("admin").post("/api/v1/ep-layouts/", body), 400, "validation_error")

    assert list(error["fields"]) == ["placement.0.0.1"]


def test_401(client_as):
    assert_error(client_as("anonymous").get("/api/v1/pools/"), 401, "authentication_error")


def test_403(client_as):
    assert_error(client_as("auditor").post("/api/v1/clusters/", {"name": "x"}), 403, "permission_denied")


@pytest.mark.parametrize("path", ["/api/v1/", "/api/v1/nope/", "/api/v1/pools/1/nope/", "/api/v1/pools"])
@pytest.mark.parametrize("method", ["get", "post", "delete"])
def test_404_for_unknown_urls_whoever_asks(client_as, path, method):
    for who in ["anonymous", "admin"]:
        assert_error(getattr(client_as(who), method)(path), 404, "not_found")


@pytest.mark.parametrize("pk", ["999999", "abc", "99999999999999999999"])
def test_404_for_unknown_objects(client_as, pk):
    assert_error(client_as("admin").get(f"/api/v1/pools/{pk}/"), 404, "not_found")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("put", "/api/v1/ttl-policies/1/"),
        ("patch", "/api/v1/ttl-policies/1/"),
        ("delete", "/api/v1/ttl-policies/1/"),
        ("delete", "/api/v1/scaling-events/1/"),
        ("put", "/api/v1/pools/1/"),
        ("get", "/api/v1/pools/1/scale/"),
        ("options", "/api/v1/pools/"),
    ],
)
def test_405_for_methods_an_endpoint_does_not_have(client_as, method, path):
    response = getattr(client_as("admin"), method)(path)

    assert_error(response, 405, "method_not_allowed")


def test_405_leaves_audit_rows_alone(client_as, make_pool):
    pool = make_pool()
    client_as("operator").post(f"/api/v1/pools/{pool.id}/scale/", {"target_instances": 1})
    event = ScalingEvent.objects.get()

    assert_error(client_as("admin").delete(f"/api/v1/scaling-events/{event.id}/"), 405, "method_not_allowed")
    assert ScalingEvent.objects.filter(pk=event.pk).exists()


def test_409_for_a_transition_the_state_does_not_allow(client_as, make_pool, make_instance):
    instance = make_instance(make_pool())

    response = client_as("operator").post(f"/api/v1/instances/{instance.id}/resume/", {})

    error = assert_error(response, 409, "conflict")
    assert "draining" in error["message"]


@pytest.mark.parametrize("name", ["a\x00b", "\ud800", 5, [1], None])
def test_a_malformed_name_reference_is_a_field_error(client_as, name):
    response = client_as("admin").post("/api/v1/ttl-policies/", {"traffic_class": name, "ttl_seconds": 5})

    assert list(assert_error(response, 400, "validation_error")["fields"]) == ["traffic_class"]


def test_an_error_quoting_a_lone_surrogate_still_renders(client_as, make_pool):
    response = client_as("admin").post("/api/v1/pools/", {"kind": "\ud800"})

    assert "kind" in assert_error(response, 400, "validation_error")["fields"]


def test_500_for_an_unexpected_error_in_the_same_shape(client_as, monkeypatch):
    def broken(**_):
        raise RuntimeError("a bug")

    monkeypatch.setattr(services, "cluster_create", broken)

    error = assert_error(client_as("admin").post("/api/v1/clusters/", {"name": "main"}), 500, "server_error")

    assert "a bug" not in error["message"]
