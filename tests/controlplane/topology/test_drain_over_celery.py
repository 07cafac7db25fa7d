"""An operator's drain travels the production path: the service commits it, Celery carries the task
over the real Redis broker to a separate `celery worker` process, which sends the DrainRequest over
ZMQ to a live engine worker. The worker finishes its streams, refuses new requests and reports
drained; the ScalingEvent rows record all of it."""

import asyncio
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import kombu.pools
import pytest
import redis
from django.db import connection

from controlplane.celery import app
from controlplane.topology.models import EngineInstance, InstanceState
from controlplane.topology.services import instance_drain
from tests.waiting import wait_until
from tests.workers.worker_process import Dealer, collect, connected_client, start_worker, token_ids
from workers.engine import SamplingParams
from workers.protocol.messages import ControlAck, GenerateError, GenerateRequest, StatusRequest

pytestmark = pytest.mark.django_db(transaction=True)

REDIS_URL = "redis://127.0.0.1:6379/14"
ROOT = Path(__file__).resolve().parents[3]
STREAM_TOKENS = 400
# Generous: the streams of a loaded 2-core machine may take minutes.
WAIT_S = 600.0


def forget_broker_connections() -> None:
    """The app's connection pools are made for the broker configured when first used: drop them, so
    the next task connects to the broker configured now (what Celery itself does after a fork)."""
    kombu.pools.reset()  # closes them and empties kombu's registry, so new ones are made
    app._pool = None
    app.amqp._producer_pool = None


@pytest.fixture
def celery_queue(monkeypatch, tmp_path):
    """A `celery worker` process on the real Redis, consuming a queue of this test's own; this
    process's tasks go to that queue instead of running eagerly."""
    queue = f"sluice-test-{uuid.uuid4().hex[:8]}"
    forget_broker_connections()
    monkeypatch.setitem(app.conf, "task_always_eager", False)
    monkeypatch.setitem(app.conf, "broker_url", REDIS_URL)
    monkeypatch.setitem(app.conf, "task_default_queue", queue)
    database = connection.settings_dict
    env = dict(
        os.environ,
        SLUICE_CELERY_BROKER_URL=REDIS_URL,
        DATABASE_URL=f"postgres://{database['USER']}@{database['HOST']}:{database['PORT']}/{database['NAME']}",
        SLUICE_DRAIN_TIMEOUT_S="900",
    )
    log = tmp_path / "celery.log"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "controlplane",
            "worker",
            "--pool=solo",
            "-Q",
            queue,
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
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
        yield queue
    finally:
        process.terminate()
        process.wait(timeout=30)
        forget_broker_connections()
        redis.Redis.from_url(REDIS_URL).delete(queue)


def run_streams(endpoints: tuple[str, str], count: int, results: list) -> threading.Thread:
    async def streams():
        client = await connected_client(endpoints)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=STREAM_TOKENS, ignore_eos=True)
            requests = [GenerateRequest(f"s{i}", [5 + i, 6, 7], params) for i in range(count)]
            results.extend(await asyncio.gather(*(collect(client, request) for request in requests)))
        finally:
            await client.close()

    thread = threading.Thread(target=asyncio.run, args=(streams(),))
    thread.start()
    return thread


def test_a_drain_sent_through_celery_finishes_streams_refuses_new_requests_and_is_recorded(
    tmp_path, celery_queue, make_instance, make_user
):
    # given a live engine worker, recorded as a ready instance, with three streams in flight
    worker = start_worker(tmp_path, "drained")
    try:
        instance = make_instance(request_endpoint=worker.endpoints[0], heartbeat_endpoint=worker.endpoints[1])
        results: list = []
        streams = run_streams(worker.endpoints, 3, results)
        with Dealer(worker.endpoints[0]) as dealer:

            def status() -> ControlAck:
                dealer.send(StatusRequest(uuid.uuid4().hex))
                return dealer.receive()

            wait_until(lambda: status().num_in_flight == 3, WAIT_S)

            # when an operator drains it
            instance_drain(instance=instance, actor=make_user("operator"), reason="maintenance")

            # then the worker stops taking requests while its streams still run
            wait_until(lambda: status().state != "ready", WAIT_S)
            draining = status()
            dealer.send(GenerateRequest("late", [1, 2], SamplingParams(max_tokens=2)))
            refusal = dealer.receive()
        streams.join(timeout=300)
        wait_until(lambda: EngineInstance.objects.get(pk=instance.pk).state == InstanceState.STOPPED, WAIT_S)
    finally:
        worker.stop()

    assert (draining.state, draining.num_in_flight) == ("draining", 3)
    assert isinstance(refusal, GenerateError) and refusal.kind == "draining"
    assert not streams.is_alive()
    assert [len(token_ids(outputs)) for outputs in results] == [STREAM_TOKENS] * 3
    assert all(outputs[-1].finish_reason == "length" for outputs in results)
    events = list(EngineInstance.objects.get(pk=instance.pk).events.order_by("id").values_list("action", "actor_label"))
    assert events == [
        ("instance_registered", "system"),
        ("instance_drain_requested", "operator-user"),
        ("instance_drained", "system"),
        ("instance_stopped", "system"),
    ]
