"""A node agent's workers hold the agent's CURVE key: one it starts registers with a registry on tcp://
that admits only that key."""

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from tests.waiting import wait_until
from tests.workers.worker.test_registry import Recorder
from tests.workers.worker_process import CONFIG, REPO_ROOT, STARTUP_TIMEOUT_S
from workers import curve
from workers.worker.node_agent import NodeAgent, WorkerLaunch
from workers.worker.registry import RegistryServer


@dataclass
class CurveCluster:
    key_file: Path
    model: Path
    registry_endpoint: str
    recorder: Recorder
    exits: list[tuple]

    def agent(self, runtime_dir: Path, **options) -> NodeAgent:
        return NodeAgent(
            runtime_dir=runtime_dir,
            registry_endpoint=self.registry_endpoint,
            worker_options=lambda role: ["--kv-cache-bytes", str(1 << 24)],
            on_exit=lambda *exit: self.exits.append(exit),
            cwd=REPO_ROOT,
            curve_key_file=str(self.key_file),
            **options,
        )


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[CurveCluster]:
    """The cluster's key file on this host, a tiny model and a registry on tcp:// that holds the key."""
    key_file = tmp_path / "cluster.key"
    curve.write_key_file(key_file, curve.generate_key(1))
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(CONFIG))
    recorder = Recorder()
    context = zmq.Context()
    registry = RegistryServer(
        "tcp://127.0.0.1:0",
        on_register=recorder.on_register,
        on_heartbeat=recorder.heartbeats.append,
        on_silence=recorder.silences.append,
        context=context,
        key=curve.load_key_file(key_file),
    )
    registry.start()
    try:
        yield CurveCluster(key_file, model, registry.bound_endpoint, recorder, [])
    finally:
        registry.stop()
        context.term()


def test_a_worker_the_agent_starts_registers_over_curve_with_the_agents_key_file(tmp_path, cluster):
    agent = cluster.agent(tmp_path / "run")
    try:
        # when the agent starts a worker
        agent.start(WorkerLaunch(1, "agent-worker", "mixed", "mixed", str(cluster.model)))
        wait_until(lambda: cluster.recorder.registrations or cluster.exits, timeout_s=STARTUP_TIMEOUT_S)
    finally:
        agent.stop_all(grace_s=10)

    # then it registered through the CURVE socket, with its ipc:// endpoints (plain, local)
    [registration] = cluster.recorder.registrations
    assert registration.worker_id == "agent-worker"
    assert registration.request_endpoint == f"ipc://{tmp_path}/run/agent-worker.req"
    assert cluster.exits == [(1, 0, True)]


def test_with_an_advertise_host_the_agents_worker_listens_on_tcp_and_stops_over_curve(tmp_path, cluster):
    # given an agent told the name other hosts reach it by
    agent = cluster.agent(tmp_path / "run", advertise_host="127.0.0.1")
    try:
        # when it starts a decode worker and, once registered, stops it
        started = agent.start(WorkerLaunch(2, "agent-decode", "decode", "decode", str(cluster.model)))
        wait_until(lambda: cluster.recorder.registrations or cluster.exits, timeout_s=STARTUP_TIMEOUT_S)
        [registration] = cluster.recorder.registrations
        code = agent.stop(2, grace_s=10)
    finally:
        agent.stop_all(grace_s=10)

    # then every endpoint is a tcp port advertised under that name, the agent knows where its request
    # socket is, and the worker took the shutdown it was sent over CURVE (exit 0, not a signal)
    endpoints = [registration.request_endpoint, registration.heartbeat_endpoint, registration.transfer_endpoint]
    assert all(endpoint.startswith("tcp://127.0.0.1:") for endpoint in endpoints)
    assert started.request_endpoint == registration.request_endpoint
    assert code == 0 and cluster.exits == [(2, 0, True)]
