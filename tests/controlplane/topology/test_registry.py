"""The control plane records real engine workers: they register with `run_registry`'s recorder, their
heartbeats keep their rows current, the policy in force reaches them, and silence marks them failed;
over the network, only workers holding the cluster's CURVE key get a row."""

import signal
import threading
import time

import msgspec
import pytest
import zmq

from controlplane.policies import tasks as policy_tasks
from controlplane.policies.selectors import ttl_policy_current
from controlplane.topology.models import EngineInstance, InstanceState
from controlplane.topology.registry import TopologyRecorder, topology_registry_server
from controlplane.topology.services import topology_ensure_local
from tests.waiting import wait_until
from tests.workers.worker.test_registry import registration
from tests.workers.worker_process import start_worker, wait_for_worker_heartbeat
from workers.curve import CurveKey, generate_key
from workers.worker.registry import RegistryServer, register_until_acknowledged

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("default_ttl_policies")]

TIMEOUT_S = 1.0


def start_registry(endpoint: str, key: CurveKey | None = None) -> RegistryServer:
    recorder = TopologyRecorder(heartbeat_timeout_s=TIMEOUT_S)
    server = topology_registry_server(endpoint, recorder, heartbeat_report_interval_s=0.2, key=key)
    server.start()
    return server


def instance(worker_id: str) -> EngineInstance | None:
    return EngineInstance.objects.filter(worker_id=worker_id).first()


def test_a_worker_registers_gets_the_ttl_policy_in_force_and_fails_when_it_goes_silent(tmp_path):
    # given the embedded topology and a registry
    topology_ensure_local(hostname="here", model="tiny", pools=[("mixed", "mixed", 1)])
    registry = start_registry(f"ipc://{tmp_path}/registry")
    worker = start_worker(tmp_path, "w0", "--pool", "mixed", "--registry-endpoint", registry.bound_endpoint)
    try:
        # when it registers and sends heartbeats
        wait_until(lambda: (row := instance("w0")) is not None and row.last_heartbeat_at is not None)
        revision = ttl_policy_current()["revision"]
        wait_until(lambda: instance("w0").ttl_policy_version == revision)
        registered = instance("w0")
        # and then dies
        worker.process.send_signal(signal.SIGKILL)
        worker.process.wait()
        wait_until(lambda: instance("w0").state == InstanceState.FAILED)
    finally:
        registry.stop()
        worker.stop()

    # then
    assert (registered.state, registered.pool.name) == (InstanceState.READY, "mixed")
    assert (registered.request_endpoint, registered.heartbeat_endpoint) == worker.endpoints
    actions = list(registered.events.order_by("id").values_list("action", flat=True))
    assert actions == ["instance_registered", "instance_failed"]


def test_a_worker_of_an_unknown_pool_is_refused_and_recorded_nowhere(tmp_path):
    registry = start_registry(f"ipc://{tmp_path}/registry")
    worker = start_worker(tmp_path, "stray", "--pool", "nowhere", "--registry-endpoint", registry.bound_endpoint)
    try:
        wait_for_worker_heartbeat(worker.endpoints[1])
        time.sleep(1.0)  # room for a registration that should not happen
    finally:
        registry.stop()
        worker.stop()
    assert instance("stray") is None


def test_a_restarted_registry_follows_the_workers_registered_before_it(tmp_path):
    topology_ensure_local(hostname="here", model="tiny", pools=[("mixed", "mixed", 1)])
    endpoint = f"ipc://{tmp_path}/registry"
    first = start_registry(endpoint)
    worker = start_worker(tmp_path, "w1", "--pool", "mixed", "--registry-endpoint", endpoint)
    try:
        wait_until(lambda: instance("w1") is not None)
        first.stop()
        # given a registry that starts after the worker registered (it will not register again)
        second = start_registry(endpoint)
        try:
            worker.process.send_signal(signal.SIGKILL)
            worker.process.wait()
            # then the new registry still notices the silence
            wait_until(lambda: instance("w1").state == InstanceState.FAILED)
        finally:
            second.stop()
    finally:
        worker.stop()


def test_over_the_network_only_a_worker_with_the_cluster_key_gets_a_row_with_its_endpoints(monkeypatch):
    # given a registry on tcp:// holding the cluster's key, and workers announcing decode instances
    # (no process behind them to take the TTL policy the registry pushes to each new instance)
    pushed = []
    monkeypatch.setattr(policy_tasks.ttl_policy_push_task, "delay", pushed.append)
    topology_ensure_local(hostname="here", model="tiny", pools=[("decode", "decode", 2)])
    key, other = generate_key(1), generate_key(1)
    registry = start_registry("tcp://127.0.0.1:0", key=key)
    stop = threading.Event()
    acknowledged: dict[str, bool] = {}

    def register(worker_id: str, worker_key: CurveKey | None) -> None:
        announced = msgspec.structs.replace(
            registration(worker_id, heartbeat_endpoint="tcp://127.0.0.1:9"),
            pool="decode",
            role="decode",
            transfer_endpoint="tcp://127.0.0.1:10",
        )
        acknowledged[worker_id] = register_until_acknowledged(
            zmq.Context.instance(), registry.bound_endpoint, announced, stop, retry_interval_s=0.05, key=worker_key
        )

    intruders = [threading.Thread(target=register, args=(name, k)) for name, k in (("plain", None), ("other", other))]
    try:
        # when intruders keep trying from before a member registers, and for a while after
        for thread in intruders:
            thread.start()
        register("member", key)
        time.sleep(0.5)  # ten more tries each, which must all go unheard
        stop.set()
        for thread in intruders:
            thread.join()
    finally:
        registry.stop()

    # then
    assert acknowledged == {"member": True, "plain": False, "other": False}
    assert set(pushed) == {EngineInstance.objects.get(worker_id="member").pk}
    assert list(EngineInstance.objects.values_list("worker_id", "transfer_endpoint")) == [
        ("member", "tcp://127.0.0.1:10")
    ]
