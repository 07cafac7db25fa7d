import pytest

from controlplane.policies import tasks
from controlplane.policies.models import EPLayout, TrafficClass, TTLPolicy
from controlplane.topology.models import ScalingEvent
from tests.controlplane.api.helpers import assert_error


def test_the_data_migration_classes_are_listed(client_as):
    listed = client_as("auditor").get("/api/v1/traffic-classes/").json()["results"]

    assert [row["name"] for row in listed] == ["agent", "chat"]


def test_a_ttl_edit_is_a_new_version_pushed_once_committed(client_as, django_capture_on_commit_callbacks):
    # given
    admin = client_as("admin")

    # when
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        created = admin.post("/api/v1/ttl-policies/", {"traffic_class": "agent", "ttl_seconds": 3600, "reason": "x"})

    # then
    assert created.status_code == 201, created.content
    assert (created.json()["version"], created.json()["created_by_label"]) == (2, "admin-user")
    assert [callback.func for callback in callbacks] == [tasks.ttl_policy_push_task.delay]
    current = admin.get("/api/v1/ttl-policies/current/").json()
    assert current == {
        "revision": created.json()["id"],
        "ttl_s": {"agent": 3600, "chat": 604800},
        "default_class": "chat",
    }
    versions = admin.get("/api/v1/ttl-policies/?traffic_class=agent").json()["results"]
    assert [(row["version"], row["ttl_seconds"]) for row in versions] == [(2, 3600), (1, 259200)]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"traffic_class": "agent", "ttl_seconds": -1}, "ttl_seconds"),
        ({"traffic_class": "agent", "ttl_seconds": 0}, "ttl_seconds"),
        ({"traffic_class": "agent", "ttl_seconds": 2**40}, "ttl_seconds"),
        ({"traffic_class": "batch", "ttl_seconds": 60}, "traffic_class"),
        ({"ttl_seconds": 60}, "traffic_class"),
    ],
)
def test_an_invalid_ttl_is_refused_field_by_field_and_nothing_changes(client_as, body, field):
    before = list(TTLPolicy.objects.values_list("id", "ttl_seconds"))

    error = assert_error(client_as("admin").post("/api/v1/ttl-policies/", body), 400, "validation_error")

    assert list(error["fields"]) == [field]
    assert list(TTLPolicy.objects.values_list("id", "ttl_seconds")) == before


def test_operators_cannot_edit_ttls_or_layouts(client_as, make_pool):
    operator = client_as("operator")
    pool = make_pool(num_experts=2, expert_slots_per_rank=2)
    body = {"pool": pool.id, "num_logical_experts": 2, "placement": [[[0, 1]]]}

    assert_error(
        operator.post("/api/v1/ttl-policies/", {"traffic_class": "agent", "ttl_seconds": 1}), 403, "permission_denied"
    )
    assert_error(operator.post("/api/v1/ep-layouts/", body), 403, "permission_denied")
    assert TTLPolicy.objects.count() == 2 and not EPLayout.objects.exists()


def test_admin_creates_a_traffic_class(client_as):
    created = client_as("admin").post("/api/v1/traffic-classes/", {"name": "batch", "description": "offline"})

    assert created.status_code == 201, created.content
    assert TrafficClass.objects.filter(name="batch").exists()


@pytest.fixture
def moe_pool(make_pool):
    """4 experts, 2 slots per rank, up to 2 instances (so 2 ranks while none is live)."""
    return make_pool("moe", num_experts=4, expert_slots_per_rank=2, max_instances=2)


@pytest.mark.parametrize(
    ("num_logical_experts", "placement", "field"),
    [
        (4, [[[0, 1], [2, 3]], [[0, 1], [1, 2]]], "placement"),  # expert 3 has no slot in layer 1
        (4, [[[0, 1], [2, 4]]], "placement"),  # expert 4 does not exist
        (4, [[[0, 1, 2], [3, 0, 1]]], "placement"),  # 3 slots on ranks that have 2
        (4, [[[0, 1], [2, 3]], [[0, 1, 2], [3]]], "placement"),  # ranks of different slot counts
        (4, [[[0], [1], [2, 3]]], "placement"),  # 3 ranks, the pool has 2
        (4, [[0, 1], [2, 3]], "placement.0.0"),  # no layer dimension: a rank where a list of slots belongs
        (4, [], "placement"),
        (3, [[[0, 1], [2, 0]]], "num_logical_experts"),  # the pool's model has 4
    ],
)
def test_an_invalid_ep_layout_is_refused_field_by_field(client_as, moe_pool, num_logical_experts, placement, field):
    body = {"pool": moe_pool.id, "num_logical_experts": num_logical_experts, "placement": placement}

    error = assert_error(client_as("admin").post("/api/v1/ep-layouts/", body), 400, "validation_error")

    assert field in error["fields"], error
    assert not EPLayout.objects.exists()


def test_a_layout_is_created_inactive_then_activated_and_audited(
    client_as, moe_pool, django_capture_on_commit_callbacks
):
    # given
    admin = client_as("admin")
    body = {"pool": moe_pool.id, "num_logical_experts": 4, "placement": [[[0, 1], [2, 3]], [[3, 2], [1, 0]]]}
    created = admin.post("/api/v1/ep-layouts/", body)
    assert created.status_code == 201, created.content
    assert (created.json()["version"], created.json()["is_active"]) == (1, False)
    layout_id = created.json()["id"]

    # when
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        activated = admin.post(f"/api/v1/ep-layouts/{layout_id}/activate/", {"reason": "rebalance"})

    # then
    assert activated.status_code == 200, activated.content
    assert activated.json()["is_active"] is True
    assert [(callback.func, callback.args) for callback in callbacks] == [
        (tasks.ep_layout_push_task.delay, (layout_id,))
    ]
    event = ScalingEvent.objects.get()
    assert (event.action, event.pool_id, event.reason) == ("ep_layout_applied", moe_pool.id, "rebalance")
    assert_error(admin.post(f"/api/v1/ep-layouts/{layout_id}/activate/", {}), 409, "conflict")
    assert [row["id"] for row in admin.get("/api/v1/ep-layouts/?is_active=true").json()["results"]] == [layout_id]
