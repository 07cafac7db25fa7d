"""The SWA state cache: windows made of shared per-block runs, LRU by bytes with the evicted keys
reported, and runs of another layout refused."""

import pytest
import torch

from workers.engine.kv.spec import KVCacheSpec, KVKind
from workers.engine.kv.swa_state import SwaStateCache, SwaStateError
from workers.kvstore.block_hash import hash_chain
from workers.kvstore.swa_window import window_blocks, window_keys

BLOCK = 4


def swa_spec(window: int = 9, dtype: torch.dtype = torch.float32) -> KVCacheSpec:
    return KVCacheSpec(
        kind=KVKind.SLIDING_WINDOW, layers=(1, 3), dtype=dtype, page_size=4, num_kv_heads=2, head_dim=8, window=window
    )


def run(seed: int, spec: KVCacheSpec | None = None) -> torch.Tensor:
    spec = spec or swa_spec()
    return torch.randn(spec.run_shape(BLOCK), generator=torch.Generator().manual_seed(seed)).to(spec.dtype)


KEYS = hash_chain(list(range(40)), BLOCK, b"model")


def test_a_window_holds_the_blocks_of_the_w_minus_1_tokens_before_the_prefix_end() -> None:
    assert [window_blocks(w, BLOCK) for w in (1, 2, 4, 5, 8, 9, 10)] == [0, 1, 1, 1, 2, 2, 3]
    assert window_keys(KEYS[:6], 9, BLOCK) == KEYS[4:6]
    assert window_keys(KEYS[:1], 9, BLOCK) == KEYS[:1]  # a prefix shorter than the window: all of it
    assert window_keys(KEYS[:6], 1, BLOCK) == []


def test_consecutive_prefix_ends_share_their_blocks() -> None:
    cache = SwaStateCache(swa_spec(window=9), BLOCK, capacity_bytes=1 << 20)
    runs = [run(i) for i in range(4)]
    for key, r in zip(KEYS, runs):
        assert cache.put(key, r)
    assert len(cache) == 4 and cache.num_bytes == 4 * cache.run_bytes
    for end in (2, 3, 4):  # each end's window is the two blocks before it
        window = cache.window(KEYS[:end])
        assert window is not None and len(window) == 2
        assert all(torch.equal(got, r) for got, r in zip(window, runs[end - 2 : end]))
    assert (cache.num_hits, cache.num_misses, cache.num_puts) == (3, 0, 4)


def test_a_window_with_any_block_missing_is_none() -> None:
    cache = SwaStateCache(swa_spec(window=9), BLOCK, capacity_bytes=1 << 20)
    cache.put(KEYS[0], run(0))
    cache.put(KEYS[2], run(2))
    assert cache.window(KEYS[:3]) is None  # KEYS[1] is missing
    assert cache.window(KEYS[:5]) is None
    assert cache.window(KEYS[:1]) is not None
    assert (cache.num_hits, cache.num_misses) == (1, 2)
    assert cache.get([KEYS[1], KEYS[2]])[0] is None


def test_capacity_evicts_the_least_recently_used_and_reports_the_keys() -> None:
    evicted: list[bytes] = []
    spec = swa_spec(window=5)
    one = SwaStateCache(spec, BLOCK, 0).run_bytes
    cache = SwaStateCache(spec, BLOCK, capacity_bytes=3 * one, on_evict=evicted.extend)
    for i in range(3):
        cache.put(KEYS[i], run(i))
    assert cache.window(KEYS[:1]) is not None  # KEYS[0] used: KEYS[1] is now the oldest
    cache.put(KEYS[3], run(3))
    assert evicted == [KEYS[1]]
    cache.put(KEYS[2], run(2))  # held already: a use, no second copy
    cache.put(KEYS[4], run(4))
    assert evicted == [KEYS[1], KEYS[0]]
    assert [key in cache for key in KEYS[:5]] == [False, False, True, True, True]
    assert cache.num_bytes == 3 * one and cache.num_evictions == 2


def test_a_fetch_from_another_worker_counts_as_a_use() -> None:
    evicted: list[bytes] = []
    spec = swa_spec(window=5)
    cache = SwaStateCache(
        spec, BLOCK, capacity_bytes=2 * SwaStateCache(spec, BLOCK, 0).run_bytes, on_evict=evicted.extend
    )
    cache.put(KEYS[0], run(0))
    cache.put(KEYS[1], run(1))
    assert [r is not None for r in cache.get([KEYS[0], KEYS[5]])] == [True, False]
    cache.put(KEYS[2], run(2))
    assert evicted == [KEYS[1]]
    assert (cache.num_hits, cache.num_misses) == (0, 0)  # windows only


def test_a_capacity_under_one_run_keeps_nothing() -> None:
    cache = SwaStateCache(swa_spec(), BLOCK, capacity_bytes=10)
    assert not cache.put(KEYS[0], run(0))
    assert len(cache) == 0


def test_a_view_into_a_bigger_buffer_is_kept_as_a_copy_of_its_own() -> None:
    cache = SwaStateCache(swa_spec(), BLOCK, capacity_bytes=1 << 20)
    big = torch.randn((3, *cache.run_shape))
    cache.put(KEYS[0], big[1])
    kept = cache.get([KEYS[0]])[0]
    assert torch.equal(kept, big[1])
    assert kept.untyped_storage().nbytes() == cache.run_bytes
    big[1].zero_()
    assert not torch.equal(kept, big[1])


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (torch.zeros(2, 2, 2, BLOCK + 1, 8), "got [2, 2, 2, 5, 8]"),
        (torch.zeros(2, 2, 2, BLOCK, 8, dtype=torch.bfloat16), "got torch.bfloat16"),
        ([[0.0]], "got list"),
    ],
)
def test_a_run_of_another_layout_is_refused(bad, says: str) -> None:
    cache = SwaStateCache(swa_spec(), BLOCK, capacity_bytes=1 << 20)
    with pytest.raises(SwaStateError, match=f".*{says.replace('[', '.').replace(']', '.')}"):
        cache.put(KEYS[0], bad)
    assert len(cache) == 0


def test_only_a_sliding_window_group_has_swa_state() -> None:
    full = KVCacheSpec(kind=KVKind.FULL, layers=(0,), dtype=torch.float32, page_size=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="full attention"):
        SwaStateCache(full, BLOCK, 1 << 20)
