"""Speculating decode workers (n-gram drafts) hand their streams on exactly: a drain with grace
migrates them to the other decode worker, a killed one's resume from their checkpoints and the KV
store, and every stream ends with the tokens of an uninterrupted run without speculation. Prefill and
decode workers are real processes sharing one store directory; the heartbeats carry what the drafts
became."""

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
from workers.protocol.messages import ControlAck, DrainRequest, GenerateRequest, ResumeRequest

VOCAB = CONFIG["vocab_size"]
MODEL = "tiny"
BLOCK = 16
MAX_TOKENS = 96
TIMEOUT_S = 240.0
KINDS = ["greedy", "greedy", "seeded", "seeded"]


def requests() -> list[GenerateRequest]:
    """Prompts that repeat themselves, so the drafter finds what follows from the start."""
    rng = random.Random(11)
    batch = []
    for i, kind in enumerate(KINDS):
        seed = None if kind == "greedy" else 200 + i
        temperature = 0.0 if kind == "greedy" else 0.8
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True)
        batch.append(GenerateRequest(f"{kind}{i}", [rng.randrange(VOCAB) for _ in range(6 + i)] * 4, params))
    return batch


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A mixed worker without speculation (the reference), a prefill worker, and two decode workers
    that draft with n-grams, sharing a store."""
    directory = tmp_path_factory.mktemp("sm")
    shared = ["--kv-store", str(directory / "store"), "--kv-block-tokens", str(BLOCK)]
    workers = {"m": start_worker(directory, "m", "--role", "mixed", model=MODEL)}
    workers["p"] = start_worker(directory, "p", *role_options(directory, "p", "prefill"), *shared, model=MODEL)
    for name in ("d0", "d1"):
        speculating = ["--spec-method", "ngram", "--spec-max-draft-tokens", "4", "--kv-gc-interval", "0"]
        workers[name] = start_worker(
            directory, name, *role_options(directory, name, "decode"), *shared, *speculating, model=MODEL
        )
    reference = asyncio.run(_reference(workers["m"].endpoints))
    yield workers, reference
    for worker in workers.values():
        worker.stop()


async def _reference(endpoints) -> dict[str, list[int]]:
    client = await connected_client(endpoints)
    try:
        outputs = await asyncio.gather(*(collect(client, r) for r in requests()))
        return {output[0].request_id: token_ids(output) for output in outputs}
    finally:
        await client.close()


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))


def test_a_drain_migrates_speculating_streams_and_a_kill_resumes_them_with_the_uninterrupted_tokens(cluster):
    workers, reference = cluster

    async def go():
        client = await connected_client(*(workers[n].endpoints for n in ("p", "d0", "d1")), heartbeat_timeout_s=1.0)
        try:
            batch = requests()
            tokens = {r.request_id: [] for r in batch}
            streams = [asyncio.create_task(stream_into(client, r, tokens[r.request_id])) for r in batch]
            # given streams speculating on both decode workers
            await all_have(tokens, 2 * BLOCK)
            # when d0 drains (its streams migrate to d1), then d1 is killed (they resume on d0)
            with Dealer(workers["d0"].endpoints[0]) as dealer:
                dealer.send(DrainRequest("drain-spec", grace_s=0.2))
                ack = await asyncio.to_thread(dealer.receive)
            assert isinstance(ack, ControlAck) and ack.ok
            await wait_for_heartbeat(client, lambda beats: heartbeat_of(client, "d0").state == "drained", timeout_s=30)
            drafted = heartbeat_of(client, "d0").spec_decode
            with Dealer(workers["d0"].endpoints[0]) as dealer:
                dealer.send(ResumeRequest("resume-spec"))
                assert (await asyncio.to_thread(dealer.receive)).ok
            await all_have(tokens, 3 * BLOCK)
            os.kill(workers["d1"].process.pid, signal.SIGKILL)
            reasons = await asyncio.gather(*streams)
            return reasons, tokens, ack.num_in_flight, drafted, heartbeat_of(client, "d0")
        finally:
            await client.close()

    reasons, tokens, migrated, drafted, survivor = run(go())

    # then every stream has the tokens of an uninterrupted run without speculation
    assert reasons == ["length"] * len(KINDS)
    for request_id, expected in reference.items():
        assert tokens[request_id] == expected, request_id
    assert migrated >= 1
    assert survivor.num_resumed >= 1
    # and the heartbeats said what the drafts became
    assert drafted.method == "ngram" and drafted.num_drafts > 0
    assert survivor.spec_decode.num_accepted_tokens > 0
