"""The worker process over real ZMQ sockets: outputs, concurrency, aborts, bad input, overload, signals."""

import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from tests.workers.worker_process import (
    CONFIG,
    LONG,
    REPO_ROOT,
    SEED,
    collect,
    connected_client,
    endpoints,
    start_worker,
    token_ids,
    wait_for_heartbeat,
    worker_command,
)
from workers.client.worker_link import RequestRejectedError
from workers.engine import LLM, SamplingParams
from workers.protocol.messages import (
    CacheHint,
    GenerateError,
    GenerateOutput,
    GenerateRequest,
    OutputConstraintSpec,
    WorkerOutbound,
)

VOCAB = CONFIG["vocab_size"]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def rejection(worker, request: GenerateRequest) -> RequestRejectedError:
    """The error the worker answers `request` with (the test fails if it answers with outputs)."""

    async def run():
        client = await connected_client(worker.endpoints)
        try:
            with pytest.raises(RequestRejectedError) as rejected:
                await collect(client, request)
            return rejected.value
        finally:
            await client.close()

    return asyncio.run(run())


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    process = start_worker(tmp_path_factory.mktemp("w"), "main")
    yield process
    assert process.stop() == 0


def test_greedy_outputs_equal_the_offline_llm(worker):
    prompts = [random_prompt(n, seed=n) for n in (3, 17, 40, 90)]
    expected = [r.token_ids for r in LLM(CONFIG, seed=SEED, kv_cache_bytes=1 << 24).generate(prompts, greedy(12))]

    async def run():
        client = await connected_client(worker.endpoints)
        try:
            requests = [GenerateRequest(f"same-{i}", p, greedy(12)) for i, p in enumerate(prompts)]
            return await asyncio.gather(*(collect(client, r) for r in requests))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert [token_ids(outputs) for outputs in results] == expected
    for prompt, outputs in zip(prompts, results):
        assert outputs[-1].finish_reason == "length"
        assert all(o.finish_reason is None for o in outputs[:-1])
        assert outputs[0].num_prompt_tokens == len(prompt)


def test_64_concurrent_streams_all_complete_with_their_token_counts(worker):
    lengths = {f"many-{i}": 1 + i % 9 for i in range(64)}

    async def run():
        client = await connected_client(worker.endpoints)
        try:
            requests = [
                GenerateRequest(rid, random_prompt(5 + i, seed=i), greedy(n))
                for i, (rid, n) in enumerate(lengths.items())
            ]
            return await asyncio.gather(*(collect(client, r) for r in requests))
        finally:
            await client.close()

    results = asyncio.run(run())
    for (request_id, length), outputs in zip(lengths.items(), results):
        assert {o.request_id for o in outputs} == {request_id}
        assert len(token_ids(outputs)) == length
        assert outputs[-1].finish_reason == "length"


def test_abort_mid_stream_ends_the_stream_and_frees_the_request(worker):
    async def run():
        client = await connected_client(worker.endpoints)
        try:
            outputs = []
            async for output in client.generate(GenerateRequest("long", [1, 2, 3], greedy(LONG))):
                outputs.append(output)
                if len(outputs) == 2:
                    await client.abort("long")
            beats = await wait_for_heartbeat(client, lambda b: b and b[0].num_running == b[0].num_waiting == 0)
            return outputs, beats[0]
        finally:
            await client.close()

    outputs, heartbeat = asyncio.run(run())
    assert outputs[-1].finish_reason == "abort"
    assert 2 <= len(token_ids(outputs)) < LONG
    assert heartbeat.kv_usage == 0.0


def raw_exchange(worker, frames: list[bytes]) -> WorkerOutbound:
    """Send frames on a fresh DEALER and decode the one reply."""
    with zmq.Context() as context, context.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, 10_000)
        dealer.connect(worker.endpoints[0])
        dealer.send_multipart(frames)
        return msgspec.msgpack.decode(dealer.recv(), type=WorkerOutbound)


VALID = msgspec.to_builtins(GenerateRequest("ok", [1, 2, 3], greedy(2)))


@pytest.mark.parametrize(
    ("frames", "request_id", "message"),
    [
        ([b"\xc1 not msgpack"], "", "malformed"),
        ([msgspec.msgpack.encode({"type": "shutdown", "request_id": "x"})], "x", "shutdown"),
        ([msgspec.msgpack.encode({**VALID, "request_id": "types", "prompt_token_ids": [1, "a"]})], "types", "int"),
        ([msgspec.msgpack.encode({**VALID, "request_id": "extra", "priority": 1})], "extra", "priority"),
        (
            [msgspec.msgpack.encode({**VALID, "request_id": "temp", "params": {"temperature": -1}})],
            "temp",
            "temperature",
        ),
        ([msgspec.msgpack.encode(VALID), b"extra frame"], "", "frame"),
        (
            [
                msgspec.msgpack.encode(
                    {**VALID, "request_id": "hint", "cache_hints": [{"prefix_tokens": 0, "retain_s": 300.0}]}
                )
            ],
            "hint",
            "cache_hints[0].prefix_tokens",
        ),
        (
            [
                msgspec.msgpack.encode(
                    {**VALID, "request_id": "hints", "cache_hints": [{"prefix_tokens": 1, "retain_s": 300.0}] * 9}
                )
            ],
            "hints",
            "cache_hints",
        ),
    ],
    ids=["garbage", "unknown-tag", "wrong-type", "unknown-field", "bad-params", "two-frames", "bad-hint", "many-hints"],
)
def test_malformed_frames_are_answered_and_the_worker_keeps_serving(worker, frames, request_id, message):
    reply = raw_exchange(worker, frames)
    assert isinstance(reply, GenerateError)
    assert (reply.request_id, reply.kind) == (request_id, "invalid_request")
    assert message in reply.message.lower()
    again = raw_exchange(worker, [msgspec.msgpack.encode(VALID)])
    assert isinstance(again, GenerateOutput) and again.request_id == "ok"


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([1] * (CONFIG["max_position_embeddings"] + 1), greedy(4), "context window"),
        ([1, 2, VOCAB], greedy(4), "outside the vocabulary"),
        ([1, -5, 3], greedy(4), "outside the vocabulary"),
        ([1, 2, 3], greedy(CONFIG["max_position_embeddings"]), "exceeds the context window"),
    ],
    ids=["prompt-past-window", "token-past-vocab", "negative-token", "max-tokens-past-window"],
)
def test_invalid_requests_are_rejected(worker, prompt, params, message):
    error = rejection(worker, GenerateRequest("invalid", prompt, params))
    assert error.kind == "invalid_request" and message in error.message


def test_a_cache_hint_past_the_prompt_is_rejected(worker):
    request = GenerateRequest("hinted", [1, 2, 3], greedy(2), cache_hints=(CacheHint(prefix_tokens=4, retain_s=300),))

    error = rejection(worker, request)
    assert error.kind == "invalid_request" and "a cache hint covers 1 to 3 tokens" in error.message


def test_a_constraint_needs_a_tokenizer(worker):
    error = rejection(worker, GenerateRequest("json", [1, 2], greedy(4), constraint=OutputConstraintSpec("json", "")))
    assert error.kind == "invalid_constraint" and "tokenizer" in error.message


@pytest.mark.slow
def test_regex_constraints_shape_the_output_with_the_real_tokenizer(tmp_path_factory):
    config = {**CONFIG, "vocab_size": 49152}  # SmolLM2's vocabulary on a tiny random model
    worker = start_worker(
        tmp_path_factory.mktemp("w"), "grammar", "--tokenizer", "smollm2-135m-instruct", config=config
    )
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=20)

    async def run():
        client = await connected_client(worker.endpoints)
        try:
            regex = OutputConstraintSpec("regex", "(yes|no)! [0-9]{2}")
            requests = [
                GenerateRequest(f"re-{i}", [1, 2, 3 + i], p, constraint=regex)
                for i, p in enumerate([greedy(20), sampled])
            ]
            outputs = await asyncio.gather(*(collect(client, r) for r in requests))
            with pytest.raises(RequestRejectedError) as rejected:
                await collect(
                    client, GenerateRequest("bad", [1], greedy(4), constraint=OutputConstraintSpec("regex", "("))
                )
            return outputs, rejected.value
        finally:
            await client.close()

    try:
        outputs, error = asyncio.run(run())
    finally:
        assert worker.stop() == 0
    for stream in outputs:
        assert re.fullmatch("(yes|no)! [0-9]{2}", "".join(o.text for o in stream))
        assert stream[-1].finish_reason == "stop"
    assert error.kind == "invalid_constraint"


def test_a_request_id_in_use_is_rejected_without_disturbing_the_first(worker):
    async def run():
        first, second = await connected_client(worker.endpoints), await connected_client(worker.endpoints)
        try:
            stream = first.generate(GenerateRequest("twice", [4, 5, 6], greedy(LONG)))
            opening = await anext(stream)
            with pytest.raises(RequestRejectedError) as rejected:
                await collect(second, GenerateRequest("twice", [7, 8], greedy(3)))
            await first.abort("twice")
            rest = [output async for output in stream]
            return [opening, *rest], rejected.value
        finally:
            await first.close()
            await second.close()

    outputs, error = asyncio.run(run())
    assert error.kind == "invalid_request" and "already in use" in error.message
    assert outputs[-1].finish_reason == "abort"


def test_heartbeats_report_the_worker_and_its_engine_stats(worker):
    async def run():
        client = await connected_client(worker.endpoints)
        try:
            before = client.healthy_workers()[0]
            await collect(client, GenerateRequest("counted", random_prompt(21, seed=5), greedy(2)))
            after = await wait_for_heartbeat(client, lambda b: b[0].num_prompt_tokens >= before.num_prompt_tokens + 21)
            return before, after[0]
        finally:
            await client.close()

    before, after = asyncio.run(run())
    assert (after.worker_id, after.role, after.model) == ("main", "mixed", "main")
    assert after.request_endpoint == worker.endpoints[0]
    assert after.max_model_len == CONFIG["max_position_embeddings"]
    assert after.num_free_pages > 0 and after.num_running == 0
    assert after.num_prompt_tokens == before.num_prompt_tokens + 21
    assert after.started_at == before.started_at and after.sent_at > before.sent_at


def test_past_max_waiting_requests_are_answered_overloaded(tmp_path_factory):
    worker = start_worker(tmp_path_factory.mktemp("w"), "busy", "--max-num-seqs", "1", "--max-waiting", "1")

    async def run():
        client = await connected_client(worker.endpoints)
        try:
            running = client.generate(GenerateRequest("running", [1, 2, 3], greedy(LONG)))
            await anext(running)  # admitted: the only sequence slot is taken
            waiting = asyncio.create_task(collect(client, GenerateRequest("waiting", [4, 5], greedy(3))))
            await wait_for_heartbeat(client, lambda b: b[0].num_waiting == 1)
            with pytest.raises(RequestRejectedError) as rejected:
                await collect(client, GenerateRequest("refused", [6, 7], greedy(3)))
            await client.abort("running")
            await running.aclose()
            return rejected.value, await waiting
        finally:
            await client.close()

    try:
        error, waited = asyncio.run(run())
    finally:
        assert worker.stop() == 0
    assert error.kind == "overloaded"
    assert len(token_ids(waited)) == 3 and waited[-1].finish_reason == "length"


def test_sigterm_aborts_what_is_in_flight_and_exits_zero(tmp_path_factory):
    worker = start_worker(tmp_path_factory.mktemp("w"), "term")

    async def run():
        client = await connected_client(worker.endpoints)
        try:
            outputs = []
            async for output in client.generate(GenerateRequest("cut", [1, 2, 3], greedy(LONG))):
                outputs.append(output)
                if len(outputs) == 1:
                    worker.process.send_signal(signal.SIGTERM)
            return outputs
        finally:
            await client.close()

    try:
        outputs = asyncio.run(run())
        assert worker.process.wait(timeout=10) == 0
    finally:
        worker.stop()
    assert outputs[-1].finish_reason == "abort"


def test_a_crash_is_logged_with_its_traceback_and_exits_non_zero(tmp_path):
    crashed = subprocess.run(
        [sys.executable, "-m", "workers.worker", "--model", str(tmp_path / "missing.json")]
        + ["--request-endpoint", f"ipc://{tmp_path}/r", "--heartbeat-endpoint", f"ipc://{tmp_path}/h"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert crashed.returncode == 1
    assert "crashed" in crashed.stderr and "Traceback" in crashed.stderr


def test_the_worker_dies_with_its_parent_and_names_itself(tmp_path_factory):
    directory = tmp_path_factory.mktemp("w")
    command = worker_command(directory, "child")
    spawn_and_wait = (
        "import json, subprocess, sys, time; "
        "print(subprocess.Popen(json.loads(sys.argv[1])).pid, flush=True); time.sleep(120)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", spawn_and_wait, json.dumps(command)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True
    )
    child = int(parent.stdout.readline())
    try:

        async def wait_until_serving():
            await (await connected_client(endpoints(directory, "child"))).close()

        asyncio.run(wait_until_serving())
        assert Path(f"/proc/{child}/comm").read_text().strip() == "sluice-worker"
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while is_alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_alive(child)
    finally:
        parent.kill()
        if is_alive(child):
            os.kill(child, signal.SIGKILL)


def is_alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie nobody has reaped yet."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status
