"""What node agents report, recorded: a process started, a crash failing its instance, a start sent to
the wrong node; and the embedded default's agent round (no broker) starting and reaping a real process."""

import pytest

from controlplane.topology.models import EngineInstance, InstanceState, Node, ScalingEvent
from controlplane.topology.node_agent import agent_start, reconcile_local, record_exit
from controlplane.topology.services import (
    instance_claim_start,
    instance_record_exit,
    instance_record_started,
    instance_start,
)
from tests.waiting import wait_until
from tests.workers.worker_process import REPO_ROOT
from workers.worker.node_agent import NodeAgent, WorkerLaunch

pytestmark = pytest.mark.django_db


@pytest.fixture
def starting(make_pool):
    pool = make_pool("prefill", kind="prefill", model="/nowhere/model.json", max_instances=2)
    Node.objects.create(cluster=pool.cluster, hostname="node-a")
    return instance_start(pool=pool, node_hostname="node-a", actor=None)


def actions(instance: EngineInstance) -> list[str]:
    return list(instance.events.order_by("id").values_list("action", flat=True))


def test_a_crash_fails_the_instance_and_a_requested_exit_does_not(starting):
    instance_record_started(instance_id=starting.pk, pid=4242, request_endpoint="ipc://r", heartbeat_endpoint="ipc://h")
    assert instance_claim_start(instance_id=starting.pk) is None  # started already: a redelivered task does nothing

    instance_record_exit(instance_id=starting.pk, exit_code=-9, requested=False)

    starting.refresh_from_db()
    assert (starting.state, starting.pid, starting.request_endpoint) == (InstanceState.FAILED, 4242, "ipc://r")
    assert actions(starting) == ["instance_start_requested", "instance_started", "instance_exited", "instance_failed"]
    assert starting.events.get(action="instance_failed").reason == "worker process exited with code -9"
    # a later, requested exit of a failed instance only records the exit
    instance_record_exit(instance_id=starting.pk, exit_code=0, requested=True)
    assert actions(starting)[-1] == "instance_exited" and starting.events.count() == 5


def test_the_launch_of_an_instance_carries_its_pool_s_precision(make_pool):
    pool = make_pool("fp8", kind="mixed", quantization="fp8", kv_cache_dtype="fp8", max_instances=1)
    Node.objects.create(cluster=pool.cluster, hostname="node-a")
    plain = make_pool("plain", kind="mixed", max_instances=1)

    fp8_launch = instance_claim_start(instance_id=instance_start(pool=pool, node_hostname="node-a", actor=None).pk)
    plain_launch = instance_claim_start(instance_id=instance_start(pool=plain, node_hostname="node-a", actor=None).pk)

    assert (fp8_launch.quantization, fp8_launch.kv_cache_dtype) == ("fp8", "fp8")
    assert (plain_launch.quantization, plain_launch.kv_cache_dtype) == (None, "auto")


def test_a_start_for_another_node_is_refused_by_the_agent(starting, tmp_path):
    agent = NodeAgent(
        runtime_dir=tmp_path, registry_endpoint="ipc://none", worker_options=lambda role: [], on_exit=record_exit
    )

    agent_start(agent, starting.pk, hostname="node-b")

    starting.refresh_from_db()
    assert starting.state == InstanceState.FAILED and agent.held_instances() == []
    assert (
        "the agent of node 'node-b' got a start for node 'node-a'"
        in starting.events.get(action="instance_failed").reason
    )


def test_the_embedded_agent_round_starts_waiting_instances_and_reports_their_crash(starting, tmp_path):
    # given the local agent of node-a (as serve builds it) and a starting instance whose model is nowhere
    agent = NodeAgent(
        runtime_dir=tmp_path / "run",
        registry_endpoint=f"ipc://{tmp_path}/registry",
        worker_options=lambda role: [],
        on_exit=record_exit,
        cwd=REPO_ROOT,
    )
    try:
        # when the supervisor's timer runs the agent's round
        reconcile_local(agent, "node-a")
        starting.refresh_from_db()
        assert starting.pid is not None and agent.held_instances() == [starting.pk]
        launch = WorkerLaunch(starting.pk, starting.worker_id, "prefill", "prefill", "/nowhere/model.json")
        with pytest.raises(ValueError, match=f"instance {starting.pk} already has a process here"):
            agent.start(launch)

        # then the worker's crash (it cannot load its model) fails the instance on a later round
        def failed() -> bool:
            reconcile_local(agent, "node-a")
            return EngineInstance.objects.get(pk=starting.pk).state == InstanceState.FAILED

        wait_until(failed, 120)
    finally:
        agent.stop_all(grace_s=5)
    assert ScalingEvent.objects.get(instance=starting, action="instance_failed").reason == (
        "worker process exited with code 1"
    )
