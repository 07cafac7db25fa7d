"""Worker processes with the global KV store, over real ZMQ: a restarted worker serves a prompt's
prefix from the blocks its predecessor stored, reports it, and refuses a bad traffic class."""

import asyncio
import random
import time

import pytest

from tests.workers.worker_process import CONFIG, collect, connected_client, start_worker, token_ids, wait_for_heartbeat
from workers.client.worker_link import RequestRejectedError
from workers.engine import SamplingParams
from workers.protocol.messages import GenerateRequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [random.Random(1).randrange(CONFIG["vocab_size"]) for _ in range(300)]


def serve_once(worker, request: GenerateRequest):
    async def run():
        client = await connected_client(worker.endpoints)
        try:
            outputs = await collect(client, request)
            beats = await wait_for_heartbeat(client, lambda b: b[0].num_prompt_tokens >= len(request.prompt_token_ids))
            return outputs, beats[0]
        finally:
            await client.close()

    return asyncio.run(run())


def test_a_restarted_worker_serves_the_prefix_its_predecessor_stored(tmp_path):
    store = tmp_path / "kvstore"
    options = ("--kv-store", str(store), "--kv-block-tokens", "64")
    # Both runs carry the same name: the model id is part of every block key.
    first = start_worker(tmp_path, "kv", *options)
    try:
        cold, _ = serve_once(first, GenerateRequest("cold", PROMPT, GREEDY, traffic_class="agent"))
    finally:
        assert first.stop() == 0
    assert cold[-1].num_cached_tokens == 0

    second = start_worker(tmp_path, "kv", *options)
    try:
        warm, beat = serve_once(second, GenerateRequest("warm", PROMPT, GREEDY))
    finally:
        assert second.stop() == 0
    assert warm[-1].num_cached_tokens == 256  # 299 reusable tokens: 4 whole blocks of 64
    assert token_ids(warm) == token_ids(cold)
    assert beat.num_store_hit_tokens == 256 and beat.num_store_blocks_read == 4


@pytest.mark.parametrize("traffic_class", ["", "x" * 65])
def test_a_bad_traffic_class_is_rejected(tmp_path, traffic_class):
    worker = start_worker(tmp_path, "strict", "--kv-store", str(tmp_path / "kvstore"))

    async def run():
        client = await connected_client(worker.endpoints)
        try:
            with pytest.raises(RequestRejectedError) as rejected:
                await collect(client, GenerateRequest("bad", PROMPT[:10], GREEDY, traffic_class=traffic_class))
            return rejected.value
        finally:
            await client.close()

    try:
        error = asyncio.run(run())
    finally:
        assert worker.stop() == 0
    assert error.kind == "invalid_request" and "traffic_class" in error.message


def test_the_workers_gc_keeps_the_store_within_its_capacity(tmp_path):
    store = tmp_path / "kvstore"
    options = ("--kv-store", str(store), "--kv-block-tokens", "64", "--kv-gc-interval", "0.2")
    # A capacity of one byte: every block the worker writes is over it, so the GC must evict it.
    worker = start_worker(tmp_path, "gc", *options, "--kv-store-capacity-bytes", "1")
    try:
        serve_once(worker, GenerateRequest("filled", PROMPT, GREEDY))

        async def written():
            client = await connected_client(worker.endpoints)
            try:
                return await wait_for_heartbeat(client, lambda b: b[0].num_store_blocks_written >= 4)
            finally:
                await client.close()

        asyncio.run(written())  # the worker did store the prompt's blocks, so the GC had work to do
        deadline = time.monotonic() + 10
        while list(store.rglob("*.blk")) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        assert worker.stop() == 0
    assert list(store.rglob("*.blk")) == []
