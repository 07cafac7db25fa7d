from datetime import timedelta
from unittest import mock

import pytest
from django.utils import timezone

from controlplane.common.errors import ConflictError, DomainValidationError
from controlplane.topology import tasks
from controlplane.topology.models import ALLOWED_TRANSITIONS, EngineInstance, InstanceState, Node, Pool, ScalingEvent
from controlplane.topology.registry import TopologyRecorder
from controlplane.topology.services import (
    instance_drain,
    instance_record_ep_resize,
    instance_record_failover,
    instance_record_heartbeat,
    instance_register,
    instance_resume,
    instance_stop,
    instances_fail_silent,
    topology_ensure_local,
)
from workers.protocol.messages import WorkerHeartbeat

NOW = timezone.now().replace(microsecond=0)


def _register(pool_name: str = "decode", role: str = "decode", worker_id: str = "w0", **fields) -> EngineInstance:
    return instance_register(
        worker_id=worker_id,
        pool_name=pool_name,
        role=role,
        model="smollm2-135m-instruct",
        hostname=fields.pop("hostname", "host-a"),
        request_endpoint="tcp://10.0.0.1:7100",
        heartbeat_endpoint="tcp://10.0.0.1:7101",
        **fields,
    )


def _heartbeat(worker_id: str, *, state: str = "ready", at, **load) -> EngineInstance | None:
    fields = {"num_running": 0, "num_waiting": 0, "kv_usage": 0.0, "ttl_policy_version": 0, "ep_layout_version": 0}
    return instance_record_heartbeat(worker_id=worker_id, state=state, at=at, **{**fields, **load})


def _actions(instance: EngineInstance) -> list[str]:
    return list(instance.events.order_by("id").values_list("action", flat=True))


def test_register_creates_a_ready_instance_and_its_node(make_pool):
    # given
    make_pool("decode", kind="decode")

    # when
    instance = _register(ep_size=2, num_accelerators=2, accelerator_kind="h200", started_at=123.5)

    # then
    assert (instance.state, instance.ep_size, instance.started_at) == (InstanceState.READY, 2, 123.5)
    assert (instance.node.hostname, instance.node.accelerator_kind, instance.node.num_accelerators) == (
        "host-a",
        "h200",
        2,
    )
    assert _actions(instance) == ["instance_registered"]
    assert instance.events.get().actor_label == "system"


def test_register_refuses_an_unknown_pool(db):
    with pytest.raises(DomainValidationError) as raised:
        _register(pool_name="nope")

    assert "no pool named 'nope'" in raised.value.fields["pool"][0]
    assert not EngineInstance.objects.exists()


@pytest.mark.parametrize(("pool_kind", "role"), [("prefill", "decode"), ("decode", "mixed"), ("mixed", "prefill")])
def test_register_refuses_a_role_that_is_not_the_pools_kind(make_pool, pool_kind, role):
    make_pool("p", kind=pool_kind)

    with pytest.raises(DomainValidationError) as raised:
        _register(pool_name="p", role=role)

    assert f"kind is {pool_kind!r}" in raised.value.fields["role"][0]
    assert not EngineInstance.objects.exists()
    assert not Node.objects.exists()


@pytest.mark.parametrize("state", [InstanceState.FAILED, InstanceState.STOPPED])
def test_a_failed_or_stopped_instance_that_registers_again_is_ready(make_pool, state):
    # given
    make_pool("decode")
    instance = _register()
    EngineInstance.objects.filter(pk=instance.pk).update(state=state)

    # when
    again = _register(hostname="host-b")

    # then
    assert again.pk == instance.pk
    assert again.state == InstanceState.READY
    assert again.node.hostname == "host-b"
    assert _actions(again) == ["instance_registered", "instance_registered"]
    assert again.events.first().before == {"state": state}


@pytest.mark.parametrize(
    ("from_state", "service", "to_state"),
    [
        (InstanceState.READY, instance_drain, InstanceState.DRAINING),
        (InstanceState.READY, instance_stop, InstanceState.STOPPED),
        (InstanceState.DRAINING, instance_stop, InstanceState.STOPPED),
        (InstanceState.STARTING, instance_stop, InstanceState.STOPPED),
        (InstanceState.DRAINING, instance_resume, InstanceState.READY),
    ],
)
def test_allowed_transitions(make_instance, django_capture_on_commit_callbacks, from_state, service, to_state):
    # given
    instance = make_instance(state=from_state)

    # when
    with django_capture_on_commit_callbacks() as callbacks:
        changed = service(instance=instance, actor=None, reason="test")

    # then
    assert changed.state == to_state
    event = ScalingEvent.objects.filter(instance=instance).first()
    assert event.before == {"state": from_state}
    assert {"state": to_state}.items() <= event.after.items()
    assert len(callbacks) == 1


@pytest.mark.parametrize(
    ("from_state", "service"),
    [
        (InstanceState.DRAINING, instance_drain),
        (InstanceState.STOPPED, instance_drain),
        (InstanceState.FAILED, instance_drain),
        (InstanceState.STARTING, instance_drain),
        (InstanceState.STOPPED, instance_stop),
        (InstanceState.FAILED, instance_stop),
        (InstanceState.READY, instance_resume),
        (InstanceState.STOPPED, instance_resume),
        (InstanceState.FAILED, instance_resume),
    ],
)
def test_refused_transitions_change_nothing(make_instance, django_capture_on_commit_callbacks, from_state, service):
    instance = make_instance(state=from_state)
    events_before = ScalingEvent.objects.count()

    with django_capture_on_commit_callbacks() as callbacks:
        with pytest.raises(ConflictError):
            service(instance=instance, actor=None)

    instance.refresh_from_db()
    assert instance.state == from_state
    assert ScalingEvent.objects.count() == events_before
    assert callbacks == []


def test_the_transition_table_names_every_state():
    assert set(ALLOWED_TRANSITIONS) == set(InstanceState.values)
    assert InstanceState.DRAINING not in ALLOWED_TRANSITIONS[InstanceState.STOPPED]


def test_drain_queues_its_task_on_commit(make_instance, django_capture_on_commit_callbacks):
    instance = make_instance()

    with mock.patch.object(tasks.instance_drain_task, "delay") as delay:
        with django_capture_on_commit_callbacks(execute=True):
            instance_drain(instance=instance, actor=None)

    delay.assert_called_once_with(instance.pk, instance.pool.drain_grace_s)


def test_heartbeats_update_the_load_at_most_once_a_second(make_instance):
    # given
    instance = make_instance()
    EngineInstance.objects.filter(pk=instance.pk).update(last_heartbeat_at=NOW - timedelta(seconds=5))

    # when / then: the first heartbeat is written
    seen = _heartbeat(instance.worker_id, at=NOW, num_running=3, num_waiting=1, kv_usage=0.5, ttl_policy_version=7)
    assert (seen.num_running, seen.num_waiting, seen.kv_usage, seen.ttl_policy_version) == (3, 1, 0.5, 7)
    assert seen.last_heartbeat_at == NOW

    # when / then: one 100 ms later is not, one a second later is
    assert _heartbeat(instance.worker_id, at=NOW + timedelta(milliseconds=100), num_running=9).num_running == 3
    assert _heartbeat(instance.worker_id, at=NOW + timedelta(seconds=1), num_running=4).num_running == 4


def test_a_heartbeat_of_an_unregistered_worker_is_ignored(db):
    assert _heartbeat("stranger", at=NOW) is None


def test_drained_heartbeat_stops_a_draining_instance_with_events(make_instance):
    # given
    instance = make_instance(state=InstanceState.DRAINING)

    # when
    seen = _heartbeat(instance.worker_id, state="drained", at=NOW)
    _heartbeat(instance.worker_id, state="drained", at=NOW + timedelta(seconds=2))

    # then
    assert seen.state == InstanceState.STOPPED
    assert _actions(instance) == ["instance_registered", "instance_drained", "instance_stopped"]


def test_a_drained_heartbeat_after_migrations_records_them_with_their_counts(make_instance):
    instance = make_instance(state=InstanceState.DRAINING)

    _heartbeat(instance.worker_id, state="drained", at=NOW, num_migrated_out=3, num_migrations_failed=1)

    assert _actions(instance) == ["instance_registered", "instance_migrated", "instance_drained", "instance_stopped"]
    migrated = instance.events.get(action="instance_migrated")
    assert migrated.after == {"num_migrated": 3, "num_migrations_failed": 1}


def test_a_failover_is_recorded_on_the_worker_that_resumed_the_requests(make_instance):
    instance = make_instance()

    event = instance_record_failover(
        worker_id=instance.worker_id, num_resumed=2, num_recomputed_tokens=20, max_recomputed_tokens=12, now=NOW
    )

    assert event.action == "instance_failed_over" and event.instance_id == instance.pk
    assert event.after == {"num_resumed": 2, "num_recomputed_tokens": 20, "max_recomputed_tokens": 12}
    assert (
        instance_record_failover(worker_id="stranger", num_resumed=1, num_recomputed_tokens=0, max_recomputed_tokens=0)
        is None
    )


def test_heartbeats_bring_a_failed_instance_back(make_instance):
    instance = make_instance(state=InstanceState.FAILED)

    seen = _heartbeat(instance.worker_id, state="ready", at=NOW, num_running=2)

    assert (seen.state, seen.num_running) == (InstanceState.READY, 2)
    assert _actions(instance)[-1] == "instance_ready"


def test_silent_live_instances_fail(make_instance):
    # given
    silent = make_instance(last_heartbeat_at=NOW - timedelta(seconds=60))
    silent_draining = make_instance(state=InstanceState.DRAINING, last_heartbeat_at=NOW - timedelta(seconds=60))
    alive = make_instance(last_heartbeat_at=NOW)
    already_stopped = make_instance(state=InstanceState.STOPPED, last_heartbeat_at=NOW - timedelta(seconds=60))

    # when
    failed = instances_fail_silent(older_than=NOW - timedelta(seconds=10))

    # then
    assert sorted(instance.pk for instance in failed) == sorted([silent.pk, silent_draining.pk])
    states = dict(EngineInstance.objects.values_list("pk", "state"))
    assert states[alive.pk] == InstanceState.READY and states[already_stopped.pk] == InstanceState.STOPPED
    event = silent.events.first()
    assert (event.action, event.actor_label, event.after) == ("instance_failed", "system", {"state": "failed"})


def test_ensure_local_is_idempotent(db):
    pools = [("prefill", "prefill", 1), ("decode", "decode", 1)]
    first = topology_ensure_local(hostname="laptop", model="m", pools=pools)
    again = topology_ensure_local(hostname="laptop", model="m", pools=pools)

    assert [pool.pk for pool in first] == [pool.pk for pool in again]
    assert {(pool.cluster.name, pool.kind, pool.target_instances) for pool in again} == {
        ("local", "prefill", 1),
        ("local", "decode", 1),
    }
    assert Node.objects.get().hostname == "laptop"


def test_ensure_local_fits_the_bounds_to_the_instances_serve_starts(db):
    topology_ensure_local(hostname="laptop", model="m", pools=[("decode", "decode", 1)])

    [pool] = topology_ensure_local(hostname="laptop", model="m2", pools=[("decode", "decode", 3)])

    assert (pool.model, pool.min_instances, pool.target_instances, pool.max_instances) == ("m2", 3, 3, 3)


def test_ensure_local_gives_the_pools_serve_s_precision_and_follows_its_changes(db):
    [first] = topology_ensure_local(hostname="laptop", model="m", pools=[("decode", "decode", 1)])
    assert (first.quantization, first.kv_cache_dtype) == ("", "auto")

    topology_ensure_local(
        hostname="laptop", model="m", pools=[("decode", "decode", 1)], quantization="fp8", kv_cache_dtype="fp8"
    )

    assert Pool.objects.values_list("quantization", "kv_cache_dtype").get() == ("fp8", "fp8")


def test_ensure_local_refuses_a_pool_of_another_kind(db):
    topology_ensure_local(hostname="laptop", model="m", pools=[("decode", "decode", 1)])

    with pytest.raises(DomainValidationError):
        topology_ensure_local(hostname="laptop", model="m", pools=[("decode", "prefill", 1)])


def test_an_ep_resize_is_recorded_once_with_the_new_size(make_instance):
    instance = make_instance()
    instance.ep_size = 4
    instance.save(update_fields=["ep_size"])

    event = instance_record_ep_resize(
        worker_id=instance.worker_id, ep_size=3, resized_at=1234.5, reason="rank 2 died", now=NOW
    )
    again = instance_record_ep_resize(worker_id=instance.worker_id, ep_size=3, resized_at=1234.5, reason="rank 2 died")

    assert event.action == "ep_resized" and event.reason == "rank 2 died"
    assert (event.before, event.after) == ({"ep_size": 4}, {"ep_size": 3, "resized_at": 1234.5})
    assert again is None and instance.events.filter(action="ep_resized").count() == 1
    instance.refresh_from_db()
    assert instance.ep_size == 3
    assert instance_record_ep_resize(worker_id="stranger", ep_size=1, resized_at=1.0, reason="") is None


# The recorder closes connections the database dropped, which a test transaction cannot survive.
@pytest.mark.django_db(transaction=True)
def test_the_registry_records_a_resize_a_worker_heartbeats_once(make_instance):
    instance = make_instance()
    recorder = TopologyRecorder(heartbeat_timeout_s=10.0)
    fields = {
        "role": "mixed",
        "model": "tiny",
        "request_endpoint": instance.request_endpoint,
        "max_model_len": 256,
        "num_running": 1,
        "num_waiting": 0,
        "kv_usage": 0.0,
        "num_free_pages": 10,
        "num_prompt_tokens": 0,
        "num_cached_prompt_tokens": 0,
        "num_preemptions": 0,
        "sent_at": 0.0,
    }

    recorder.on_heartbeat(WorkerHeartbeat(worker_id=instance.worker_id, ep_size=4, **fields))
    for _ in range(2):
        recorder.on_heartbeat(
            WorkerHeartbeat(
                worker_id=instance.worker_id, ep_size=3, ep_resized_at=99.0, ep_resize_reason="rank 1 died", **fields
            )
        )

    resizes = list(instance.events.filter(action="ep_resized"))
    assert [(event.after["ep_size"], event.reason) for event in resizes] == [(3, "rank 1 died")]
