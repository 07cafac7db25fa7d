"""An admin's TTL edit reaches the KV store's GC in a live engine worker: the new version is
committed, pushed over ZMQ to every live instance, and the worker's GC expires by it."""

import asyncio
import random
import time

import pytest

from controlplane.policies.models import TrafficClass
from controlplane.policies.services import ttl_policy_set
from controlplane.topology.models import ScalingEvent
from tests.workers.worker_process import CONFIG, collect, connected_client, start_worker, wait_for_heartbeat
from workers.engine import SamplingParams
from workers.protocol.messages import GenerateRequest

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("default_ttl_policies")]

PROMPT = [random.Random(2).randrange(CONFIG["vocab_size"]) for _ in range(300)]


def fill_store(endpoints: tuple[str, str]) -> None:
    async def run():
        client = await connected_client(endpoints)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            await collect(client, GenerateRequest("fill", PROMPT, params))
            await wait_for_heartbeat(client, lambda beats: beats[0].num_store_blocks_written >= 4)
        finally:
            await client.close()

    asyncio.run(run())


def test_a_ttl_edit_makes_the_workers_gc_expire_blocks_by_it(tmp_path, make_instance, make_user):
    # given a worker whose store holds chat blocks, kept by the default policy (7 days)
    store = tmp_path / "kvstore"
    options = ("--kv-store", str(store), "--kv-block-tokens", "64", "--kv-gc-interval", "0.2")
    worker = start_worker(tmp_path, "gc", *options)
    try:
        make_instance(request_endpoint=worker.endpoints[0], heartbeat_endpoint=worker.endpoints[1])
        fill_store(worker.endpoints)
        time.sleep(1.0)  # several GC runs under the default policy
        kept = len(list(store.rglob("*.blk")))

        # when an admin shortens the chat TTL to one second
        ttl_policy_set(
            traffic_class=TrafficClass.objects.get(name="chat"),
            ttl_seconds=1,
            actor=make_user("admin"),
            reason="test",
        )

        # then the worker's GC deletes them
        deadline = time.monotonic() + 60
        while list(store.rglob("*.blk")) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = len(list(store.rglob("*.blk")))
    finally:
        assert worker.stop() == 0
    assert kept >= 4
    assert left == 0
    assert not ScalingEvent.objects.filter(action="control_failed").exists()
