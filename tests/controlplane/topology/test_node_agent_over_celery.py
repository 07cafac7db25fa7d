"""A node agent on the production path: a real `celery worker` on the real Redis consumes its node's
queue (node.<name>) and starts a real engine worker process (a tiny random-weight model), which
registers with a real registry (starting → ready) and serves a request through a client that found it
in the topology (as the gateway does); scaling the pool down drains
it (drained → stopped) and the agent ends the process. A start on a node no agent serves fails once
its timeout passes, with the reason."""

import asyncio
import json
import os
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import kombu.pools
import pytest
import redis
from asgiref.sync import sync_to_async
from django.db import connection, connections
from django.test import override_settings
from django.utils import timezone

from controlplane.celery import app
from controlplane.gateway.worker_discovery import follow_registered_workers
from controlplane.topology.models import Cluster, EngineInstance, InstanceState, Node, ScalingEvent
from controlplane.topology.registry import TopologyRecorder, topology_registry_server
from controlplane.topology.services import (
    autoscale_tick,
    instance_start,
    pool_autoscale_pause,
    pool_create,
    pool_reconcile,
    pool_scale,
)
from tests.waiting import wait_until
from tests.workers.worker_process import CONFIG, KV_CACHE_BYTES, SEED, collect, token_ids, wait_for_heartbeat
from workers.client.engine_client import EngineClient
from workers.engine import SamplingParams
from workers.protocol.messages import GenerateRequest

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("default_ttl_policies")]

REDIS_URL = "redis://127.0.0.1:6379/14"
ROOT = Path(__file__).resolve().parents[3]
WAIT_S = 300.0


def forget_broker_connections() -> None:
    """The app's connection pools are made for the broker configured when first used: drop them, so
    the next task connects to the broker configured now (what Celery itself does after a fork)."""
    kombu.pools.reset()
    app._pool = None
    app.amqp._producer_pool = None


@pytest.fixture
def broker(monkeypatch):
    """This process's tasks go to the real Redis (a queue of this test's own for control tasks)."""
    control_queue = f"sluice-test-{uuid.uuid4().hex[:8]}"
    forget_broker_connections()
    monkeypatch.setitem(app.conf, "task_always_eager", False)
    monkeypatch.setitem(app.conf, "broker_url", REDIS_URL)
    monkeypatch.setitem(app.conf, "task_default_queue", control_queue)
    try:
        yield control_queue
    finally:
        forget_broker_connections()
        redis.Redis.from_url(REDIS_URL).delete(control_queue)


@pytest.fixture
def node_agent(broker, tmp_path):
    """A `celery worker` on the real Redis consuming node.<name> (the agent) and the control queue, and a
    registry recording into the topology."""
    name = f"agent-{uuid.uuid4().hex[:8]}"
    control_queue = broker
    runtime = tmp_path / "run"
    registry = topology_registry_server(
        f"ipc://{tmp_path}/registry", TopologyRecorder(heartbeat_timeout_s=30.0), heartbeat_report_interval_s=0.2
    )
    registry.start()
    database = connection.settings_dict
    env = dict(
        os.environ,
        SLUICE_CELERY_BROKER_URL=REDIS_URL,
        DATABASE_URL=f"postgres://{database['USER']}@{database['HOST']}:{database['PORT']}/{database['NAME']}",
        SLUICE_NODE_NAME=name,
        SLUICE_NODE_RUNTIME_DIR=str(runtime),
        SLUICE_REGISTRY_ENDPOINT=registry.bound_endpoint,
        SLUICE_NODE_WORKER_OPTIONS=f"--seed {SEED} --kv-cache-bytes {KV_CACHE_BYTES}",
    )
    log = tmp_path / "celery.log"
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "celery", "-A", "controlplane", "worker", "--pool=solo"),
            *("-Q", f"node.{name},{control_queue}", "--without-gossip", "--without-mingle", "--without-heartbeat"),
            "--loglevel=INFO",
        ],
        cwd=ROOT,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_until(lambda: "ready." in log.read_text() or process.poll() is not None, WAIT_S)
        assert process.poll() is None, log.read_text()
        yield name, log
    finally:
        process.terminate()
        process.wait(timeout=60)
        registry.stop()
        redis.Redis.from_url(REDIS_URL).delete(f"node.{name}")


def serve_one() -> list[int]:
    """A request through an EngineClient that knew no worker: it finds the new one as a gateway does."""

    async def generate() -> list[int]:
        client = EngineClient()
        await client.start()
        discovery = asyncio.create_task(follow_registered_workers(client, set(), interval_s=0.2))
        try:
            await wait_for_heartbeat(client, lambda beats: len(beats) == 1, timeout_s=WAIT_S)
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            return token_ids(await collect(client, GenerateRequest("agent-started", [5, 6, 7], params)))
        finally:
            discovery.cancel()
            await client.close()
            # The discovery's database reads ran on asgiref's thread: its connection ends with the test.
            await sync_to_async(connections.close_all)()

    return asyncio.run(generate())


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone as far as serving goes; the agent reaps it.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_an_agent_starts_a_worker_that_serves_then_stops_it_on_scale_down(tmp_path, node_agent, make_user):
    name, log = node_agent
    operator = make_user("operator")
    model = tmp_path / "tiny-agent.json"
    model.write_text(json.dumps(CONFIG))
    cluster = Cluster.objects.create(name="agents")
    Node.objects.create(cluster=cluster, hostname=name)
    pool = pool_create(cluster=cluster, name="mixed", kind="mixed", model=str(model), max_instances=1)

    # when an operator scales the pool up and the control plane starts what the target lacks
    pool_scale(pool=pool, target_instances=1, actor=operator, reason="more capacity")
    [instance] = pool_reconcile(pool=pool)

    # then the agent starts the worker, which registers under the instance's id and serves
    wait_until(lambda: EngineInstance.objects.get(pk=instance.pk).state == InstanceState.READY, WAIT_S)
    instance.refresh_from_db()
    tokens = serve_one()
    assert len(tokens) == 8
    assert instance.pid is not None and pid_alive(instance.pid), log.read_text()

    # when the pool is scaled down
    pool_scale(pool=pool, target_instances=0, actor=operator, reason="less capacity")

    # then the instance drains, stops, and its process ends
    wait_until(lambda: instance.events.filter(action="instance_exited").exists(), WAIT_S)
    instance.refresh_from_db()
    assert instance.state == InstanceState.STOPPED
    wait_until(lambda: not pid_alive(instance.pid), 30)
    actions = list(instance.events.order_by("id").values_list("action", flat=True))
    assert actions == [
        "instance_start_requested",
        "instance_started",
        "instance_registered",
        "instance_drain_requested",
        "instance_drained",
        "instance_stopped",
        "instance_exited",
    ], log.read_text()
    exited = instance.events.get(action="instance_exited")
    assert exited.after == {"exit_code": 0, "requested": True, "state": "stopped"}
    assert instance.node.hostname == name


@override_settings(SLUICE_INSTANCE_START_TIMEOUT_S=1)
def test_a_start_on_a_node_no_agent_serves_fails_with_the_reason(broker):
    # given a start queued on the real broker for a node whose queue nobody consumes
    cluster = Cluster.objects.create(name="agentless")
    Node.objects.create(cluster=cluster, hostname="nobody-home")
    pool = pool_create(cluster=cluster, name="decode", kind="decode", model="m", max_instances=1)
    pool_autoscale_pause(pool=pool, paused=True, actor=None)
    instance = instance_start(pool=pool, node_hostname="nobody-home", actor=None)
    try:
        # when the start timeout passes and the autoscaler's tick runs
        autoscale_tick(now=timezone.now() + timedelta(seconds=2))

        # then the instance failed, saying which queue nobody consumes; the start message is still queued
        instance.refresh_from_db()
        assert instance.state == InstanceState.FAILED
        failed = ScalingEvent.objects.get(instance=instance, action="instance_failed")
        assert "nothing consumes queue 'node.nobody-home'" in failed.reason
        assert redis.Redis.from_url(REDIS_URL).llen("node.nobody-home") == 1
    finally:
        redis.Redis.from_url(REDIS_URL).delete("node.nobody-home")
