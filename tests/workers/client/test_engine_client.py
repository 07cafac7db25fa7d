"""The gateway's client of the workers: balancing, early exits, and workers that die or restart (a
request in flight on a lone worker that failed is not retried: no other worker would be left)."""

import asyncio
import signal
import time

import pytest

from tests.workers.worker_process import LONG, collect, connected_client, start_worker, token_ids, wait_for_heartbeat
from workers.client.engine_client import EngineClient
from workers.client.worker_link import RequestRejectedError, WorkerUnavailableError
from workers.engine import SamplingParams
from workers.protocol.messages import GenerateOutput, GenerateRequest

LONG_GREEDY = SamplingParams(temperature=0.0, max_tokens=LONG, ignore_eos=True)


def idle(beats) -> bool:
    return bool(beats) and all(b.num_running == b.num_waiting == 0 for b in beats)


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    directory = tmp_path_factory.mktemp("w")
    workers = [start_worker(directory, "a"), start_worker(directory, "b")]
    yield workers
    assert [worker.stop() for worker in workers] == [0, 0]


async def stream_until_cancelled(client: EngineClient, request: GenerateRequest, started: asyncio.Event) -> None:
    async for _ in client.generate(request):
        started.set()


def test_without_a_healthy_worker_generate_raises_worker_unavailable(tmp_path):
    async def run():
        client = EngineClient()
        client.add_worker(f"ipc://{tmp_path}/nobody.req", f"ipc://{tmp_path}/nobody.hb")
        await client.start()
        try:
            assert client.healthy_workers() == []
            with pytest.raises(WorkerUnavailableError):
                await collect(client, GenerateRequest("r", [1, 2], LONG_GREEDY))
        finally:
            await client.close()

    asyncio.run(run())


def test_streams_spread_over_the_least_loaded_workers_and_cancelling_them_aborts_them(two_workers):
    async def run():
        client = await connected_client(*(w.endpoints for w in two_workers))
        try:
            started = [asyncio.Event() for _ in range(8)]
            tasks = [
                asyncio.create_task(
                    stream_until_cancelled(client, GenerateRequest(f"s{i}", [i + 1, 2], LONG_GREEDY), event)
                )
                for i, event in enumerate(started)
            ]
            await asyncio.gather(*(event.wait() for event in started))
            busy = await wait_for_heartbeat(client, lambda b: sum(x.num_running for x in b) == 8)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await wait_for_heartbeat(client, idle)
            return busy
        finally:
            await client.close()

    busy = asyncio.run(run())
    assert sorted(b.num_running for b in busy) == [4, 4]


def test_breaking_out_of_a_stream_aborts_the_request(two_workers):
    async def run():
        client = await connected_client(*(w.endpoints for w in two_workers))
        try:
            outputs: list[GenerateOutput] = []
            async for output in client.generate(GenerateRequest("brief", [9, 9, 9], LONG_GREEDY)):
                outputs.append(output)
                break
            await wait_for_heartbeat(client, idle)
            return outputs
        finally:
            await client.close()

    outputs = asyncio.run(run())
    assert len(token_ids(outputs)) == 1


def test_a_killed_worker_fails_its_streams_after_the_heartbeat_timeout(tmp_path_factory):
    worker = start_worker(tmp_path_factory.mktemp("w"), "doomed")

    async def run():
        client = await connected_client(worker.endpoints, heartbeat_timeout_s=1.0)
        try:
            stream = client.generate(GenerateRequest("orphan", [1, 2, 3], LONG_GREEDY))
            await anext(stream)
            worker.process.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            with pytest.raises(RequestRejectedError, match="stopped sending heartbeats") as failed:
                async for _ in stream:
                    pass
            assert failed.value.kind == "worker_failed"
            waited = time.monotonic() - killed_at
            assert client.healthy_workers() == []
            with pytest.raises(WorkerUnavailableError):
                await collect(client, GenerateRequest("after", [1], LONG_GREEDY))
            return waited
        finally:
            await client.close()

    try:
        waited = asyncio.run(asyncio.wait_for(run(), timeout=30))
    finally:
        worker.stop()
    assert waited < 4.0  # the 1 s timeout plus the watchdog's period, with room for a busy machine


def test_a_restarted_worker_fails_the_streams_it_lost_and_serves_new_ones(tmp_path_factory):
    directory = tmp_path_factory.mktemp("w")
    worker = start_worker(directory, "phoenix")
    replacement = None

    async def run():
        nonlocal replacement
        client = await connected_client(worker.endpoints, heartbeat_timeout_s=60.0)  # only the restart can end it
        try:
            stream = client.generate(GenerateRequest("lost", [1, 2, 3], LONG_GREEDY))
            await anext(stream)
            first_start = client.healthy_workers()[0].started_at
            worker.process.send_signal(signal.SIGKILL)
            worker.process.wait()
            replacement = start_worker(directory, "phoenix")
            with pytest.raises(RequestRejectedError, match="restarted") as failed:
                async for _ in stream:
                    pass
            assert failed.value.kind == "worker_failed"
            await wait_for_heartbeat(client, lambda b: b and b[0].started_at != first_start)
            return await collect(client, GenerateRequest("fresh", [4, 5], SamplingParams(temperature=0, max_tokens=3)))
        finally:
            await client.close()

    try:
        outputs = asyncio.run(asyncio.wait_for(run(), timeout=60))
    finally:
        worker.stop()
        if replacement is not None:
            assert replacement.stop() == 0
    assert len(token_ids(outputs)) == 3


def test_closing_the_client_ends_its_open_streams_and_aborts_them(two_workers):
    async def run():
        client = await connected_client(*(w.endpoints for w in two_workers))
        stream = client.generate(GenerateRequest("open", [3, 1, 4], LONG_GREEDY))
        await anext(stream)
        await client.close()
        with pytest.raises(WorkerUnavailableError):
            async for _ in stream:  # outputs that arrived before the close come first
                pass
        observer = await connected_client(*(w.endpoints for w in two_workers))
        try:
            await wait_for_heartbeat(observer, idle)
        finally:
            await observer.close()

    asyncio.run(run())
