"""Worker registration over real ZMQ: workers announce themselves to a RegistryServer (also one that
starts after them), which reports their heartbeats and, once, their silence."""

import signal
import threading
import time

import msgspec
import pytest
import zmq

from tests.waiting import wait_until
from tests.workers.worker_process import start_worker, wait_for_worker_heartbeat
from workers.protocol.messages import RegistrationAck, WorkerHeartbeat, WorkerRegistration
from workers.worker.registry import RegistryServer, register_until_acknowledged

HEARTBEAT_TIMEOUT_S = 1.0


class Recorder:
    """The registry's callbacks, recording what they were called with."""

    def __init__(self, refusals: list[str] | None = None) -> None:
        self.refusals = list(refusals or [])  # answered to the first registrations, in turn
        self.registrations: list[WorkerRegistration] = []
        self.heartbeats: list[WorkerHeartbeat] = []
        self.silences: list[str] = []

    def on_register(self, registration: WorkerRegistration) -> str | None:
        self.registrations.append(registration)
        return self.refusals.pop(0) if self.refusals else None

    def server(self, endpoint: str) -> RegistryServer:
        return RegistryServer(
            endpoint,
            on_register=self.on_register,
            on_heartbeat=self.heartbeats.append,
            on_silence=self.silences.append,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        )


@pytest.fixture
def registry(tmp_path):
    started: list[RegistryServer] = []

    def start(recorder: Recorder) -> RegistryServer:
        server = recorder.server(f"ipc://{tmp_path}/registry")
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def registration(worker_id: str = "w", heartbeat_endpoint: str = "ipc:///nonexistent.hb") -> WorkerRegistration:
    return WorkerRegistration(
        worker_id=worker_id,
        pool="p",
        role="mixed",
        model="m",
        hostname="h",
        request_endpoint="ipc:///nonexistent.req",
        heartbeat_endpoint=heartbeat_endpoint,
        started_at=1.0,
    )


def exchange(endpoint: str, payload: bytes) -> RegistrationAck:
    with zmq.Context() as context, context.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        dealer.connect(endpoint)
        dealer.send(payload)
        return msgspec.msgpack.decode(dealer.recv(), type=RegistrationAck)


def test_a_refused_or_malformed_registration_is_answered_not_ok(registry):
    recorder = Recorder(refusals=["pool p is closed"])
    server = registry(recorder)

    refused = exchange(server.bound_endpoint, msgspec.msgpack.encode(registration()))
    malformed = exchange(server.bound_endpoint, msgspec.msgpack.encode({"type": "register", "worker_id": "w"}))

    assert (refused.worker_id, refused.ok, refused.message) == ("w", False, "pool p is closed")
    assert not malformed.ok and "pool" in malformed.message


def test_a_registry_without_a_key_refuses_a_worker_whose_heartbeats_are_on_the_network(registry):
    recorder = Recorder()
    server = registry(recorder)

    refused = exchange(
        server.bound_endpoint, msgspec.msgpack.encode(registration(heartbeat_endpoint="tcp://10.0.0.9:7101"))
    )

    assert not refused.ok and "refusing tcp://10.0.0.9:7101 without the cluster's CURVE key" in refused.message
    assert recorder.registrations == []


def test_a_worker_retries_its_registration_until_it_is_accepted(registry):
    recorder = Recorder(refusals=["not yet", "not yet"])
    server = registry(recorder)

    accepted = register_until_acknowledged(
        zmq.Context.instance(), server.bound_endpoint, registration(), threading.Event(), retry_interval_s=0.05
    )

    assert accepted and len(recorder.registrations) == 3


def test_a_registering_worker_stops_trying_when_asked(tmp_path):
    stop = threading.Event()
    stop_soon = threading.Timer(0.3, stop.set)
    stop_soon.start()

    accepted = register_until_acknowledged(zmq.Context.instance(), f"ipc://{tmp_path}/nobody", registration(), stop)

    assert not accepted


def test_a_worker_registers_its_heartbeats_are_reported_and_its_death_is_noticed_once(registry, tmp_path):
    recorder = Recorder()
    server = registry(recorder)
    worker = start_worker(tmp_path, "reg", "--pool", "decode-a", "--registry-endpoint", server.bound_endpoint)
    try:
        wait_until(lambda: recorder.registrations and recorder.heartbeats)
        worker.process.send_signal(signal.SIGKILL)
        worker.process.wait()
        wait_until(lambda: recorder.silences)
        time.sleep(3 * HEARTBEAT_TIMEOUT_S)  # room for a second, wrong, report
    finally:
        worker.stop()
    [registered] = recorder.registrations
    assert (registered.worker_id, registered.pool, registered.role) == ("reg", "decode-a", "mixed")
    assert (registered.request_endpoint, registered.heartbeat_endpoint) == worker.endpoints
    assert (registered.accelerator_kind, registered.num_accelerators, registered.ep_size) == ("cpu", 0, 1)
    assert {beat.worker_id for beat in recorder.heartbeats} == {"reg"}
    assert recorder.heartbeats[-1].started_at == registered.started_at
    assert recorder.silences == ["reg"]


def test_a_worker_registers_with_a_registry_that_starts_after_it(registry, tmp_path):
    recorder = Recorder()
    endpoint = f"ipc://{tmp_path}/registry"
    worker = start_worker(tmp_path, "early", "--registry-endpoint", endpoint)
    try:
        wait_for_worker_heartbeat(worker.endpoints[1])  # serving, with nobody to register with
        assert registry(recorder).bound_endpoint == endpoint
        wait_until(lambda: recorder.registrations and recorder.heartbeats)
    finally:
        assert worker.stop() == 0
    assert [r.worker_id for r in recorder.registrations] == ["early"]


def test_a_restarted_registry_watches_the_workers_it_is_told_about(tmp_path):
    # given a worker that registered with an earlier registry, which is gone
    worker = start_worker(tmp_path, "known")
    try:
        wait_for_worker_heartbeat(worker.endpoints[1])
        recorder = Recorder()
        request_endpoint, heartbeat_endpoint = worker.endpoints
        known = msgspec.structs.replace(registration("known", heartbeat_endpoint), request_endpoint=request_endpoint)
        server = RegistryServer(
            f"ipc://{tmp_path}/registry",
            on_register=recorder.on_register,
            on_heartbeat=recorder.heartbeats.append,
            on_silence=recorder.silences.append,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
            known=[known],
        )
        # when the new registry starts
        server.start()
        try:
            wait_until(lambda: recorder.heartbeats)
            worker.process.send_signal(signal.SIGKILL)
            worker.process.wait()
            wait_until(lambda: recorder.silences)
        finally:
            server.stop()
    finally:
        worker.stop()
    # then it follows the worker without a new registration
    assert recorder.registrations == []
    assert {beat.worker_id for beat in recorder.heartbeats} == {"known"}
    assert recorder.silences == ["known"]
