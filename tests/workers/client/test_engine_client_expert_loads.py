"""The engine client sums the expert loads of every heartbeat it receives (each counts tokens since
the worker's previous one), not only the latest it keeps."""

import asyncio

import msgspec
import zmq
import zmq.asyncio

from workers.client.engine_client import EngineClient
from workers.protocol.messages import WorkerHeartbeat


def heartbeat(sent_at: float, expert_load: list[list[int]]) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id="moe-0",
        role="decode",
        model="tiny-moe",
        request_endpoint="ipc:///unused",
        max_model_len=64,
        num_running=0,
        num_waiting=0,
        kv_usage=0.0,
        num_free_pages=1,
        num_prompt_tokens=0,
        num_cached_prompt_tokens=0,
        num_preemptions=0,
        sent_at=sent_at,
        pool="moe",
        ep_layout_version=2,
        expert_load=expert_load,
    )


def test_every_heartbeat_counts_toward_the_expert_loads(tmp_path):
    async def run():
        context = zmq.asyncio.Context()
        publisher = context.socket(zmq.PUB)
        endpoint = f"ipc://{tmp_path}/moe.hb"
        publisher.bind(endpoint)
        client = EngineClient(context)
        client.add_worker(f"ipc://{tmp_path}/moe.req", endpoint)
        await client.start()
        try:
            encoder = msgspec.msgpack.Encoder()
            # A subscription takes a moment to reach the publisher: repeat a first, empty heartbeat.
            while not client.healthy_workers():
                await publisher.send(encoder.encode(heartbeat(0.0, [])))
                await asyncio.sleep(0.01)
            for sent_at, loads in [(1.0, [[1, 2, 3]]), (1.1, [[10, 0, 5]]), (1.2, [[0, 4, 0]])]:
                await publisher.send(encoder.encode(heartbeat(sent_at, loads)))
            while not client.healthy_workers() or client.healthy_workers()[0].sent_at < 1.2:
                await asyncio.sleep(0.01)
            return client.expert_loads.take(), client.expert_loads.take()
        finally:
            await client.close()
            publisher.close(linger=0)
            context.term()

    first, second = asyncio.run(run())

    assert first == {("moe", 2): [[11, 6, 8]]}
    assert second == {}
