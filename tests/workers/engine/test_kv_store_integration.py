"""The engine with the global KV store: prompts fetch their stored prefix instead of recomputing it,
and the blocks an engine completes (prompt and output) are stored for the next engine that asks.

Tiny random-weight models; each "restart" is a new engine on the same store directory, so nothing
can come from the engine-local prefix cache.
"""

import random

import pytest

from tests.workers.engine.hf_reference import TINY_CONFIGS
from workers.engine import LLM, SamplingParams
from workers.kvstore.store import open_store

CONFIG = TINY_CONFIGS["qwen3_qknorm_layer_types"]  # windowed and full layers, q/k norm
BLOCK = 32  # store block: two engine pages of 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128) for _ in range(length)]


def engine(store_dir=None, **overrides) -> LLM:
    options = {"seed": 0, "kv_cache_bytes": 1 << 24, "kv_block_tokens": BLOCK, **overrides}
    return LLM(CONFIG, kv_store=store_dir, **options)


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
