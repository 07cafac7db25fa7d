"""What the workers add to their heartbeats for telemetry: the store's usage from its index and, on
the worker that runs the store's GC, its capacity, watermarks and eviction totals by reason."""

import asyncio
import random

from tests.workers.kvstore.test_gc import DeletedKeys, block
from tests.workers.kvstore.test_gc import FakeClock as GCClock
from tests.workers.worker_process import (
    CONFIG,
    collect,
    connected_client,
    start_worker,
    wait_for_worker_heartbeat,
)
from workers.engine import SamplingParams
from workers.kvstore.gc import GarbageCollector
from workers.kvstore.memory_index import MemoryIndex
from workers.kvstore.ttl import TTLPolicy
from workers.protocol.messages import GenerateRequest

PROMPT = [random.Random(2).randrange(CONFIG["vocab_size"]) for _ in range(200)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


def serve(worker, request: GenerateRequest) -> None:
    async def run() -> None:
        client = await connected_client(worker.endpoints)
        try:
            await collect(client, request)
        finally:
            await client.close()

    asyncio.run(run())


def test_the_gc_worker_reports_its_capacity_watermarks_and_evictions(tmp_path):
    # A capacity of one byte: every block written is over it, so the GC evicts them all.
    options = ("--kv-store", str(tmp_path / "kvstore"), "--kv-block-tokens", "64", "--kv-gc-interval", "0.2")
    worker = start_worker(tmp_path, "gc", *options, "--kv-store-capacity-bytes", "1")
    try:
        serve(worker, GenerateRequest("filled", PROMPT, GREEDY))  # 3 whole blocks of 64 tokens
        beat = wait_for_worker_heartbeat(
            worker.endpoints[1], lambda beat: beat.kv_store_evicted_capacity >= 3 and beat.kv_store_blocks == 0
        )
    finally:
        assert worker.stop() == 0
    assert beat.kv_store_bytes == 0 and beat.kv_store_evicted_expired == 0
    assert beat.kv_store_capacity_bytes == 1
    assert (beat.kv_store_low_watermark, beat.kv_store_high_watermark) == (0.8, 0.95)


def test_a_worker_without_the_gc_reports_usage_only(tmp_path):
    options = ("--kv-store", str(tmp_path / "kvstore"), "--kv-block-tokens", "64", "--kv-gc-interval", "0")
    worker = start_worker(tmp_path, "nogc", *options)
    try:
        serve(worker, GenerateRequest("stored", PROMPT, GREEDY))
        beat = wait_for_worker_heartbeat(worker.endpoints[1], lambda beat: beat.kv_store_blocks == 3)
    finally:
        assert worker.stop() == 0
    assert beat.kv_store_bytes > 0
    assert beat.kv_store_capacity_bytes == 0 and beat.kv_store_evicted_capacity == 0


def test_the_gc_counts_evictions_by_reason():
    index, clock, deleted = MemoryIndex(), GCClock(1000.0), DeletedKeys()
    index.add([block("old", at=0.0, size=10), *(block(f"new{n}", at=990.0, size=10) for n in range(4))])
    gc = GarbageCollector(
        index,
        TTLPolicy(ttl_s={"chat": 100.0}),
        "lru",
        capacity_bytes=40,
        low_watermark=0.5,
        delete_data=deleted,
        clock=clock,
    )

    gc.collect()  # "old" expires; 40 bytes of the rest exceed the high watermark (38): down to 20
    gc.collect()  # nothing left to do

    assert (gc.evicted_expired, gc.evicted_capacity) == (1, 2)
