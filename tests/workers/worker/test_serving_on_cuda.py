"""Prefill and decode workers as real processes on one GPU (run on the accelerator machine: `pytest -m gpu`):
KV handed over CUDA IPC decodes as it does over frames, and the sequence that once crashed both
workers (bursts of streams, then a long prompt) is served whole, store off and on."""

import asyncio
import json
import random

import pytest
import torch

from bench.smollm2_config import SMOLLM2_135M_CONFIG
from tests.workers.worker_process import (
    CONFIG,
    collect,
    connected_client,
    role_options,
    start_worker,
    token_ids,
    wait_for_heartbeat,
)
from workers.engine import LLM, SamplingParams
from workers.protocol.messages import GenerateRequest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = ("--device", "cuda", "--kv-cache-bytes", str(1 << 28))
# SmolLM2's shape, 4 layers, a window long enough for the 8,421-token prompt of the crash.
LONG_CONFIG = {**SMOLLM2_135M_CONFIG, "num_hidden_layers": 4, "max_position_embeddings": 16384}
TIMEOUT_S = 600.0


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def prompt(length: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, TIMEOUT_S))


def test_kv_over_cuda_ipc_decodes_the_same_greedy_tokens_as_over_frames(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ipc")
    pairs = {
        backend: [
            start_worker(
                directory,
                f"{role}-{backend}",
                *role_options(directory, f"{role}-{backend}", role),
                *CUDA,
                f"--kv-transfer={transfer}",
                model="tiny",
            )
            for role in ("prefill", "decode")
        ]
        for backend, transfer in (("cuda_ipc", "auto"), ("zmq", "zmq"))
    }
    requests = [GenerateRequest(f"r{i}", prompt(10 + 37 * i, i, CONFIG["vocab_size"]), greedy(24)) for i in range(6)]

    async def go(backend):
        workers = pairs[backend]
        client = await connected_client(*(w.endpoints for w in workers))
        try:
            outputs = await asyncio.gather(*(collect(client, request) for request in requests))
            decode_id = f"decode-{backend}"
            beats = await wait_for_heartbeat(
                client, lambda beats: any(b.worker_id == decode_id and b.handoff_received for b in beats)
            )
            received = next(b for b in beats if b.worker_id == decode_id).handoff_received
            return [token_ids(o) for o in outputs], received
        finally:
            await client.close()

    try:
        results = {backend: run(go(backend)) for backend in pairs}
    finally:
        stopped = [worker.stop() for workers in pairs.values() for worker in workers]
    assert stopped == [0] * 4
    (ipc_tokens, ipc_received), (zmq_tokens, zmq_received) = results["cuda_ipc"], results["zmq"]
    assert all(len(tokens) == 24 for tokens in ipc_tokens)
    assert ipc_tokens == zmq_tokens
    assert set(ipc_received) == {"cuda_ipc"} and ipc_received["cuda_ipc"].num_transfers == len(requests)
    assert set(zmq_received) == {"zmq"}


@pytest.mark.parametrize("store", [False, True], ids=["store-off", "store-on"])
def test_bursts_then_a_long_prompt_are_served_and_the_long_prompt_decodes_as_offline(tmp_path_factory, store):
    directory = tmp_path_factory.mktemp("burst")
    (directory / "long.json").write_text(json.dumps(LONG_CONFIG))
    options = ["--max-model-len", "16384", *(["--kv-store", str(directory / "kvstore")] if store else [])]
    workers = [
        start_worker(
            directory, role, *role_options(directory, role, role), *CUDA, *options, config=LONG_CONFIG, model="long"
        )
        for role in ("prefill", "decode")
    ]
    vocab = LONG_CONFIG["vocab_size"]
    long_prompt = prompt(8421, 99, vocab)

    async def go():
        client = await connected_client(*(w.endpoints for w in workers), heartbeat_timeout_s=30.0)
        try:
            started = {b.worker_id: b.started_at for b in client.healthy_workers()}
            for burst in (1, 16, 64):
                requests = [
                    GenerateRequest(f"b{burst}-{i}", prompt(700, burst * 100 + i, vocab), greedy(16))
                    for i in range(burst)
                ]
                outputs = await asyncio.gather(*(collect(client, request) for request in requests))
                assert all(len(token_ids(o)) == 16 for o in outputs)
            long = await collect(client, GenerateRequest("long", long_prompt, greedy(8)))
            after = {b.worker_id: b.started_at for b in client.healthy_workers()}
            return token_ids(long), started, after
        finally:
            await client.close()

    try:
        long_tokens, started, after = run(go())
    finally:
        stopped = [worker.stop() for worker in workers]
    assert stopped == [0, 0]
    assert started == after and set(started) == {"prefill", "decode"}  # neither worker restarted
    reference = LLM(directory / "long.json", device="cuda", seed=0, kv_cache_bytes=1 << 28, max_model_len=16384)
    assert long_tokens == reference.generate([long_prompt], greedy(8))[0].token_ids
