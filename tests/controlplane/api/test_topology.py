import pytest
from django.utils import timezone

from controlplane.topology import tasks
from controlplane.topology.models import EngineInstance, Pool, ScalingEvent
from tests.controlplane.api.helpers import assert_error

POOL = {"name": "prefill", "kind": "prefill", "model": "smollm2-135m-instruct", "min_instances": 1, "max_instances": 3}


def _cluster_id(client) -> int:
    return client.post("/api/v1/clusters/", {"name": "main"}).json()["id"]


def test_admin_creates_a_cluster_a_node_and_a_pool(client_as):
    admin = client_as("admin")
    cluster_id = _cluster_id(admin)

    node = admin.post("/api/v1/nodes/", {"cluster": cluster_id, "hostname": "gpu-0", "accelerator_kind": "h200"})
    pool = admin.post("/api/v1/pools/", {"cluster": cluster_id, **POOL})

    assert node.status_code == 201, node.content
    assert pool.status_code == 201, pool.content
    assert pool.json()["target_instances"] == 1  # the minimum, until it is scaled


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"kind": "gpu"}, "kind"),
        ({"min_instances": 3, "max_instances": 1}, "max_instances"),
        ({"min_instances": -1}, "min_instances"),
        ({"target_instances": 5}, "target_instances"),
        ({"name": "not a slug"}, "name"),
        ({"quantization": "int4"}, "quantization"),
        ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype"),
    ],
)
def test_an_invalid_pool_is_refused_field_by_field_and_not_created(client_as, fields, field):
    admin = client_as("admin")
    body = {"cluster": _cluster_id(admin), **POOL, **fields}

    error = assert_error(admin.post("/api/v1/pools/", body), 400, "validation_error")

    assert field in error["fields"], error
    assert not Pool.objects.exists()


def test_a_pool_s_precision_is_set_at_creation_and_defaults_to_unquantized(client_as):
    admin = client_as("admin")
    cluster_id = _cluster_id(admin)

    plain = admin.post("/api/v1/pools/", {"cluster": cluster_id, **POOL})
    fp8 = admin.post(
        "/api/v1/pools/",
        {"cluster": cluster_id, **POOL, "name": "fp8", "quantization": "fp8", "kv_cache_dtype": "fp8"},
    )

    assert (plain.json()["quantization"], plain.json()["kv_cache_dtype"]) == ("", "auto")
    assert fp8.status_code == 201, fp8.content
    assert (fp8.json()["quantization"], fp8.json()["kv_cache_dtype"]) == ("fp8", "fp8")
    assert Pool.objects.get(name="fp8").kv_cache_dtype == "fp8"


def test_patch_changes_the_precision_and_refuses_an_unknown_one_naming_the_field(client_as, make_pool):
    pool = make_pool(min_instances=1, max_instances=4, target_instances=2)
    operator = client_as("operator")

    changed = operator.patch(f"/api/v1/pools/{pool.id}/", {"kv_cache_dtype": "fp8"})
    refused = operator.patch(f"/api/v1/pools/{pool.id}/", {"quantization": "fp8", "kv_cache_dtype": "int8"})

    assert changed.status_code == 200, changed.content
    assert changed.json()["kv_cache_dtype"] == "fp8"
    assert list(assert_error(refused, 400, "validation_error")["fields"]) == ["kv_cache_dtype"]
    pool.refresh_from_db()
    assert (pool.quantization, pool.kv_cache_dtype, pool.max_instances) == ("", "fp8", 4)


def test_bounds_are_edited_with_patch_and_checked_against_the_target(client_as, make_pool):
    # given
    pool = make_pool(min_instances=1, max_instances=4, target_instances=3)
    operator = client_as("operator")

    # when
    narrowed = operator.patch(f"/api/v1/pools/{pool.id}/", {"max_instances": 3})
    refused = operator.patch(f"/api/v1/pools/{pool.id}/", {"max_instances": 2})
    inverted = operator.patch(f"/api/v1/pools/{pool.id}/", {"min_instances": 3, "max_instances": 2})

    # then
    assert narrowed.status_code == 200, narrowed.content
    assert "target_instances" in assert_error(refused, 400, "validation_error")["fields"]
    assert "max_instances" in assert_error(inverted, 400, "validation_error")["fields"]
    pool.refresh_from_db()
    assert (pool.min_instances, pool.max_instances, pool.target_instances) == (1, 3, 3)


def test_patch_cannot_change_the_target(client_as, make_pool):
    pool = make_pool(target_instances=1)

    client_as("admin").patch(f"/api/v1/pools/{pool.id}/", {"target_instances": 4})

    pool.refresh_from_db()
    assert pool.target_instances == 1


def test_scaling_writes_an_audited_event(client_as, make_pool, make_user):
    # given
    pool = make_pool(target_instances=1)
    operator = client_as("operator")

    # when
    response = operator.post(f"/api/v1/pools/{pool.id}/scale/", {"target_instances": 3, "reason": "peak"})

    # then
    assert response.status_code == 200, response.content
    assert response.json()["target_instances"] == 3
    event = ScalingEvent.objects.get()
    assert (event.action, event.pool_id, event.actor.username, event.reason) == (
        "pool_scaled",
        pool.id,
        "operator-user",
        "peak",
    )
    assert (event.before, event.after) == ({"target_instances": 1}, {"target_instances": 3})
    listed = operator.get(f"/api/v1/scaling-events/?pool={pool.id}").json()["results"]
    assert [(row["action"], row["actor_label"]) for row in listed] == [("pool_scaled", "operator-user")]


def test_a_target_outside_the_bounds_is_refused_and_nothing_is_recorded(client_as, make_pool):
    pool = make_pool(min_instances=1, max_instances=4, target_instances=2)

    response = client_as("operator").post(f"/api/v1/pools/{pool.id}/scale/", {"target_instances": 5})

    assert "target_instances" in assert_error(response, 400, "validation_error")["fields"]
    pool.refresh_from_db()
    assert pool.target_instances == 2
    assert not ScalingEvent.objects.exists()


def test_the_scale_rate_limit_is_a_conflict(client_as, make_pool):
    pool = make_pool(max_instances=10, target_instances=0, scale_up_max_per_window=2)
    operator = client_as("operator")
    operator.post(f"/api/v1/pools/{pool.id}/scale/", {"target_instances": 2})

    response = operator.post(f"/api/v1/pools/{pool.id}/scale/", {"target_instances": 3})

    assert "limit" in assert_error(response, 409, "conflict")["message"]
    assert ScalingEvent.objects.count() == 1


def test_drain_queues_the_drain_task_once_committed(
    client_as, make_pool, make_instance, django_capture_on_commit_callbacks
):
    # given
    instance = make_instance(make_pool())
    operator = client_as("operator")

    # when
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = operator.post(f"/api/v1/instances/{instance.id}/drain/", {"reason": "maintenance"})

    # then
    assert response.status_code == 200, response.content
    assert response.json()["state"] == "draining"
    # The pool's default grace period goes to the worker.
    assert [(callback.func, callback.args) for callback in callbacks] == [
        (tasks.instance_drain_task.delay, (instance.id, 60.0))
    ]
    event = ScalingEvent.objects.filter(action="instance_drain_requested").get()
    assert (event.instance_id, event.reason, event.actor_label) == (instance.id, "maintenance", "operator-user")
    assert event.after == {"state": "draining", "grace_s": 60.0}


def test_a_drain_s_grace_is_the_request_s_or_the_pool_s_and_a_bad_one_changes_nothing(
    client_as, make_pool, make_instance, django_capture_on_commit_callbacks
):
    pool = make_pool()
    Pool.objects.filter(pk=pool.pk).update(drain_grace_s=5.0)
    short, default, refused = make_instance(pool, "d0"), make_instance(pool, "d1"), make_instance(pool, "d2")
    operator = client_as("operator")

    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        operator.post(f"/api/v1/instances/{short.id}/drain/", {"grace_s": 2})
        operator.post(f"/api/v1/instances/{default.id}/drain/", {})
        negative = operator.post(f"/api/v1/instances/{refused.id}/drain/", {"grace_s": -1})
        text = operator.post(f"/api/v1/instances/{refused.id}/drain/", {"grace_s": "soon"})

    assert [callback.args for callback in callbacks] == [(short.id, 2.0), (default.id, 5.0)]
    assert "grace_s" in assert_error(negative, 400, "validation_error")["fields"]
    assert "grace_s" in assert_error(text, 400, "validation_error")["fields"]
    refused.refresh_from_db()
    assert refused.state == "ready"
    assert not ScalingEvent.objects.filter(instance=refused, action="instance_drain_requested").exists()


def test_resume_cancels_a_drain_and_stop_stops(client_as, make_pool, make_instance, django_capture_on_commit_callbacks):
    instance = make_instance(make_pool())
    operator = client_as("operator")

    with django_capture_on_commit_callbacks(execute=False):
        operator.post(f"/api/v1/instances/{instance.id}/drain/", {})
        resumed = operator.post(f"/api/v1/instances/{instance.id}/resume/", {})
        stopped = operator.post(f"/api/v1/instances/{instance.id}/stop/", {})

    assert (resumed.json()["state"], stopped.json()["state"]) == ("ready", "stopped")
    assert_error(operator.post(f"/api/v1/instances/{instance.id}/drain/", {}), 409, "conflict")


def test_instances_filter_by_pool_and_state(client_as, make_pool, make_instance):
    decode, prefill = make_pool("decode"), make_pool("prefill", kind="prefill")
    make_instance(decode, "d0")
    make_instance(decode, "d1")
    make_instance(prefill, "p0")
    EngineInstance.objects.filter(worker_id="d1").update(state="failed")
    auditor = client_as("auditor")

    def worker_ids(query: str) -> list[str]:
        return [row["worker_id"] for row in auditor.get(f"/api/v1/instances/?{query}").json()["results"]]

    assert worker_ids(f"pool={decode.id}") == ["d0", "d1"]
    assert worker_ids(f"pool={decode.id}&state=ready") == ["d0"]
    assert worker_ids("state=ready&ordering=-worker_id") == ["p0", "d0"]
    assert "state" in assert_error(auditor.get("/api/v1/instances/?state=bogus"), 400, "validation_error")["fields"]


def test_scaling_events_filter_by_time_and_page_newest_first(client_as, make_pool):
    pool = make_pool(max_instances=10, target_instances=0, scale_up_max_per_window=10)
    operator = client_as("operator")
    for target in range(1, 4):
        operator.post(f"/api/v1/pools/{pool.id}/scale/", {"target_instances": target})
    cutoff = ScalingEvent.objects.get(after={"target_instances": 2}).created_at

    page = operator.get("/api/v1/scaling-events/?limit=2").json()
    since = operator.get("/api/v1/scaling-events/", {"since": cutoff.isoformat()}).json()
    until = operator.get("/api/v1/scaling-events/", {"until": cutoff.isoformat()}).json()
    future = operator.get(
        "/api/v1/scaling-events/", {"since": (timezone.now() + timezone.timedelta(days=1)).isoformat()}
    )

    assert page["count"] == 3 and page["next"] is not None
    assert [row["after"]["target_instances"] for row in page["results"]] == [3, 2]
    assert [row["after"]["target_instances"] for row in since["results"]] == [3, 2]
    assert [row["after"]["target_instances"] for row in until["results"]] == [1]
    assert future.json()["count"] == 0


def test_pages_hold_at_most_500(client_as, make_pool):
    make_pool()

    page = client_as("auditor").get("/api/v1/pools/?limit=100000").json()

    assert page["count"] == 1 and len(page["results"]) == 1


@pytest.mark.parametrize("since", ["2026-01-01T00:00:00-17:10", "0001-01-01T00:00:00+01:00", "yesterday"])
def test_scaling_event_times_postgres_cannot_take_are_handled(client_as, since):
    response = client_as("auditor").get("/api/v1/scaling-events/", {"since": since})

    if since.startswith("2026"):
        assert response.status_code == 200, response.content
    else:
        assert "since" in assert_error(response, 400, "validation_error")["fields"]
