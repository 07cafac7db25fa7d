"""The elastic-pool API: starting an instance on a node, pausing the autoscaler, scaling out of bounds;
each refusal in the one error shape with the database unchanged."""

import pytest

from controlplane.topology.models import EngineInstance, Node, Pool, ScalingEvent
from tests.controlplane.api.helpers import assert_error


@pytest.fixture
def pool(make_pool):
    pool = make_pool("prefill", kind="prefill", min_instances=0, max_instances=2, target_instances=0)
    Node.objects.create(cluster=pool.cluster, hostname="gpu-0")
    return pool


def rows() -> tuple[int, int, list]:
    return EngineInstance.objects.count(), ScalingEvent.objects.count(), list(Pool.objects.values().order_by("id"))


def test_an_operator_starts_an_instance_on_a_node(client_as, pool):
    response = client_as("operator").post(
        f"/api/v1/pools/{pool.id}/start-instance/", {"node": "gpu-0", "reason": "warm spare"}
    )

    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["state"], body["pid"], body["pool"]) == ("starting", None, pool.id)
    event = ScalingEvent.objects.get(instance_id=body["id"])
    assert (event.action, event.actor_label, event.reason) == (
        "instance_start_requested",
        "operator-user",
        "warm spare",
    )
    assert event.after["node"] == "gpu-0"


@pytest.mark.parametrize(
    ("path", "body", "status", "error_type", "field"),
    [
        ("pools/{pool}/start-instance/", {"node": "ghost"}, 400, "validation_error", "node"),
        ("pools/{pool}/start-instance/", {}, 400, "validation_error", "node"),
        ("pools/{pool}/start-instance/", {"node": "gpu-\x00"}, 400, "validation_error", "node"),
        ("pools/999999/start-instance/", {"node": "gpu-0"}, 404, "not_found", None),
        ("pools/{pool}/scale/", {"target_instances": 3}, 400, "validation_error", "target_instances"),
        ("pools/{pool}/scale/", {"target_instances": -1}, 400, "validation_error", "target_instances"),
        ("pools/{pool}/autoscale/", {"paused": "sometimes"}, 400, "validation_error", "paused"),
        ("pools/999999/autoscale/", {"paused": True}, 404, "not_found", None),
    ],
)
def test_bad_requests_get_the_error_shape_and_change_nothing(client_as, pool, path, body, status, error_type, field):
    operator = client_as("operator")
    before = rows()

    error = assert_error(operator.post(f"/api/v1/{path.format(pool=pool.id)}", body, format="json"), status, error_type)

    if field is not None:
        assert field in error["fields"], error
    assert rows() == before


def test_a_start_beyond_the_pools_max_is_refused(client_as, pool):
    operator = client_as("operator")
    for _ in range(2):
        assert operator.post(f"/api/v1/pools/{pool.id}/start-instance/", {"node": "gpu-0"}).status_code == 201
    before = rows()

    error = assert_error(
        operator.post(f"/api/v1/pools/{pool.id}/start-instance/", {"node": "gpu-0"}), 400, "validation_error"
    )

    assert "pool" in error["fields"]
    assert rows() == before


def test_pausing_the_autoscaler_is_audited_and_permission_checked(client_as, pool):
    paused = client_as("operator").post(f"/api/v1/pools/{pool.id}/autoscale/", {"paused": True, "reason": "test"})
    auditor = client_as("auditor")
    refused = auditor.post(f"/api/v1/pools/{pool.id}/autoscale/", {"paused": False})
    start_refused = auditor.post(f"/api/v1/pools/{pool.id}/start-instance/", {"node": "gpu-0"})

    assert paused.status_code == 200 and paused.json()["autoscale_paused"] is True
    assert_error(refused, 403, "permission_denied")
    assert_error(start_refused, 403, "permission_denied")
    assert Pool.objects.get(pk=pool.pk).autoscale_paused is True
    assert list(ScalingEvent.objects.values_list("action", "actor_label", "before", "after")) == [
        ("autoscale_paused", "operator-user", {"autoscale_paused": False}, {"autoscale_paused": True})
    ]
