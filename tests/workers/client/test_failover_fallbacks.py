"""What happens when a move cannot go as planned: a draining decode worker whose requests no other
decode worker has room for, a migration target that refuses the request after its KV was sent, and
a prefill worker killed mid-prefill. Each stream ends with the tokens of an uninterrupted run: real
worker processes of a tiny model sharing one store directory (each with its own in-process index),
through the EngineClient."""

import asyncio
import os
import random
import signal
import time
import uuid

import pytest

from tests.workers.worker_process import (
    CONFIG,
    LONG,
    Dealer,
    collect,
    connected_client,
    role_options,
    start_worker,
    token_ids,
    wait_for_heartbeat,
    wait_for_worker_heartbeat,
)
from workers.engine import SamplingParams
from workers.protocol.messages import (
    AbortRequest,
    DeclineMigrationRequest,
    DrainRequest,
    GenerateError,
    GenerateOutput,
    GenerateRequest,
    MigrateRequest,
    ResumeRequest,
    WorkerHeartbeat,
)

VOCAB = CONFIG["vocab_size"]
MODEL = "tiny"
BLOCK = 16  # tokens per store block
# d1 runs one request at a time and heartbeats this seldom, so a gateway can believe it idle while
# it is full (as when another gateway filled it since its last heartbeat); the clients that know d1
# wait longer for heartbeats.
STALE_HEARTBEAT_S = 6.0
PATIENT_CLIENT_S = 20.0
PREFILL_CHUNK = 32  # tokens a prefill worker computes per step: a long prompt takes many steps
TIMEOUT_S = 240.0
STARTUP_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A mixed worker (the reference, no store); two prefill and three decode workers sharing a store.
    d1 runs one request at a time and heartbeats every STALE_HEARTBEAT_S."""
    directory = tmp_path_factory.mktemp("ff")
    shared = ["--kv-store", str(directory / "store"), "--kv-block-tokens", str(BLOCK), "--kv-gc-interval", "0"]
    prefill = ["--max-num-batched-tokens", str(PREFILL_CHUNK)]
    options = {
        "p0": [*prefill],
        "p1": [*prefill],
        "d0": [],
        "d1": ["--max-num-seqs", "1", "--heartbeat-interval", str(STALE_HEARTBEAT_S)],
        "d2": [],
    }
    workers = {"m": start_worker(directory, "m", "--role", "mixed", model=MODEL)}
    for name, extra in options.items():
        role = "prefill" if name.startswith("p") else "decode"
        workers[name] = start_worker(
            directory, name, *role_options(directory, name, role), *shared, *extra, model=MODEL
        )
    for worker in workers.values():  # six processes starting at once on a small machine take a while
        wait_for_worker_heartbeat(worker.endpoints[1], timeout_s=STARTUP_TIMEOUT_S)
    yield workers
    for worker in workers.values():
        worker.stop()


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def beat(client, name: str) -> WorkerHeartbeat:
    return next(b for b in client.healthy_workers() if b.worker_id == name)


def endpoints(workers, *names: str) -> list[tuple[str, str]]:
    return [workers[name].endpoints for name in names]


async def reference(workers, request: GenerateRequest) -> list[int]:
    """The request's tokens, uninterrupted, from the mixed worker."""
    client = await connected_client(workers["m"].endpoints)
    try:
        return token_ids(await collect(client, request))
    finally:
        await client.close()


async def stream(client, request: GenerateRequest, outputs: list[GenerateOutput]) -> None:
    async for output in client.generate(request):
        outputs.append(output)


async def tokens_at_least(outputs: list[GenerateOutput], count: int) -> None:
    while len(token_ids(outputs)) < count:
        await asyncio.sleep(0.01)


def drain_now(worker) -> None:
    with Dealer(worker.endpoints[0]) as dealer:
        # A command id of its own: a worker answers one it has seen before without acting again.
        dealer.send(DrainRequest(f"drain-{uuid.uuid4()}", grace_s=0.0))
        assert dealer.receive().ok


def take_requests_again(worker) -> None:
    with Dealer(worker.endpoints[0]) as dealer:
        dealer.send(ResumeRequest(f"resume-{uuid.uuid4()}"))
        assert dealer.receive().ok


class Filler:
    """A long request sent straight to one worker (as another gateway's would be), running once
    constructed; on close, aborted and gone from the worker."""

    def __init__(self, worker, request_id: str) -> None:
        self.dealer = Dealer(worker.endpoints[0])
        self.request_id = request_id
        self.dealer.send(GenerateRequest(request_id, prompt(8, 99), greedy(LONG)))
        try:
            # Six worker processes share this machine's cores with whatever else runs: a first token
            # may take a while. A dealer left open would hang its context's collection later.
            first = self.dealer.receive(timeout_s=STARTUP_TIMEOUT_S)
        except BaseException:
            self.dealer.close()
            raise
        assert isinstance(first, GenerateOutput) and first.token_ids, first

    def close(self) -> None:
        self.dealer.send(AbortRequest(self.request_id))
        while self.dealer.receive().finish_reason is None:
            pass
        self.dealer.close()


def test_a_draining_worker_keeps_a_request_no_other_has_room_for_and_it_finishes_there(cluster):
    workers = cluster
    request = GenerateRequest("stays", prompt(20, 1), greedy(48))
    expected = run(reference(workers, request))

    async def go():
        # given d1 full (its one request slot taken by another gateway's request)
        filler = await asyncio.to_thread(Filler, workers["d1"], "filler-d1")
        client = await connected_client(*endpoints(workers, "p0", "d0", "d1"), heartbeat_timeout_s=PATIENT_CLIENT_S)
        try:
            await wait_for_heartbeat(client, lambda beats: beat(client, "d1").num_running == 1, timeout_s=30)
            prompt_tokens_at_start = beat(client, "p0").num_prompt_tokens
            outputs: list[GenerateOutput] = []
            task = asyncio.create_task(stream(client, request, outputs))
            await tokens_at_least(outputs, 8)
            # p0's heartbeats are periodic: wait for one that counts the prompt it computed
            await wait_for_heartbeat(
                client, lambda beats: beat(client, "p0").num_prompt_tokens > prompt_tokens_at_start
            )
            prompt_tokens = beat(client, "p0").num_prompt_tokens
            # when d0, the only other decode worker, drains with no grace
            await asyncio.to_thread(drain_now, workers["d0"])
            await task
            await wait_for_heartbeat(client, lambda beats: beat(client, "d0").state == "drained")
            ended_at = time.time()
            await wait_for_heartbeat(client, lambda beats: beat(client, "p0").sent_at > ended_at)
            return outputs, prompt_tokens, beat(client, "p0").num_prompt_tokens, beat(client, "d0")
        finally:
            await client.close()
            await asyncio.to_thread(filler.close)

    try:
        outputs, prompt_tokens_before, prompt_tokens_after, d0 = run(go())
    finally:
        take_requests_again(workers["d0"])

    # then the offer was declined, the request decoded on at d0 to its end, and nothing ran twice
    assert outputs[-1].finish_reason == "length"
    assert token_ids(outputs) == expected
    assert d0.num_migrations_declined >= 1
    assert d0.num_migrated_out == 0 and d0.num_migrations_failed == 0
    assert prompt_tokens_after == prompt_tokens_before  # no rerun of the prompt


def test_a_target_that_refuses_the_kv_after_it_left_is_replaced_by_a_resume_from_the_source_s_checkpoint(cluster):
    workers = cluster
    request = GenerateRequest("moving", prompt(20, 2), greedy(LONG))

    async def go():
        # given d2 busy with another gateway's request, and d1 full, so that the request goes to d0
        filler_d2 = await asyncio.to_thread(Filler, workers["d2"], "filler-d2")
        filler_d1 = await asyncio.to_thread(Filler, workers["d1"], "filler-d1")
        client = await connected_client(
            *endpoints(workers, "p0", "d0", "d1", "d2"), heartbeat_timeout_s=PATIENT_CLIENT_S
        )
        try:
            await wait_for_heartbeat(
                client, lambda beats: beat(client, "d1").num_running == beat(client, "d2").num_running == 1, 30
            )
            outputs: list[GenerateOutput] = []
            task = asyncio.create_task(stream(client, request, outputs))
            await tokens_at_least(outputs, 2 * BLOCK)
            # and d1 idle in this gateway's last heartbeat of it, then filled again by another gateway
            await asyncio.to_thread(filler_d1.close)
            await wait_for_heartbeat(client, lambda beats: beat(client, "d1").num_running == 0, timeout_s=30)
            filler_d1 = await asyncio.to_thread(Filler, workers["d1"], "filler-d1-again")
            # when d0 drains with no grace
            await asyncio.to_thread(drain_now, workers["d0"])
            await wait_for_heartbeat(client, lambda beats: beat(client, "d2").num_resumed == 1, timeout_s=60)
            resumed_at = len(token_ids(outputs))
            await tokens_at_least(outputs, resumed_at + 2 * BLOCK)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await wait_for_heartbeat(client, lambda beats: beat(client, "d0").state == "drained")
            return token_ids(outputs), beat(client, "d0"), beat(client, "d2")
        finally:
            await client.close()
            for filler in (filler_d1, filler_d2):
                await asyncio.to_thread(filler.close)

    try:
        tokens, d0, d2 = run(go())
    finally:
        take_requests_again(workers["d0"])
    expected = run(reference(workers, GenerateRequest("moving", request.prompt_token_ids, greedy(len(tokens)))))

    # then the gateway chose d1, d0 sent it the KV, d1 refused it (full), and d2 resumed the request
    # from d0's checkpoint and the store: the stream has the tokens of an uninterrupted run
    assert tokens == expected
    assert d0.num_migrated_out == 1 and d0.num_migrations_failed == 0
    assert d2.num_resumed == 1 and d2.num_migrated_in == 0
    assert 0 < d2.max_recomputed_tokens <= BLOCK


def test_a_decline_or_a_migration_of_a_request_not_offered_is_refused_in_the_protocol_s_shape(cluster):
    workers = cluster
    with Dealer(workers["d0"].endpoints[0]) as dealer:
        dealer.send(DeclineMigrationRequest("never-offered"))
        declined = dealer.receive()
        dealer.send(MigrateRequest("never-offered", "new-id", "ipc:///nowhere"))
        migrated = dealer.receive()
    for reply in (declined, migrated):
        assert isinstance(reply, GenerateError) and reply.kind == "invalid_request", reply
        assert "never-offered" in reply.message and "not offered" in reply.message


def test_a_prefill_worker_killed_mid_prefill_is_rerun_on_the_other_hitting_the_blocks_it_stored(cluster):
    workers = cluster
    request = GenerateRequest("long", prompt(1200, 3), greedy(8))
    expected = run(reference(workers, request))
    stored_before_kill = 8  # blocks of the prompt the victim has stored when it is killed

    async def go():
        client = await connected_client(*endpoints(workers, "p0", "p1", "d2"), heartbeat_timeout_s=1.0)
        try:
            written = {name: beat(client, name).num_store_blocks_written for name in ("p0", "p1")}
            hits = {name: beat(client, name).num_store_hit_tokens for name in ("p0", "p1")}
            outputs: list[GenerateOutput] = []
            task = asyncio.create_task(stream(client, request, outputs))

            def stored(name: str) -> int:
                return beat(client, name).num_store_blocks_written - written[name]

            await wait_for_heartbeat(
                client, lambda beats: max(stored("p0"), stored("p1")) >= stored_before_kill, timeout_s=120
            )
            victim = max(("p0", "p1"), key=stored)
            assert not outputs  # mid-prefill: nothing streamed yet
            os.kill(workers[victim].process.pid, signal.SIGKILL)
            await task
            survivor = "p1" if victim == "p0" else "p0"
            return outputs, beat(client, survivor).num_store_hit_tokens - hits[survivor]
        finally:
            await client.close()

    outputs, survivor_hit_tokens = run(go())

    assert token_ids(outputs) == expected and outputs[-1].finish_reason == "length"
    # the rerun read the blocks the dead worker stored instead of computing them again
    assert survivor_hit_tokens >= stored_before_kill * BLOCK
    assert stored_before_kill * BLOCK <= outputs[0].num_cached_tokens < len(request.prompt_token_ids)
