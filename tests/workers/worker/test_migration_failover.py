"""A drain with grace that migrates decode requests, KV and decoding state, to another decode worker,
and the failover of a killed decode worker's requests from their checkpoints and the KV store:
prefill and decode workers as real processes sharing one store directory (each with its own
in-process index), through the EngineClient."""

import asyncio
import os
import random
import signal

import pytest

from tests.workers.worker_process import (
    CONFIG,
    Dealer,
    all_have,
    collect,
    connected_client,
    heartbeat_of,
    role_options,
    start_worker,
    stream_into,
    token_ids,
    wait_for_heartbeat,
)
from workers.engine import SamplingParams
from workers.kvstore.checkpoint_files import FOLDER
from workers.protocol.messages import (
    ControlAck,
    DrainRequest,
    GenerateError,
    GenerateRequest,
    ResumeDecodeRequest,
    ResumeRequest,
)
from workers.worker.checkpoints import Checkpoints, DirectoryStorage

VOCAB = CONFIG["vocab_size"]
MODEL = "tiny"
BLOCK = 16  # tokens per store block: a resumed request recomputes at most this many
MAX_TOKENS = 96  # long enough to be cut mid-stream
TIMEOUT_S = 240.0


def params(kind: str, index: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seed = 100 + index if kind == "seeded" else None
    return SamplingParams(temperature=0.9, top_k=50, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True)


def requests(kinds: list[str]) -> list[GenerateRequest]:
    rng = random.Random(7)
    return [
        GenerateRequest(f"{kind}{i}", [rng.randrange(VOCAB) for _ in range(20 + 7 * i)], params(kind, i))
        for i, kind in enumerate(kinds)
    ]


KINDS = ["greedy", "greedy", "seeded", "sampled"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A mixed worker (the reference, no store), one prefill and two decode workers sharing a store."""
    directory = tmp_path_factory.mktemp("mf")
    store = directory / "store"
    shared = ["--kv-store", str(store), "--kv-block-tokens", str(BLOCK)]

    def start(name: str, role: str = "decode"):
        gc = [] if role == "prefill" else ["--kv-gc-interval", "0"]
        workers[name] = start_worker(directory, name, *role_options(directory, name, role), *shared, *gc, model=MODEL)

    workers = {"m": start_worker(directory, "m", "--role", "mixed", model=MODEL)}
    start("p", "prefill")
    start("d0")
    start("d1")
    reference = asyncio.run(_reference(workers["m"].endpoints))
    yield workers, store, reference, start
    for worker in workers.values():
        worker.stop()


async def _reference(endpoints) -> dict[str, list[int]]:
    """Each greedy and seeded request's tokens, uninterrupted, from the mixed worker."""
    client = await connected_client(endpoints)
    try:
        outputs = await asyncio.gather(
            *(collect(client, r) for r in requests(KINDS) if r.params.seed is not None or r.params.temperature == 0)
        )
        return {output[0].request_id: token_ids(output) for output in outputs}
    finally:
        await client.close()


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))


def test_a_drain_with_grace_migrates_every_stream_to_the_other_decode_worker_with_nothing_recomputed(cluster):
    workers, _, reference, _ = cluster

    async def go():
        client = await connected_client(*(workers[n].endpoints for n in ("p", "d0", "d1")), heartbeat_timeout_s=2.0)
        try:
            batch = requests(KINDS)
            tokens = {r.request_id: [] for r in batch}
            streams = [asyncio.create_task(stream_into(client, r, tokens[r.request_id])) for r in batch]
            await all_have(tokens, 8)
            with Dealer(workers["d0"].endpoints[0]) as dealer:
                dealer.send(DrainRequest("drain-1", grace_s=0.2))
                ack = await asyncio.to_thread(dealer.receive)
            assert isinstance(ack, ControlAck) and ack.ok
            moved = ack.num_in_flight
            reasons = await asyncio.gather(*streams)
            await wait_for_heartbeat(client, lambda beats: heartbeat_of(client, "d0").state == "drained")
            return reasons, tokens, moved, heartbeat_of(client, "d0"), heartbeat_of(client, "d1")
        finally:
            await client.close()

    reasons, tokens, moved, d0, d1 = run(go())
    assert reasons == ["length"] * len(KINDS)
    assert all(len(t) == MAX_TOKENS for t in tokens.values())
    for request_id, expected in reference.items():
        assert tokens[request_id] == expected, request_id
    assert moved >= 1
    assert d0.num_migrated_out == moved and d0.num_migrations_failed == 0
    assert d1.num_migrated_in == moved
    assert d1.num_resumed == 0 and d1.num_recomputed_tokens == 0


def test_a_killed_decode_worker_s_streams_resume_on_the_other_from_the_store_recomputing_at_most_a_block(cluster):
    workers, store, reference, _ = cluster
    # The previous test drained d0: it takes requests again, and this one kills d1.
    with Dealer(workers["d0"].endpoints[0]) as dealer:
        dealer.send(ResumeRequest("resume-1"))
        assert dealer.receive().ok

    async def go():
        client = await connected_client(*(workers[n].endpoints for n in ("p", "d0", "d1")), heartbeat_timeout_s=1.0)
        try:
            await wait_for_heartbeat(client, lambda beats: all(b.state == "ready" for b in beats))
            batch = requests(KINDS)
            tokens = {r.request_id: [] for r in batch}
            streams = [asyncio.create_task(stream_into(client, r, tokens[r.request_id])) for r in batch]
            await all_have(tokens, 3 * BLOCK)
            victim = heartbeat_of(client, "d1").num_running
            os.kill(workers["d1"].process.pid, signal.SIGKILL)
            reasons = await asyncio.gather(*streams)
            return reasons, tokens, victim, heartbeat_of(client, "d0")
        finally:
            await client.close()

    reasons, tokens, victim, survivor = run(go())
    assert reasons == ["length"] * len(KINDS)
    assert all(len(t) == MAX_TOKENS for t in tokens.values())
    for request_id, expected in reference.items():
        assert tokens[request_id] == expected, request_id
    assert victim >= 1 and survivor.num_resumed == victim
    assert 0 < survivor.max_recomputed_tokens <= BLOCK


def test_a_resume_from_a_corrupt_truncated_or_missing_checkpoint_is_refused_as_checkpoint_invalid(cluster, tmp_path):
    workers, store, _, _ = cluster
    storage = DirectoryStorage(store / FOLDER)
    request = requests(["greedy"])[0]
    storage.put(Checkpoints.name("corrupt"), b"SKVC" + os.urandom(60))
    storage.put(Checkpoints.name("truncated"), b"SK")
    with Dealer(workers["d0"].endpoints[0]) as dealer:
        for checkpoint_id in ("corrupt", "truncated", "missing"):
            dealer.send(ResumeDecodeRequest(request, [1, 2, 3], checkpoint_id))
            reply = dealer.receive()
            assert isinstance(reply, GenerateError) and reply.kind == "checkpoint_invalid", reply
            assert checkpoint_id in reply.message


def test_streams_whose_checkpoints_are_corrupt_fall_back_to_a_rerun_and_finish_with_the_same_tokens(cluster):
    workers, store, reference, start = cluster
    start("d1")  # killed by the test before

    async def go():
        client = await connected_client(*(workers[n].endpoints for n in ("p", "d0", "d1")), heartbeat_timeout_s=1.0)
        try:
            batch = [r for r in requests(KINDS) if r.params.temperature == 0]
            tokens = {r.request_id: [] for r in batch}
            streams = [asyncio.create_task(stream_into(client, r, tokens[r.request_id])) for r in batch]
            await all_have(tokens, 2 * BLOCK)
            victim = max(("d0", "d1"), key=lambda name: heartbeat_of(client, name).num_running)
            assert heartbeat_of(client, victim).num_running >= 1
            resumed_before = heartbeat_of(client, "d1" if victim == "d0" else "d0").num_resumed
            os.kill(workers[victim].process.pid, signal.SIGKILL)
            for path in (store / FOLDER).iterdir():  # the dead worker's checkpoints among them
                path.write_bytes(b"SKVC" + os.urandom(40))
            reasons = await asyncio.gather(*streams)
            return reasons, tokens, resumed_before, heartbeat_of(client, "d1" if victim == "d0" else "d0")
        finally:
            await client.close()

    reasons, tokens, resumed_before, survivor = run(go())
    assert reasons == ["length"] * len(tokens)
    for request_id, got in tokens.items():
        assert got == reference[request_id], request_id
    assert survivor.num_resumed == resumed_before  # every resume was refused: the streams were rerun
