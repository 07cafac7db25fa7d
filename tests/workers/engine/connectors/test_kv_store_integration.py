"""The engine with the global KV store: prompts fetch their stored prefix instead of recomputing it,
and the blocks an engine completes (prompt and output) are stored for the next engine that asks;
cache hints retain the prefixes they cover, through a GC pass, and outputs report what was stored.

Tiny random-weight models; each "restart" is a new engine on the same store directory, so nothing
can come from the engine-local prefix cache.
"""

import random
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq

from tests.workers.engine.hf_reference import TINY_CONFIGS
from workers.engine import LLM, SamplingParams
from workers.engine.connectors import store as store_connector
from workers.kvstore.block_hash import hash_chain, namespace_extra, scoped_namespace
from workers.kvstore.directory_index import DirectoryIndex
from workers.kvstore.gc import GarbageCollector
from workers.kvstore.index_server import IndexServer
from workers.kvstore.store import open_store
from workers.kvstore.ttl import TTLPolicy
from workers.protocol.errors import InvalidRequestError
from workers.protocol.messages import CacheHint

# Full attention only: a hybrid model takes no hits from the store (connectors.store) until its windows'
# state can be replayed or fetched.
CONFIG = TINY_CONFIGS["llama"]
BLOCK = 32  # store block: two engine pages of 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128) for _ in range(length)]


def engine(store_dir=None, **overrides) -> LLM:
    options = {"seed": 0, "kv_cache_bytes": 1 << 24, "kv_block_tokens": BLOCK, **overrides}
    return LLM(CONFIG, kv_store=store_dir, **options)


CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)


def run(llm: LLM, prompts, params=GREEDY, **kwargs):
    try:
        return llm.generate(prompts, params, **kwargs)
    finally:
        llm.close()


@pytest.fixture(scope="module")
def uncached():
    """Outputs with no cache of any kind: the reference every cached run must equal."""
    llm = engine(enable_prefix_caching=False)
    return lambda prompts, params=GREEDY: [r.token_ids for r in llm.generate(prompts, params)]


def test_a_new_engine_fetches_the_stored_prefix_and_computes_only_the_rest(tmp_path, uncached):
    tokens = prompt(150)
    run(engine(tmp_path), [tokens])

    fresh = engine(tmp_path)
    result = run(fresh, [tokens])[0]
    stats = fresh.engine.stats()

    assert result.token_ids == uncached([tokens])[0]
    assert result.num_cached_tokens == 128  # 4 whole blocks of 32; the rest is computed
    assert stats.store.num_hit_tokens == 128
    assert stats.num_computed_tokens == 150 - 128 + GREEDY.max_tokens - 1
    # One fetch read the 4 blocks on a reader thread.
    assert stats.store.num_fetches == 1
    assert stats.store.fetch_bytes == 4 * fresh.engine.store.block_bytes
    assert stats.store.fetch_seconds >= 0.0


def test_decode_stores_the_blocks_it_completes_so_the_next_turn_hits_the_answer_too(tmp_path, uncached):
    turn1 = prompt(40)
    answer = run(engine(tmp_path), [turn1], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))[0]
    turn2 = turn1 + answer.token_ids + prompt(10, seed=1)

    result = run(engine(tmp_path), [turn2])[0]

    # 40 + 60 tokens computed in turn 1 are 3 whole blocks (96 tokens), answer included.
    assert result.num_cached_tokens == 96
    assert result.token_ids == uncached([turn2])[0]


def test_stored_blocks_say_whether_their_request_started_a_new_chain(tmp_path):
    first = prompt(70, seed=4)
    llm = engine(tmp_path)
    run(llm, [first])
    assert {e.depth: e.new_chain for e in llm.engine.store.store.index.entries()} == {0: True, 1: True}

    llm = engine(tmp_path)
    run(llm, [first + prompt(60, seed=5)])  # extends the stored 2 blocks: the new ones continue a chain
    written = {e.depth: e.new_chain for e in llm.engine.store.store.index.entries() if e.depth >= 2}
    assert written == {2: False, 3: False}


def test_a_corrupt_block_ends_the_hit_there_and_the_rest_is_recomputed(tmp_path, uncached):
    tokens = prompt(150, seed=2)
    run(engine(tmp_path), [tokens])
    store = open_store(tmp_path)
    files = sorted(tmp_path.rglob("*.blk"))
    assert len(files) == 5  # 161 tokens computed (prompt and output): 5 whole blocks
    by_depth = {store.index.get(bytes.fromhex(f.stem)).depth: f for f in files}
    data = bytearray(by_depth[2].read_bytes())
    data[-1] ^= 0xFF
    by_depth[2].write_bytes(bytes(data))

    result = run(engine(tmp_path), [tokens])[0]

    assert result.num_cached_tokens == 2 * BLOCK
    assert result.token_ids == uncached([tokens])[0]


def test_the_local_prefix_cache_and_the_store_combine(tmp_path, uncached):
    shared = prompt(200, seed=3)
    run(engine(tmp_path), [shared])  # the store holds 6 blocks (192 tokens) of `shared`
    llm = engine(tmp_path)
    try:
        llm.generate([shared[:70]], GREEDY)  # the local cache now holds 4 pages (64 tokens) of it
        result = llm.generate([shared], GREEDY)[0]
    finally:
        llm.close()
    assert result.num_cached_tokens == 192
    assert result.token_ids == uncached([shared])[0]


def test_namespaces_never_hit_each_other(tmp_path):
    tokens = prompt(150, seed=4)
    run(engine(tmp_path), [tokens], cache_namespace="tenant-a")

    other = run(engine(tmp_path), [tokens], cache_namespace="tenant-b")[0]
    same = run(engine(tmp_path), [tokens], cache_namespace="tenant-a")[0]

    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens == 128


def test_blocks_of_another_dtype_never_match(tmp_path):
    tokens = prompt(150, seed=5)
    run(engine(tmp_path), [tokens])
    assert run(engine(tmp_path, dtype="bfloat16"), [tokens])[0].num_cached_tokens == 0


def test_sampled_requests_and_many_at_once_fetch_and_match_the_uncached_outputs(tmp_path, uncached):
    prompts = [prompt(n, seed=10 + n) for n in (33, 64, 65, 97, 130, 161)]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)
    run(engine(tmp_path), prompts, seeded)

    results = run(engine(tmp_path, max_num_batched_tokens=40), prompts, seeded)

    assert [r.num_cached_tokens for r in results] == [32, 32, 64, 96, 128, 160]
    assert [r.token_ids for r in results] == uncached(prompts, seeded)


def test_a_block_size_that_is_not_a_multiple_of_the_page_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="multiple of page_size"):
        engine(tmp_path, kv_block_tokens=24)


SHORT = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)  # 152 tokens: 4 whole prompt blocks
HOUR = CacheHint(prefix_tokens=150, retain_s=3600)


def block_keys(store, tokens: list[int]) -> list[bytes]:
    """The store keys of a prompt's whole blocks, as an engine without a cache namespace names them."""
    return hash_chain(tokens, BLOCK, namespace_extra(store.kv_model_id))


@pytest.mark.parametrize(("hint_older", "survivor"), [(False, "newer"), (True, "older")], ids=["lru", "hinted"])
def test_a_hinted_prefix_survives_gc_pressure_that_evicts_an_unhinted_one(tmp_path, hint_older, survivor):
    prompts = {"older": prompt(150, seed=20), "newer": prompt(150, seed=21)}
    llm = engine(tmp_path)
    try:
        llm.generate([prompts["older"]], SHORT, cache_hints=[HOUR] if hint_older else [])
        llm.generate([prompts["newer"]], SHORT)
    finally:
        llm.close()
    store = llm.engine.store.store
    usage = store.index.usage()
    assert usage.num_blocks == 8

    # Over the high watermark; the low one leaves room for four of the eight blocks. Without a hint,
    # LRU evicts the older prompt's blocks.
    report = GarbageCollector(
        store.index,
        TTLPolicy(),
        "lru",
        capacity_bytes=usage.num_bytes,
        low_watermark=0.5,
        delete_data=store.files.delete,
    ).collect()

    victim = "older" if survivor == "newer" else "newer"
    kept, evicted = block_keys(llm.engine, prompts[survivor]), block_keys(llm.engine, prompts[victim])
    assert report.evicted == 4
    assert [store.index.get(key) is None for key in kept + evicted] == [False] * 4 + [True] * 4
    assert all(store.index.get(key).retain_until > time.time() + 3000 for key in kept) == hint_older
    again = run(engine(tmp_path), [prompts[survivor], prompts[victim]], SHORT)
    assert [result.num_cached_tokens for result in again] == [128, 0]


@pytest.mark.parametrize("device", ["cpu", CUDA])  # on CUDA, hinted blocks go through pinned staging buffers
def test_usage_counts_the_prompt_tokens_stored_under_each_hint_and_a_hit_renews_them(tmp_path, device):
    tokens = prompt(150, seed=22)
    hints = [CacheHint(prefix_tokens=70, retain_s=3600), CacheHint(prefix_tokens=150, retain_s=300)]

    first = run(engine(tmp_path, device=device), [tokens], SHORT, cache_hints=hints)[0]
    stored_until = {entry.depth: entry.retain_until for entry in open_store(tmp_path).index.entries()}
    reader = engine(tmp_path, device=device)
    before = time.time()
    second = run(reader, [tokens], SHORT, cache_hints=hints)[0]
    after = time.time()

    assert (first.num_cached_tokens, first.num_stored_tokens, first.stored_tokens_by_hint) == (0, 128, (64, 64))
    assert (second.num_cached_tokens, second.num_stored_tokens, second.stored_tokens_by_hint) == (128, 0, (0, 0))
    renewed = {entry.depth: entry.retain_until for entry in reader.engine.store.store.index.entries()}
    assert [renewed[depth] >= stored_until[depth] for depth in range(4)] == [True] * 4
    assert all(before + kept <= renewed[depth] <= after + kept for depth, kept in enumerate([3600, 3600, 300, 300]))


def test_an_unhinted_request_stores_its_prompt_and_reports_it(tmp_path):
    result = run(engine(tmp_path), [prompt(150, seed=23)], SHORT)[0]

    assert (result.num_stored_tokens, result.stored_tokens_by_hint) == (128, ())
    assert all(entry.retain_until == 0 for entry in open_store(tmp_path).index.entries())


def test_the_workers_caps_bound_what_hints_retain(tmp_path):
    tokens = prompt(150, seed=24)
    capped = engine(tmp_path, kv_store_max_retained_tokens=64, kv_store_max_retention_s=600)

    before = time.time()
    result = run(capped, [tokens], SHORT, cache_hints=[CacheHint(prefix_tokens=150, retain_s=86400)])[0]
    after = time.time()

    until = {entry.depth: entry.retain_until for entry in open_store(tmp_path).index.entries()}
    assert all(before + 600 <= until[depth] <= after + 600 for depth in (0, 1))
    assert [until[depth] for depth in (2, 3)] == [0.0, 0.0]
    assert (result.num_stored_tokens, result.stored_tokens_by_hint) == (128, (64,))


@pytest.mark.parametrize(
    ("hints", "message"),
    [
        ([CacheHint(prefix_tokens=151, retain_s=300)], "covers 1 to 150 tokens"),
        ([CacheHint(prefix_tokens=10, retain_s=float("inf"))], "positive number of seconds"),
        ([CacheHint(prefix_tokens=10, retain_s=300)] * 9, "at most 8 cache hints"),
    ],
    ids=["past-the-prompt", "forever", "too-many"],
)
def test_invalid_hints_are_refused_before_the_request_runs(tmp_path, hints, message):
    llm = engine(tmp_path)
    try:
        with pytest.raises(InvalidRequestError, match=message):
            llm.generate([prompt(150)], SHORT, cache_hints=hints)
        assert not llm.engine.has_unfinished()
    finally:
        llm.close()


def test_a_prompt_cache_key_scopes_hits_within_its_tenant_and_never_reaches_another(tmp_path):
    tokens = prompt(150, seed=25)
    run(engine(tmp_path), [tokens], SHORT, cache_namespace=scoped_namespace("tenant-a", "user-1"))

    def cached(namespace: str) -> int:
        return run(engine(tmp_path), [tokens], SHORT, cache_namespace=namespace)[0].num_cached_tokens

    assert cached(scoped_namespace("tenant-a", "user-1")) == 128
    assert cached(scoped_namespace("tenant-b", "user-1")) == 0
    assert cached(scoped_namespace("tenant-a", "user-2")) == 0
    assert cached("tenant-a") == 0


def test_hinted_blocks_are_queued_for_the_store_when_the_queue_is_too_long_for_others(tmp_path, monkeypatch):
    monkeypatch.setattr(store_connector, "MAX_PENDING_WRITES", 6)
    monkeypatch.setattr(store_connector, "UNHINTED_WRITES_MAX", 2)
    llm = engine(tmp_path)
    store = llm.engine.store.store
    # A disk that hangs on the first write, so the writer holds that block and the queue fills up.
    writing, disk_back = threading.Event(), threading.Event()
    write = store.write

    def slow_write(*args, **kwargs):
        writing.set()
        disk_back.wait()
        return write(*args, **kwargs)

    monkeypatch.setattr(store, "write", slow_write)
    unhinted, hinted = prompt(150, seed=26), prompt(150, seed=27)
    try:
        llm.generate([prompt(40, seed=28)], SHORT)
        assert writing.wait(timeout=30)
        llm.generate([unhinted], SHORT)  # 2 of its 4 blocks are queued
        llm.generate([hinted], SHORT, cache_hints=[HOUR])  # all 4 are
        disk_back.set()
    finally:
        disk_back.set()
        llm.close()

    assert llm.engine.store.stats().num_writes_dropped == 2
    assert [store.index.get(key) is not None for key in block_keys(llm.engine, unhinted)] == [True] * 2 + [False] * 2
    assert [store.index.get(key) is not None for key in block_keys(llm.engine, hinted)] == [True] * 4


def test_an_index_that_fails_a_write_costs_that_block_and_later_blocks_are_still_stored(tmp_path, monkeypatch):
    # given: an index that raises once, as a Redis index does when Redis goes away (not an OSError)
    llm = engine(tmp_path)
    store = llm.engine.store.store
    add = store.index.add
    failures = iter([RuntimeError("index unreachable")])

    def flaky_add(entries):
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return add(entries)

    monkeypatch.setattr(store.index, "add", flaky_add)
    first, second = prompt(70, seed=40), prompt(70, seed=41)
    # when: two requests store their blocks, the first write failing
    try:
        llm.generate([first], SHORT)
        llm.generate([second], SHORT)
    finally:
        llm.close()

    # then: the writer thread lived on and stored the second request's blocks
    assert [store.index.get(key) is not None for key in block_keys(llm.engine, second)] == [True, True]


def test_engines_share_the_index_served_by_the_store_gc_and_go_on_without_it(tmp_path, uncached):
    # given the index the store's GC process would serve, on an ipc endpoint (a thread here)
    runtime = Path(tempfile.mkdtemp(prefix="kvidx-"))  # ipc paths must be short
    endpoint = f"ipc://{runtime}/index"
    tokens = prompt(150, seed=7)
    served = DirectoryIndex()
    context = zmq.Context()
    stop = threading.Event()
    server = threading.Thread(target=IndexServer(served, endpoint, context).serve, args=(stop,))
    server.start()
    try:
        # when one engine stores a prompt's blocks through it and another asks it
        run(engine(tmp_path, kv_store_index=endpoint), [tokens])
        hit = run(engine(tmp_path, kv_store_index=endpoint), [tokens])[0]
    finally:
        stop.set()
        server.join()
        context.destroy(linger=0)

    # then the second hits what the first stored, and the served index knows every block written
    assert hit.num_cached_tokens == 128 and hit.token_ids == uncached([tokens])[0]
    assert served.usage().num_blocks == 5

    # when the server is gone, an engine using it still serves, computing everything (no hit, no crash)
    alone = engine(tmp_path, kv_store_index=endpoint)
    missed = run(alone, [tokens])[0]
    shutil.rmtree(runtime)
    assert missed.num_cached_tokens == 0 and missed.token_ids == uncached([tokens])[0]
    assert alone.engine.store.index_failing
