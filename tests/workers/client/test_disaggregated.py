"""Prefill and decode workers as real processes, through the EngineClient: the split request path
gives what a mixed worker gives, frees KV on both sides, and survives decode workers that die."""

import asyncio
import random
import signal
from contextlib import aclosing
from pathlib import Path

import msgspec
import pytest
import zmq

from tests.workers.worker_process import (
    CONFIG,
    LONG,
    Dealer,
    collect,
    connected_client,
    role_options,
    start_worker,
    token_ids,
    transfer_endpoint,
    wait_for_heartbeat,
)
from workers.client.engine_client import EngineClient
from workers.client.worker_link import RequestRejectedError, WorkerUnavailableError
from workers.engine import SamplingParams
from workers.protocol.messages import (
    ControlAck,
    ExpectTransferRequest,
    GenerateError,
    GenerateOutput,
    GenerateRequest,
    KVTransferChunk,
    StatusRequest,
)

VOCAB = CONFIG["vocab_size"]
MODEL = "tiny"  # every worker serves the same model name, so KV computed by one fits the others
TIMEOUT_S = 180.0  # for a whole test's streams: generous, a hang fails it rather than the suite


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def seeded(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=50, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def start(directory: Path, name: str, role: str, *options: str):
    return start_worker(directory, name, *role_options(directory, name, role), *options, model=MODEL)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """One mixed worker (the reference), two prefill and two decode workers."""
    directory = tmp_path_factory.mktemp("pd")
    roles = {"m": "mixed", "p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode"}
    workers = {name: start(directory, name, role) for name, role in roles.items()}
    yield workers
    assert [worker.stop() for worker in workers.values()] == [0] * len(workers)


REQUESTS = [
    GenerateRequest(f"r{i}", random_prompt(length, seed=i), params)
    for i, (length, params) in enumerate(
        [(3, greedy(10)), (40, greedy(16)), (90, greedy(8)), (21, seeded(12, 5)), (64, seeded(9, 11))]
    )
]


async def outputs_of(client: EngineClient, requests: list[GenerateRequest]) -> list[list[GenerateOutput]]:
    return await asyncio.gather(*(collect(client, request) for request in requests))


@pytest.mark.parametrize("names", [("p0", "d0"), ("p0", "p1", "d0", "d1")], ids=["1P+1D", "2P+2D"])
def test_split_outputs_equal_the_mixed_workers_and_report_cached_tokens(pool, names):
    async def go():
        mixed = await connected_client(pool["m"].endpoints)
        split = await connected_client(*(pool[name].endpoints for name in names))
        try:
            expected = await outputs_of(mixed, REQUESTS)
            got = await outputs_of(split, REQUESTS)
            # The same prompt again: its prefix is cached on the prefill side and reported by both sides.
            again = await collect(split, GenerateRequest("again", REQUESTS[2].prompt_token_ids, greedy(4)))
            return expected, got, again
        finally:
            await mixed.close()
            await split.close()

    expected, got, again = run(go())
    for request, reference, outputs in zip(REQUESTS, expected, got):
        assert token_ids(outputs) == token_ids(reference), request.request_id
        assert [o.finish_reason for o in outputs] == [None] * (len(outputs) - 1) + ["length"]
        assert {o.num_prompt_tokens for o in outputs} == {len(request.prompt_token_ids)}
    assert token_ids(again) == token_ids(expected[2])[:4]
    # Without a shared store a prefix hits only on the prefill worker that computed it; short prompts
    # all fall in the prefill balancer's first length tier, which has one of two workers.
    page = 16
    assert {o.num_cached_tokens for o in again} == {(len(REQUESTS[2].prompt_token_ids) - 1) // page * page}


def test_more_streams_than_the_prefill_worker_pins_at_once_all_equal_the_mixed_workers(pool):
    # Beyond its cap of prefills awaiting transfer (32) the prefill worker answers "overloaded" and the
    # request is tried again; the answer to the abort of the earlier attempt must not end the retry.
    requests = [GenerateRequest(f"many-{i}", random_prompt(12, seed=100 + i), greedy(6)) for i in range(72)]

    async def go():
        mixed = await connected_client(pool["m"].endpoints)
        split = await connected_client(pool["p0"].endpoints, pool["d0"].endpoints)
        try:
            return await outputs_of(mixed, requests), await outputs_of(split, requests)
        finally:
            await mixed.close()
            await split.close()

    expected, got = run(go())
    assert [token_ids(outputs) for outputs in got] == [token_ids(outputs) for outputs in expected]
    assert {outputs[-1].finish_reason for outputs in got} == {"length"}
    assert {output.request_id for outputs, request in zip(got, requests) for output in outputs} == {
        request.request_id for request in requests
    }


def free_pages(client: EngineClient) -> dict[str, int]:
    return {beat.worker_id: beat.num_free_pages for beat in client.healthy_workers()}


@pytest.mark.parametrize("cut_after", [1, 3], ids=["after-first-token", "mid-decode"])
def test_a_consumer_that_stops_frees_the_kv_on_both_sides(pool, cut_after):
    async def go():
        client = await connected_client(pool["p1"].endpoints, pool["d1"].endpoints)
        try:
            idle = free_pages(client)
            request = GenerateRequest(f"cut-{cut_after}", random_prompt(70, seed=cut_after), greedy(LONG))
            async with aclosing(client.generate(request)) as stream:
                async for index, _ in aenumerate(stream):
                    if index + 1 == cut_after:
                        break
            # Both workers' pages come back: the wait fails the test if either side keeps any.
            await wait_for_heartbeat(client, lambda beats: {b.worker_id: b.num_free_pages for b in beats} == idle)
            return idle
        finally:
            await client.close()

    idle = run(go())
    assert set(idle) == {"p1", "d1"}


async def aenumerate(stream):
    index = 0
    async for item in stream:
        yield index, item
        index += 1


def test_killing_a_decode_worker_under_16_streams_ends_every_stream(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kill")
    workers = {
        name: start(directory, name, role) for name, role in [("p", "prefill"), ("da", "decode"), ("db", "decode")]
    }
    reference = start(directory, "ref", "mixed")
    # 12 greedy streams (a retry reproduces them), 4 sampled without a seed (one cannot).
    requests = [GenerateRequest(f"g{i}", random_prompt(10 + i, seed=i), greedy(60)) for i in range(12)]
    requests += [
        GenerateRequest(f"u{i}", random_prompt(12 + i, seed=100 + i), SamplingParams(max_tokens=60, ignore_eos=True))
        for i in range(4)
    ]

    async def consume(client: EngineClient, request: GenerateRequest, started: asyncio.Event):
        outputs = []
        try:
            async for output in client.generate(request):
                outputs.append(output)
                if len(outputs) == 2:
                    started.set()
        except (WorkerUnavailableError, RequestRejectedError) as error:
            started.set()
            return outputs, error
        return outputs, None

    async def go():
        client = await connected_client(*(w.endpoints for w in workers.values()), heartbeat_timeout_s=2.0)
        mixed = await connected_client(reference.endpoints)
        try:
            expected = await outputs_of(mixed, requests[:12])
            started = [asyncio.Event() for _ in requests]
            tasks = [asyncio.create_task(consume(client, r, e)) for r, e in zip(requests, started)]
            await asyncio.gather(*(event.wait() for event in started))
            workers["da"].process.send_signal(signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            await wait_for_heartbeat(client, lambda beats: all(b.num_running == 0 for b in beats))
            return expected, results
        finally:
            await client.close()
            await mixed.close()

    try:
        expected, results = run(go())
    finally:
        workers["da"].process.wait()
        assert [workers[name].stop() for name in ("p", "db")] == [0, 0]
        assert reference.stop() == 0
    for request, (outputs, error) in zip(requests, results):
        if error is None:
            assert outputs[-1].finish_reason == "length" and len(token_ids(outputs)) == 60, request.request_id
        else:
            assert request.request_id.startswith("u"), f"{request.request_id}: {error}"
    greedy_results = results[:12]
    assert all(error is None for _, error in greedy_results)
    assert [token_ids(outputs) for outputs, _ in greedy_results] == [token_ids(e) for e in expected]


def test_a_transfer_to_a_dead_decode_worker_is_retried_on_another(tmp_path_factory):
    directory = tmp_path_factory.mktemp("dead")
    workers = {
        name: start(directory, name, role) for name, role in [("p", "prefill"), ("da", "decode"), ("db", "decode")]
    }
    requests = [GenerateRequest(f"t{i}", random_prompt(30, seed=i), greedy(6)) for i in range(6)]

    async def go():
        # A long heartbeat timeout: the client keeps routing to the dead worker, so transfers to it fail.
        client = await connected_client(*(w.endpoints for w in workers.values()), heartbeat_timeout_s=60.0)
        try:
            expected = await outputs_of(client, requests)
            workers["da"].process.send_signal(signal.SIGKILL)
            workers["da"].process.wait()
            retried = [msgspec.structs.replace(r, request_id=f"{r.request_id}-again") for r in requests]
            return expected, await outputs_of(client, retried)
        finally:
            await client.close()

    try:
        expected, after = run(go())
    finally:
        assert [workers[name].stop() for name in ("p", "db")] == [0, 0]
    assert [token_ids(outputs) for outputs in after] == [token_ids(outputs) for outputs in expected]


def test_malformed_or_missing_transfers_fail_their_request_and_the_decode_worker_keeps_serving(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bad")
    prefill = start(directory, "p", "prefill")
    decode = start(directory, "d", "decode", "--transfer-timeout", "3")
    header = msgspec.msgpack.encode(
        {"type": "kv_header", "request_id": "bad-dtype", "prompt_token_ids": [1], "output_token_ids": [2]}
        | {"params": {}, "num_computed_tokens": 1, "num_cached_tokens": 0, "traffic_class": "chat"}
        | {"cache_namespace": "", "kv_model_id": "x", "dtype": "int8", "kv_layout": "x", "layer_shape": [2, 1, 1, 1]}
        | {"num_layers": 1, "chunk_layers": 1}
    )
    try:
        with Dealer(decode.endpoints[0]) as dealer, zmq.Context() as context, context.socket(zmq.DEALER) as sender:
            sender.setsockopt(zmq.LINGER, 0)
            sender.connect(transfer_endpoint(directory, "d"))
            dealer.send(ExpectTransferRequest("bad-dtype"), ExpectTransferRequest("never"), StatusRequest("status"))
            # Answered after the expectations (one socket, in order): KV sent from now on is expected.
            status = dealer.receive()
            assert isinstance(status, ControlAck) and status.num_in_flight == 2
            sender.send_multipart([b"\xc1 not msgpack", b"x"])
            sender.send_multipart([msgspec.msgpack.encode(KVTransferChunk("bad-dtype", 3)), b"x"])
            sender.send_multipart([header, b"\x00" * 4])
            replies = {reply.request_id: reply for reply in (dealer.receive(), dealer.receive())}
        for request_id in ("bad-dtype", "never"):
            assert isinstance(replies[request_id], GenerateError)
            assert replies[request_id].kind == "transfer_failed"
        assert "without a header" in replies["bad-dtype"].message  # the first malformed message settled it
        assert "no KV arrived" in replies["never"].message

        async def go():
            client = await connected_client(prefill.endpoints, decode.endpoints)
            try:
                return await collect(client, GenerateRequest("fine", [5, 6, 7], greedy(5)))
            finally:
                await client.close()

        assert len(token_ids(run(go()))) == 5
    finally:
        assert [prefill.stop(), decode.stop()] == [0, 0]
