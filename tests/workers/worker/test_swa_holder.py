"""A worker's SWA state holder with real sockets and the real Redis holder index: what it keeps is
registered and served, what its cache evicts and what an earlier life or a closed holder registered is
dropped, and fetch_window finds the state here, at a live holder, or nowhere, counting each; then the
sliding-window group an engine keeps state for, and where the worker's socket binds by default."""

import uuid
from collections.abc import Iterator

import pytest
import redis
import torch
import zmq

from tests.workers.engine.hf_reference import TINY_CONFIGS
from tests.workers.kvstore.conftest import REDIS_URL
from workers.engine import LLM
from workers.engine.kv.spec import KVCacheSpec, KVKind
from workers.engine.kv.swa_state import SwaStateCache, SwaStateError
from workers.kvstore.block_hash import hash_chain
from workers.kvstore.redis_holders import RedisHolders
from workers.kvstore.remote_holders import RemoteHolders
from workers.protocol.messages import SwaHolder
from workers.transfer.swa_fetch import SwaStateFetcher
from workers.worker.swa_holder import SwaStateHolder, swa_state_bind_endpoint

BLOCK = 4
SPEC = KVCacheSpec(
    kind=KVKind.SLIDING_WINDOW, layers=(0, 2), dtype=torch.float32, page_size=4, num_kv_heads=2, head_dim=8, window=9
)
RUN_SHAPE = SPEC.run_shape(BLOCK)
RUN_BYTES = SPEC.bytes_per_token * BLOCK
KEYS = hash_chain(list(range(40)), BLOCK, b"model")  # 10 blocks; a window of 9 reaches 2 blocks back


def run(i: int) -> torch.Tensor:
    return torch.full(RUN_SHAPE, float(i))


@pytest.fixture
def index() -> Iterator[RedisHolders]:
    client = redis.Redis.from_url(REDIS_URL)
    holders = RedisHolders(client, prefix=f"test:swa-holder:{uuid.uuid4().hex}")
    yield holders
    for name in client.scan_iter(match=f"{holders.prefix}:*"):
        client.delete(name)
    client.close()


@pytest.fixture
def context(tmp_path) -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


class Holders:
    """SwaStateHolders of workers "a", "b", ... on one Redis index, each serving on its own ipc socket."""

    def __init__(self, directory, index: RedisHolders, context: zmq.Context) -> None:
        self.directory, self.index, self.context = directory, index, context
        self.made: list[SwaStateHolder] = []

    def __call__(self, worker_id: str, capacity_runs: int = 16, serve: bool = True) -> SwaStateHolder:
        cache = SwaStateCache(SPEC, BLOCK, capacity_runs * RUN_BYTES)
        fetcher = SwaStateFetcher(SPEC, BLOCK, self.context, timeout_s=0.5)
        holder = SwaStateHolder(worker_id, cache, self.index, fetcher)
        if serve:
            holder.serve(f"ipc://{self.directory}/{worker_id}.swa", self.context)
        self.made.append(holder)
        return holder


@pytest.fixture
def holders(tmp_path, index, context) -> Iterator[Holders]:
    made = Holders(tmp_path, index, context)
    yield made
    for holder in made.made:
        holder.close()


def test_kept_blocks_are_registered_in_one_call_and_served(holders, index, context):
    a = holders("a")
    a.kept(KEYS[:3], [run(0), run(1), run(2)])

    assert index.holders(KEYS[:4]) == [{"a"}, {"a"}, {"a"}, set()]
    fetcher = SwaStateFetcher(SPEC, BLOCK, context)
    fetched = fetcher.fetch(a.endpoint, KEYS[1:3]).window()
    fetcher.close()
    assert fetched is not None and [float(r[0, 0, 0, 0, 0]) for r in fetched] == [1.0, 2.0]


def test_evicted_blocks_leave_the_index_and_a_block_put_again_stays(holders, index):
    a = holders("a", capacity_runs=2)
    a.kept(KEYS[:3], [run(0), run(1), run(2)])
    assert index.holders(KEYS[:3]) == [set(), {"a"}, {"a"}]
    # KEYS[1] goes out, then comes back within the same call: it is held, so it stays registered.
    a.kept([KEYS[3], KEYS[1]], [run(3), run(1)])
    assert index.holders(KEYS[:4]) == [set(), {"a"}, set(), {"a"}]


def test_an_earlier_life_s_registrations_go_when_a_holder_starts_and_a_closed_holder_s_go_too(holders, index):
    index.register(KEYS[:2], "a")  # a life of "a" that died without dropping them
    index.register(KEYS[:2], "b")
    a = holders("a")
    assert index.holders(KEYS[:2]) == [{"b"}, {"b"}]
    a.kept(KEYS[2:4], [run(2), run(3)])
    a.close()
    assert index.holders(KEYS[:4]) == [{"b"}, {"b"}, set(), set()]


def test_fetch_window_finds_the_state_here_then_at_a_live_holder_then_nowhere(holders, index):
    a, b = holders("a"), holders("b")
    a.kept(KEYS[:6], [run(i) for i in range(6)])
    prefix = KEYS[:6]

    assert [float(r.flatten()[0]) for r in a.fetch_window(prefix)] == [4.0, 5.0]  # its own cache
    assert b.fetch_window(prefix) is None  # "a" holds it, but b does not know where "a" is
    b.peers.learn([SwaHolder("a", a.endpoint)])
    fetched = b.fetch_window(prefix)
    assert fetched is not None and [float(r.flatten()[0]) for r in fetched] == [4.0, 5.0]
    # Fetched state is kept and registered: b holds it now too, and the next hit is local.
    assert index.holders(KEYS[4:6]) == [{"a", "b"}, {"a", "b"}]
    assert b.fetch_window(prefix) is not None
    assert b.fetch_window(KEYS[:8]) is None  # nobody computed blocks 6 and 7

    assert (a.stats.state_hits, a.stats.state_fetches, a.stats.state_misses) == (1, 0, 0)
    assert (b.stats.state_hits, b.stats.state_fetches, b.stats.state_misses) == (1, 1, 2)


def test_a_holder_gone_without_dropping_costs_a_miss_not_a_failure(holders, index, tmp_path):
    b = holders("b")
    index.register(KEYS[4:6], "gone")
    b.peers.learn([SwaHolder("gone", f"ipc://{tmp_path}/gone.swa")])  # nothing listens there
    assert b.fetch_window(KEYS[:6]) is None
    assert b.stats.state_misses == 1


def test_an_index_that_fails_costs_registrations_not_requests(holders, context, tmp_path):
    down = RemoteHolders(f"ipc://{tmp_path}/no-index", timeout_s=0.1, context=context)  # nothing serves there
    cache = SwaStateCache(SPEC, BLOCK, 4 * RUN_BYTES)
    holder = SwaStateHolder("a", cache, down, SwaStateFetcher(SPEC, BLOCK, context, timeout_s=0.2))
    holder.kept(KEYS[:2], [run(0), run(1)])
    assert KEYS[0] in cache
    assert holder.fetch_window(KEYS[:2]) is not None  # its own cache still answers
    assert holder.fetch_window(KEYS[:5]) is None
    holder.close()


def test_bad_kept_blocks_are_refused(holders):
    a = holders("a", serve=False)
    with pytest.raises(ValueError, match="kept 2 keys with 1 runs"):
        a.kept(KEYS[:2], [run(0)])
    with pytest.raises(SwaStateError, match="tokens"):
        a.kept(KEYS[:1], [torch.zeros(2, 2, 2, 5, 8)])
    with pytest.raises(ValueError, match="at least one block"):
        a.fetch_window([])


def test_the_engine_names_the_window_group_it_keeps_state_for_and_none_for_others(tmp_path):
    def engine_spec(config: dict, **settings) -> KVCacheSpec | None:
        llm = LLM(config, num_pages=16, dtype="bfloat16", **settings)
        spec = llm.engine.info.swa_state_spec
        llm.close()
        return spec

    hybrid = TINY_CONFIGS["qwen3_qknorm_layer_types"]
    store = {"kv_store": str(tmp_path), "kv_block_tokens": 32}
    assert engine_spec(hybrid, **store) == KVCacheSpec(
        kind=KVKind.SLIDING_WINDOW,
        layers=(0, 2),
        dtype=torch.bfloat16,
        page_size=16,
        num_kv_heads=2,
        head_dim=32,
        window=6,
    )
    assert engine_spec(hybrid) is None  # without a store, no hit to continue from
    assert engine_spec(TINY_CONFIGS["llama"], **store) is None
    every_layer_slides = {**hybrid, "layer_types": ["sliding_attention"] * 3}
    assert engine_spec(every_layer_slides, **store) is None


@pytest.mark.parametrize(
    "request_endpoint, bound",
    [
        ("tcp://*:7100", "tcp://*:0"),
        ("tcp://10.0.0.5:7100", "tcp://10.0.0.5:0"),
        ("ipc:///run/sluice/p0.req", "ipc:///run/sluice/p0.req.swa"),
        ("inproc://p0", "inproc://p0.swa"),
    ],
)
def test_the_swa_state_socket_binds_beside_the_request_endpoint_by_default(request_endpoint, bound):
    assert swa_state_bind_endpoint(request_endpoint) == bound
