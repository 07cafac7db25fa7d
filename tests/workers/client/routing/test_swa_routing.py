"""Routing a sliding-window model's request: the hit stands where a live worker holds the SWA state at its
end (one holder-index lookup, in memory and on the real Redis), backs off one block with the window
replayed otherwise, and the prefill balancer charges the replay and prefers a holder when close."""

import asyncio
import uuid
from collections.abc import Iterator

import msgspec
import pytest
import redis

from tests.workers.kvstore.conftest import REDIS_URL
from workers.client.routing.balancers.prefill import PrefillBalancer
from workers.client.routing.prefix_match import StoreHit, stored_prefix, swa_store_hit
from workers.client.routing.router import Router
from workers.client.store_hits import live_swa_endpoints, read_store_hit, swa_holders
from workers.cost_model import PrefillCostModel
from workers.engine import SamplingParams
from workers.kvstore.block_hash import hash_chain, namespace_extra
from workers.kvstore.holders import HolderIndex, MemoryHolders
from workers.kvstore.index import BlockEntry
from workers.kvstore.memory_index import MemoryIndex
from workers.kvstore.redis_holders import RedisHolders
from workers.kvstore.remote_holders import RemoteHolders
from workers.protocol.messages import GenerateRequest, SwaHolder, SwaLayers, WorkerHeartbeat

BLOCK = 16
LAYERS = SwaLayers(window=40, num_layers=3, replay="approximate", state_endpoint="ipc://holder.swa")
PROMPT = list(range(1, 101))  # 6 whole blocks
KEYS = hash_chain(PROMPT, BLOCK, b"model")
# Linear in new tokens only: a prediction is proportional to the tokens prefill computes.
LINEAR = PrefillCostModel(a=0.0, b=0.001, d=0.0, e=0.0)


@pytest.fixture(params=["memory", "redis"])
def holders(request) -> Iterator[HolderIndex]:
    if request.param == "memory":
        yield MemoryHolders()
        return
    client = redis.Redis.from_url(REDIS_URL)
    index = RedisHolders(client, prefix=f"test:swa-routing:{uuid.uuid4().hex}")
    yield index
    for name in client.scan_iter(match=f"{index.prefix}:*"):
        client.delete(name)
    client.close()


def test_a_hit_stands_where_a_live_worker_holds_the_state_at_its_end(holders):
    prefix = KEYS[:5]
    holders.register(prefix[-3:], "w1")  # a window of 39 tokens reaches 3 blocks back

    hit = swa_store_hit(prefix, holders, {"w1", "w2"}, block_tokens=BLOCK, layers=LAYERS)

    assert hit == StoreHit(80, 80, frozenset({"w1"}))
    assert hit.replayed_tokens == 0


def test_with_no_live_holder_the_hit_backs_off_one_block_and_replays_the_window(holders):
    prefix = KEYS[:5]
    holders.register(prefix[-3:], "dead")
    holders.register(prefix[-2:], "w1")  # not the whole window

    hit = swa_store_hit(prefix, holders, {"w1"}, block_tokens=BLOCK, layers=LAYERS)

    # 80 tokens stored; backed off to 64; approximate replay of W = 40 tokens before that.
    assert hit == StoreHit(64, 24, frozenset())
    assert hit.replayed_tokens == 40


def test_exact_replay_reaches_back_a_window_per_sliding_layer_and_stops_at_the_start(holders):
    exact = SwaLayers(window=10, num_layers=3, replay="exact")
    assert swa_store_hit(KEYS[:5], holders, set(), block_tokens=BLOCK, layers=exact) == StoreHit(64, 37)
    assert swa_store_hit(KEYS[:2], holders, set(), block_tokens=BLOCK, layers=exact) == StoreHit(16, 0)


def test_no_stored_prefix_no_index_and_a_window_of_one_token():
    assert swa_store_hit([], MemoryHolders(), {"w1"}, block_tokens=BLOCK, layers=LAYERS) == StoreHit(0, 0)
    # Without a holder index no one is known to hold the state.
    assert swa_store_hit(KEYS[:5], None, {"w1"}, block_tokens=BLOCK, layers=LAYERS) == StoreHit(64, 24)
    # A query that reads only itself needs no state: nothing to look up, nothing replayed.
    alone = SwaLayers(window=1, num_layers=1, replay="approximate")
    assert swa_store_hit(KEYS[:5], None, set(), block_tokens=BLOCK, layers=alone) == StoreHit(80, 80)


def test_the_stored_prefix_is_the_keys_the_index_holds_from_the_first():
    index = MemoryIndex()
    index.add(
        [
            BlockEntry(key=key, size=100, traffic_class="chat", depth=depth, created_at=0.0, last_access=0.0)
            for depth, key in enumerate(KEYS)
            if depth != 3
        ]
    )
    assert stored_prefix(index, PROMPT, block_tokens=BLOCK, extra=b"model") == KEYS[:3]


def heartbeat(worker_id: str, layers: SwaLayers | None) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker_id,
        role="prefill",
        model="m",
        request_endpoint=f"ipc://{worker_id}",
        max_model_len=1024,
        num_running=0,
        num_waiting=0,
        kv_usage=0.0,
        num_free_pages=1,
        num_prompt_tokens=0,
        num_cached_prompt_tokens=0,
        num_preemptions=0,
        sent_at=0.0,
        swa_layers=layers,
    )


def test_live_holders_are_the_healthy_workers_that_serve_their_state_and_requests_name_them():
    beats = [
        heartbeat("a", LAYERS),
        heartbeat("b", SwaLayers(window=40, num_layers=3, replay="approximate", state_endpoint="")),  # keeps none
        heartbeat("c", None),  # no sliding-window layers
    ]
    live = live_swa_endpoints(beats)
    assert live == {"a": "ipc://holder.swa"}
    assert swa_holders(StoreHit(80, 80, frozenset({"a"})), live) == (SwaHolder("a", "ipc://holder.swa"),)
    assert swa_holders(StoreHit(64, 24), live) == ()


def balancer(**options) -> PrefillBalancer:
    return PrefillBalancer(["p0", "p1", "p2"], LINEAR, tiers=(), step_budget_s=1.0, chunk_limit=4096, **options)


def test_the_prefill_cost_counts_the_replayed_tokens_as_work():
    router = Router(LINEAR)
    beats = [("p0", heartbeat("p0", LAYERS))]
    _, standing = router.choose_prefill(beats, 100, 80)
    _, replaying = router.choose_prefill(beats, 100, StoreHit(64, 24).compute_from)
    assert standing == pytest.approx(0.020)
    assert replaying == pytest.approx(0.076)


def test_a_holder_is_preferred_on_a_tie_or_when_close_and_not_when_far_behind():
    lb = balancer()
    assert lb.choose(100, 0) == "p0"  # a tie without holders: the first
    lb = balancer()
    assert lb.choose(100, 0, holders={"p2"}) == "p2"  # a tie: the holder
    lb.workers["p2"].queued_s = 0.05  # within a tenth of the step budget of the best
    assert lb.choose(100, 0, holders={"p2"}) == "p2"
    lb.workers["p2"].queued_s = 0.5  # far behind: the best worker fetches instead
    assert lb.choose(100, 0, holders={"p2"}) in ("p0", "p1")


def test_a_holder_in_another_tier_does_not_pull_a_request_out_of_its_own():
    lb = PrefillBalancer(["p0", "p1"], LINEAR, tiers=(1000,), step_budget_s=1.0, chunk_limit=4096)
    assert [w.tier for w in lb.workers.values()] == [0, 1]
    assert lb.choose(100, 0, holders={"p1"}) == "p0"


def test_read_store_hit_routes_a_holder_index_that_fails_as_a_replay_and_a_dense_model_as_stored(tmp_path):
    index = MemoryIndex()
    index.add(
        [
            BlockEntry(key=key, size=100, traffic_class="chat", depth=depth, created_at=0.0, last_access=0.0)
            for depth, key in enumerate(hash_chain(PROMPT, BLOCK, namespace_extra("m", "")))
        ]
    )
    request = GenerateRequest("r", PROMPT, SamplingParams())
    sliding = msgspec.structs.replace(heartbeat("a", LAYERS), kv_block_tokens=BLOCK, kv_model_id="m")
    dense = msgspec.structs.replace(sliding, swa_layers=None)
    down = RemoteHolders(f"ipc://{tmp_path}/no-index", timeout_s=0.1)  # nothing serves there

    async def read(worker):
        return await read_store_hit(index, down, request, worker, {"a": LAYERS.state_endpoint})

    # 99 reusable tokens: 6 whole blocks stored.
    assert asyncio.run(read(dense)) == StoreHit(96, 96)
    assert asyncio.run(read(sliding)) == StoreHit(80, 40)
    assert asyncio.run(read_store_hit(None, down, request, sliding, {})) == StoreHit(0, 0)
