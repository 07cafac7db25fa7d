from functools import partial

import pytest

from controlplane.policies import tasks as policy_tasks
from controlplane.policies.models import TrafficClass
from controlplane.policies.services import ep_layout_activate, ep_layout_create, ttl_policy_set
from controlplane.topology import tasks
from controlplane.topology.models import EngineInstance, InstanceState, ScalingEvent
from controlplane.topology.services import instance_drain, instance_resume, instance_stop
from tests.controlplane.fake_worker import fake_worker
from workers.client import control_client
from workers.kvstore.ttl import TTLPolicy
from workers.protocol.messages import (
    ApplyEPLayoutRequest,
    DrainRequest,
    ResumeRequest,
    SetTTLPolicyRequest,
    ShutdownRequest,
    StatusRequest,
)


@pytest.fixture(autouse=True)
def quick_timeouts(monkeypatch, settings):
    # A silent worker costs one short try instead of three of two seconds.
    monkeypatch.setattr(tasks, "send_control", partial(control_client.send_control, timeout_s=0.3, retries=1))
    settings.SLUICE_DRAIN_TIMEOUT_S = 2.0


def _actions(instance: EngineInstance) -> list[str]:
    return list(instance.events.order_by("id").values_list("action", flat=True))


def test_drain_task_records_drained_and_stopped(make_instance, monkeypatch):
    # A Celery worker (not eager) waits for the worker to report drained.
    monkeypatch.setitem(tasks.app.conf, "task_always_eager", False)
    with fake_worker() as worker:
        # given
        instance = make_instance(request_endpoint=worker.endpoint)
        instance_drain(instance=instance, actor=None)

        # when
        tasks.instance_drain_task(instance.pk)

    # then
    instance.refresh_from_db()
    assert instance.state == InstanceState.STOPPED
    assert _actions(instance) == [
        "instance_registered",
        "instance_drain_requested",
        "instance_drained",
        "instance_stopped",
    ]
    assert isinstance(worker.received[0], DrainRequest)
    assert isinstance(worker.received[-1], StatusRequest)


def test_eager_drain_task_sends_the_drain_and_leaves_the_rest_to_heartbeats(make_instance):
    with fake_worker() as worker:
        instance = make_instance(request_endpoint=worker.endpoint)
        instance_drain(instance=instance, actor=None)

        tasks.instance_drain_task(instance.pk)

    instance.refresh_from_db()
    assert instance.state == InstanceState.DRAINING
    assert [type(message) for message in worker.received] == [DrainRequest]
    assert _actions(instance) == ["instance_registered", "instance_drain_requested"]


def test_drain_task_records_control_failed_when_the_worker_is_silent(make_instance):
    with fake_worker(silent=True) as worker:
        instance = make_instance(request_endpoint=worker.endpoint)
        instance_drain(instance=instance, actor=None)

        tasks.instance_drain_task(instance.pk)

    instance.refresh_from_db()
    assert instance.state == InstanceState.DRAINING
    failure = instance.events.first()
    assert (failure.action, failure.actor_label) == ("control_failed", "system")
    assert failure.after["command"] == "drain"
    assert "ControlTimeoutError" in failure.after["error"]


def test_a_refused_command_is_a_control_failure(make_instance):
    with fake_worker(refuse=True) as worker:
        instance = make_instance(request_endpoint=worker.endpoint)
        instance_drain(instance=instance, actor=None)
        instance_resume(instance=instance, actor=None)

        tasks.instance_resume_task(instance.pk)

    failure = instance.events.first()
    assert (failure.action, failure.after["command"]) == ("control_failed", "resume")
    assert "refused by the test" in failure.reason
    assert isinstance(worker.received[0], ResumeRequest)


def test_stop_task_sends_shutdown_and_records_stopped(make_instance):
    with fake_worker() as worker:
        instance = make_instance(request_endpoint=worker.endpoint)
        instance_stop(instance=instance, actor=None)

        tasks.instance_stop_task(instance.pk)

    assert _actions(instance)[-2:] == ["instance_stop_requested", "instance_stopped"]
    assert [type(request) for request in worker.received] == [ShutdownRequest]


def test_ttl_push_reaches_every_live_instance_and_records_failures(make_instance):
    # given: one answering worker, one silent, one stopped (not pushed to)
    with fake_worker() as answering, fake_worker(silent=True) as silent, fake_worker() as stopped:
        ok = make_instance(request_endpoint=answering.endpoint)
        quiet = make_instance(request_endpoint=silent.endpoint)
        make_instance(request_endpoint=stopped.endpoint, state=InstanceState.STOPPED)
        newest = ttl_policy_set(traffic_class=TrafficClass.objects.get(name="agent"), ttl_seconds=60, actor=None)

        # when
        policy_tasks.ttl_policy_push_task()

    # then
    (request,) = answering.received
    assert isinstance(request, SetTTLPolicyRequest) and request.version == newest.pk
    assert TTLPolicy.from_dict(request.policy).ttl_s == {"agent": 60, "chat": 604_800}
    assert stopped.received == []
    assert not ok.events.filter(action="control_failed").exists()
    assert quiet.events.filter(action="control_failed").get().after["command"] == "set_ttl_policy"


def test_ep_layout_push_sends_the_layout_to_the_pools_instances(make_pool, make_instance):
    pool = make_pool("moe", num_experts=2, expert_slots_per_rank=2, max_instances=2)
    with fake_worker() as worker:
        make_instance(pool, request_endpoint=worker.endpoint)
        layout = ep_layout_create(pool=pool, num_logical_experts=2, placement=[[[0, 1]], [[1, 0]]], actor=None)
        ep_layout_activate(layout=layout, actor=None)

        policy_tasks.ep_layout_push_task(layout.pk)

    (request,) = worker.received
    assert isinstance(request, ApplyEPLayoutRequest)
    assert (request.version, request.num_logical_experts, request.placement) == (1, 2, [[[0, 1]], [[1, 0]]])
    assert not ScalingEvent.objects.filter(action="control_failed").exists()


def test_without_a_broker_the_queued_task_runs_in_process_after_commit(
    make_instance, django_capture_on_commit_callbacks
):
    # The test settings have no SLUICE_CELERY_BROKER_URL: the embedded default's eager mode.
    with fake_worker() as worker:
        instance = make_instance(request_endpoint=worker.endpoint)

        with django_capture_on_commit_callbacks(execute=True):
            instance_drain(instance=instance, actor=None)

    # The worker got the drain from the task that ran in this process, after the commit.
    assert [type(message) for message in worker.received] == [DrainRequest]
