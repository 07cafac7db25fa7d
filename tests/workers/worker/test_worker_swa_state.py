"""Real worker processes of a tiny hybrid model (sliding, full, sliding layers) with a KV store and the
holder index on the real Redis. A worker advertises its window and SWA state endpoint; its engine keeps
the SWA state of the blocks it stores, which the endpoint serves; another worker continuing that prefix
fetches the state instead of replaying the window; a new life drops an earlier one's registrations, a
clean shutdown its own, and a client that finds it dead drops them, after which routing backs off a
block."""

import asyncio
import socket
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
import torch
import zmq

from tests.workers.engine.hf_reference import TINY_CONFIGS
from tests.workers.kvstore.conftest import REDIS_URL
from tests.workers.worker.test_worker_curve import KEY, KeyedDealer
from tests.workers.worker.test_worker_curve import heartbeat as keyed_heartbeat
from tests.workers.worker_process import (
    Dealer,
    collect,
    connected_client,
    role_options,
    start_worker,
    wait_for_heartbeat,
    wait_for_worker_heartbeat,
)
from workers import curve
from workers.client.store_hits import live_swa_endpoints, read_store_hit
from workers.engine import LLM, SamplingParams
from workers.engine.kv.spec import KVCacheSpec, KVKind
from workers.kvstore.block_hash import BlockHash, hash_chain, namespace_extra
from workers.kvstore.store import open_holders, open_index
from workers.protocol.messages import GenerateOutput, GenerateRequest, SwaHolder, SwaLayers
from workers.transfer.swa_fetch import SwaStateFetcher
from workers.worker.args import WorkerArgs

HYBRID = {**TINY_CONFIGS["qwen3_qknorm_layer_types"], "max_position_embeddings": 1024}
BLOCK = 16
# The sliding-window layers' KV as the worker keeps it: layers 0 and 2, window 6, fp32 on the CPU.
SPEC = KVCacheSpec(
    kind=KVKind.SLIDING_WINDOW, layers=(0, 2), dtype=torch.float32, page_size=16, num_kv_heads=2, head_dim=32, window=6
)
PROMPT = list(range(1, 50))  # 3 whole blocks, all of them reusable


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture
def index_url() -> Iterator[str]:
    prefix = f"test:swa-worker:{uuid.uuid4().hex}"
    yield f"{REDIS_URL}?prefix={prefix}"
    client = redis.Redis.from_url(REDIS_URL)
    if names := list(client.scan_iter(match=f"{prefix}:*", count=1000)):
        client.delete(*names)
    client.close()


def start(tmp_path, name: str, index_url: str, *options: str):
    store = ("--kv-store", str(tmp_path / "store"), "--kv-store-index", index_url, "--kv-block-tokens", str(BLOCK))
    return start_worker(tmp_path, name, *store, *options, config=HYBRID, model="hybrid")


def prompt_keys(request: GenerateRequest, kv_model_id: str, block_tokens: int) -> list[BlockHash]:
    """The keys of the prompt's full blocks."""
    return hash_chain(request.prompt_token_ids, block_tokens, namespace_extra(kv_model_id, request.cache_namespace))


def wait_until(condition, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the condition never held")
        time.sleep(0.05)


def test_a_worker_serves_what_it_kept_at_the_endpoint_it_advertises_and_drops_its_registrations(tmp_path, index_url):
    holders = open_holders(index_url)
    stale = prompt_keys(GenerateRequest("x", list(range(100, 133)), greedy(1)), "hybrid:float32", BLOCK)
    holders.register(stale, "a")  # an earlier life of "a" that died without dropping them
    worker = start(tmp_path, "a", index_url)
    try:
        beat = wait_for_worker_heartbeat(worker.endpoints[1])
        assert beat.swa_layers == SwaLayers(
            window=6, num_layers=2, replay="approximate", state_endpoint=f"{worker.endpoints[0]}.swa"
        )
        assert holders.holders(stale) == [set(), set()]

        request = GenerateRequest("r", PROMPT, greedy(1))
        outputs = asyncio.run(_generate(worker.endpoints, request))
        assert outputs[-1].finish_reason == "length"
        keys = prompt_keys(request, beat.kv_model_id, BLOCK)
        wait_until(lambda: holders.holders(keys) == [{"a"}] * 3)  # the engine stored the 3 blocks

        with zmq.Context() as context:
            fetcher = SwaStateFetcher(SPEC, BLOCK, context, timeout_s=5.0)
            fetched = fetcher.fetch(beat.swa_layers.state_endpoint, keys)
            fetcher.close()
        assert fetched.error == ""
        # Each block's window-layer KV; the last block's is within the window, so it was computed.
        assert [tuple(run.shape) for run in fetched.runs] == [SPEC.run_shape(BLOCK)] * 3
        assert fetched.runs[-1].abs().sum() > 0
    finally:
        assert worker.stop() == 0
    assert holders.holders(keys) == [set()] * 3  # a clean shutdown withdraws them


async def _generate(endpoints, request):
    client = await connected_client(endpoints)
    try:
        return await collect(client, request)
    finally:
        await client.close()


def test_another_worker_continues_the_prefix_with_the_state_it_fetches_and_replays_nothing(tmp_path, index_url):
    holders, index = open_holders(index_url), open_index(index_url)
    a, b = start(tmp_path, "a", index_url), start(tmp_path, "b", index_url)
    longer = [*PROMPT, 7, 7, 7]
    try:
        a_beat = wait_for_worker_heartbeat(a.endpoints[1])
        with Dealer(a.endpoints[0]) as dealer:
            dealer.send(GenerateRequest("first", PROMPT, greedy(1)))
            _until_finished(dealer)
        keys = prompt_keys(GenerateRequest("k", PROMPT, greedy(1)), a_beat.kv_model_id, BLOCK)
        # Kept as the blocks are queued for the store; written by the store's writer thread after.
        wait_until(lambda: holders.holders(keys) == [{"a"}] * 3 and index.match_prefix(keys) == 3)

        # As the gateway routes it to b: naming the live holder of the state at the stored prefix's end.
        holder = SwaHolder(worker_id="a", endpoint=a_beat.swa_layers.state_endpoint)
        with Dealer(b.endpoints[0]) as dealer:
            dealer.send(GenerateRequest("second", longer, greedy(4), swa_holders=(holder,)))
            outputs = _until_finished(dealer)
        b_beat = wait_for_worker_heartbeat(b.endpoints[1], lambda beat: beat.swa is not None and beat.swa.state_fetches)
    finally:
        a.stop()
        b.stop()
    assert outputs[0].num_cached_tokens == 48  # the 3 stored blocks, none backed off
    assert (b_beat.swa.state_fetches, b_beat.swa.state_misses, b_beat.swa.replays) == (1, 0, 0)
    # The fetched state is the windows' exact KV: the tokens are those computed from scratch.
    reference = LLM(HYBRID, enable_prefix_caching=False).generate([longer], greedy(4))[0]
    assert [token for output in outputs for token in output.token_ids] == reference.outputs[0].token_ids


def _until_finished(dealer: Dealer) -> list[GenerateOutput]:
    outputs = []
    while not outputs or outputs[-1].finish_reason is None:
        reply = dealer.receive()
        if isinstance(reply, GenerateOutput):
            outputs.append(reply)
    return outputs


def test_a_dead_worker_s_registrations_are_dropped_by_the_client_and_routing_backs_off(tmp_path, index_url):
    holders, index = open_holders(index_url), open_index(index_url)
    worker = start(tmp_path, "a", index_url)
    request = GenerateRequest("r", [*PROMPT, 7, 7, 7], greedy(1))

    async def run():
        client = await connected_client(worker.endpoints, heartbeat_timeout_s=1.0, store_index=index, holders=holders)
        try:
            await collect(client, GenerateRequest("first", PROMPT, greedy(1)))
            (beat,) = client.healthy_workers()
            keys = prompt_keys(request, beat.kv_model_id, BLOCK)[:3]
            await asyncio.to_thread(wait_until, lambda: index.match_prefix(keys) == 3)  # written to the store
            live = live_swa_endpoints(client.healthy_workers())
            standing = await read_store_hit(index, holders, request, beat, live)

            worker.process.kill()  # no clean shutdown: nothing withdraws its registrations but the client
            await wait_for_heartbeat(client, lambda beats: not beats)
            await asyncio.to_thread(wait_until, lambda: holders.holders(keys) == [set()] * 3)
            backed_off = await read_store_hit(index, holders, request, beat, live)
            return standing, backed_off
        finally:
            await client.close()

    try:
        standing, backed_off = asyncio.run(run())
    finally:
        worker.stop()
    assert (standing.hit_tokens, standing.compute_from, standing.holders) == (48, 48, {"a"})
    # Even read against the endpoints it knew while "a" lived, the hit backs off a block and replays
    # the window's 6 tokens before it: the registrations are gone.
    assert (backed_off.hit_tokens, backed_off.compute_from, backed_off.holders) == (32, 26, set())


def test_a_split_request_of_a_sliding_window_model_is_routed_by_its_swa_hit(tmp_path, index_url):
    holders, index = open_holders(index_url), open_index(index_url)
    prefill = start(tmp_path, "p", index_url, *role_options(tmp_path, "p", "prefill"))
    decode = start(tmp_path, "d", index_url, *role_options(tmp_path, "d", "decode"))
    second = GenerateRequest("second", [*PROMPT, 7, 7, 7], greedy(2))

    async def run():
        client = await connected_client(prefill.endpoints, decode.endpoints, store_index=index, holders=holders)
        try:
            first = await collect(client, GenerateRequest("first", PROMPT, greedy(2)))
            keys = prompt_keys(second, client.healthy_workers()[0].kv_model_id, BLOCK)
            await asyncio.to_thread(wait_until, lambda: index.match_prefix(keys) == 3)
            return first, await collect(client, second), keys
        finally:
            await client.close()

    try:
        first, outputs, keys = asyncio.run(run())
    finally:
        prefill.stop()
        decode.stop()
    assert [o.finish_reason for o in (first[-1], outputs[-1])] == ["length", "length"]
    # The prefill worker kept the SWA state of the prompt's blocks, so the hit stood: 3 whole blocks.
    assert outputs[0].num_cached_tokens == 48
    assert holders.holders(keys) == [set()] * 3  # both stopped cleanly


def test_a_worker_that_keeps_no_state_advertises_its_window_without_an_endpoint(tmp_path, index_url):
    worker = start(tmp_path, "none", index_url, "--swa-state-bytes", "0")
    try:
        beat = wait_for_worker_heartbeat(worker.endpoints[1])
        assert beat.swa_layers == SwaLayers(window=6, num_layers=2, replay="approximate", state_endpoint="")
    finally:
        worker.stop()


def test_a_negative_swa_state_capacity_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="swa_state_bytes must be >= 0, got -1"):
        WorkerArgs.from_argv(
            ["--model", "m", "--request-endpoint", "ipc://r", "--heartbeat-endpoint", "ipc://h", "--swa-state-bytes=-1"]
        )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_over_the_network_the_swa_state_socket_is_curve_like_the_others(tmp_path, index_url):
    key_file = tmp_path / "cluster.key"
    curve.write_key_file(key_file, KEY)
    request_endpoint, heartbeat_endpoint = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    worker = start(
        tmp_path, "k", index_url, "--request-endpoint", request_endpoint, "--heartbeat-endpoint", heartbeat_endpoint,
        "--curve-key-file", str(key_file),
    )  # fmt: skip
    try:
        beat = keyed_heartbeat(heartbeat_endpoint, KEY)
        endpoint = beat.swa_layers.state_endpoint
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
        request = GenerateRequest("r", PROMPT, greedy(1))
        with KeyedDealer(request_endpoint, KEY) as dealer:
            dealer.send(request)
            while dealer.receive().finish_reason is None:
                pass
        keys = prompt_keys(request, beat.kv_model_id, BLOCK)
        with zmq.Context() as context:
            keyed = SwaStateFetcher(SPEC, BLOCK, context, key=KEY, timeout_s=5.0)
            plain = SwaStateFetcher(SPEC, BLOCK, context, timeout_s=0.5)
            fetched, refused = keyed.fetch(endpoint, keys), plain.fetch(endpoint, keys)
            keyed.close()
            plain.close()
        assert fetched.window() is not None
        assert refused.window() is None and refused.error  # a peer without the key gets nothing
    finally:
        assert worker.stop() == 0
