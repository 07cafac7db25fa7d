"""The control plane records real engine workers: they register with `run_registry`'s recorder, their
heartbeats keep their rows current, the policy in force reaches them, and silence marks them failed."""

import signal
import time

import pytest

from controlplane.policies.selectors import ttl_policy_current
from controlplane.topology.models import EngineInstance, InstanceState
from controlplane.topology.registry import TopologyRecorder, topology_registry_server
from controlplane.topology.services import topology_ensure_local
from tests.waiting import wait_until
from tests.workers.worker_process import start_worker, wait_for_worker_heartbeat
from workers.registry import RegistryServer

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("default_ttl_policies")]

TIMEOUT_S = 1.0


def start_registry(endpoint: str) -> RegistryServer:
    recorder = TopologyRecorder(heartbeat_timeout_s=TIMEOUT_S)
    server = topology_registry_server(endpoint, recorder, heartbeat_report_interval_s=0.2)
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
