"""A request that brings down every engine worker its prompt reaches (real worker processes of a tiny
model that crash on a marked prompt, tests.workers.faulty_worker; the real EngineClient): it fails
alone with "worker_failed" rather than be run on the last worker able to serve requests, and the
workers left answer the other requests, also while the supervisor restarts the one it crashed."""

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from tests.workers.faulty_worker import CRASHING_PROMPT, SEGFAULTING_PROMPT
from tests.workers.worker_process import (
    REPO_ROOT,
    collect,
    connected_client,
    endpoints,
    role_options,
    start_worker,
    token_ids,
    wait_for_heartbeat,
    worker_command,
)
from workers.client.engine_client import EngineClient
from workers.client.worker_link import RequestRejectedError
from workers.engine import SamplingParams
from workers.protocol.messages import GenerateRequest, WorkerHeartbeat

FAULTY = "tests.workers.faulty_worker"
MODEL = "tiny"
TIMEOUT_S = 180.0
RESTART_TIMEOUT_S = 120.0  # the supervisor's restart delay, then a worker starting on a busy machine
BYSTANDER_TOKENS = 64  # still decoding, on a busy machine, while the crashing request fails
# A worker that dies of SIGSEGV reports nothing: the client notices when its heartbeats stop.
HEARTBEAT_TIMEOUT_S = 2.0


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))


async def rejection(client: EngineClient, request: GenerateRequest) -> RequestRejectedError:
    with pytest.raises(RequestRejectedError) as caught:
        await collect(client, request)
    return caught.value


def started_at(beats: list[WorkerHeartbeat]) -> dict[str, float]:
    return {beat.worker_id: beat.started_at for beat in beats}


def start_supervised(directory: Path, roles: dict[str, str]) -> subprocess.Popen:
    """Faulty workers of the given roles by name, under the embedded deployment's supervisor."""
    commands = {
        name: worker_command(directory, name, *role_options(directory, name, role), model=MODEL, module=FAULTY)
        for name, role in roles.items()
    }
    command = [sys.executable, "-m", "tests.workers.supervised_workers", json.dumps(commands)]
    return subprocess.Popen(command, cwd=REPO_ROOT)


def test_a_request_that_crashes_the_prefill_worker_fails_alone_and_the_decode_worker_serves_throughout(
    tmp_path_factory,
):
    directory = tmp_path_factory.mktemp("pd")
    # Both workers crash on the prompt: run whole on the decode worker, it would bring that one down too.
    supervisor = start_supervised(directory, {"p": "prefill", "d": "decode"})
    crashing = GenerateRequest("crashing", [*CRASHING_PROMPT, 10, 11], greedy(8))

    async def go():
        client = await connected_client(endpoints(directory, "p"), endpoints(directory, "d"))
        try:
            first = started_at(client.healthy_workers())
            bystander = client.generate(GenerateRequest("bystander", [20, 21, 22], greedy(BYSTANDER_TOKENS)))
            # The prefill worker's output, then the decode worker's: the bystander is on the decode worker.
            streamed = [await anext(bystander), await anext(bystander)]
            crashed = await rejection(client, crashing)
            # A client sending it again while the prefill worker is down (or, restarted, crashing it again).
            again = await rejection(client, msgspec.structs.replace(crashing, request_id="crashing-again"))
            during = await collect(client, GenerateRequest("during", [30, 31], greedy(6)))
            streamed += [output async for output in bystander]
            await wait_for_heartbeat(
                client,
                lambda beats: started_at(beats).get("p", first["p"]) != first["p"] and len(beats) == 2,
                timeout_s=RESTART_TIMEOUT_S,
            )
            after = await collect(client, GenerateRequest("after", [40, 41], greedy(6)))
            return first, crashed, again, during, streamed, after, started_at(client.healthy_workers())
        finally:
            await client.close()

    try:
        first, crashed, again, during, streamed, after, last = run(go())
    finally:
        supervisor.send_signal(signal.SIGTERM)
        supervisor_exit = supervisor.wait(timeout=60)

    assert crashed.kind == again.kind == "worker_failed"
    assert "the last one ready" in crashed.message  # not retried whole on the decode worker
    assert len(token_ids(during)) == 6 and len(token_ids(after)) == 6
    assert len(token_ids(streamed)) == BYSTANDER_TOKENS and streamed[-1].finish_reason == "length"
    assert last["d"] == first["d"]  # the decode worker never went down
    assert last["p"] != first["p"]  # the prefill worker did, and was restarted
    assert supervisor_exit == 0


@pytest.mark.parametrize(("num_workers", "num_crashed"), [(2, 1), (3, 2)], ids=["2 mixed", "3 mixed"])
def test_a_request_that_crashes_mixed_workers_is_retried_only_while_another_worker_would_be_left(
    tmp_path_factory, num_workers, num_crashed
):
    directory = tmp_path_factory.mktemp("mixed")
    workers = [
        start_worker(directory, f"m{index}", "--role", "mixed", model=MODEL, module=FAULTY)
        for index in range(num_workers)
    ]
    crashing = GenerateRequest("segfaulting", [*SEGFAULTING_PROMPT, 10], greedy(8))

    async def go():
        client = await connected_client(*(w.endpoints for w in workers), heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
        try:
            crashed = await rejection(client, crashing)
            return crashed, await collect(client, GenerateRequest("innocent", [30, 31], greedy(6)))
        finally:
            await client.close()

    try:
        crashed, innocent = run(go())
    finally:
        exit_codes = [worker.stop() for worker in workers]

    assert crashed.kind == "worker_failed"
    # Two mixed workers: the one left is the last, so no retry; three: retried once, on one of two.
    assert sorted(exit_codes) == [-signal.SIGSEGV] * num_crashed + [0] * (num_workers - num_crashed)
    assert len(token_ids(innocent)) == 6
