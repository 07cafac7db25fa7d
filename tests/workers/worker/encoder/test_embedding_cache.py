"""The embedding cache: by content hash, bounded in bytes, the least recently used evicted first."""

import pytest

from workers.worker.encoder.embedding_cache import EmbeddingCache, Embeddings


def embeddings(num_bytes: int, fill: bytes = b"x") -> Embeddings:
    return Embeddings(data=fill * num_bytes, dtype="float32", shape=(num_bytes // 4, 1))


def test_lookups_count_hits_and_misses():
    cache = EmbeddingCache(100)
    cache.put(b"a", embeddings(40))

    assert cache.get(b"a") == embeddings(40)
    assert cache.get(b"b") is None
    assert (cache.hits, cache.misses, cache.num_bytes) == (1, 1, 40)


def test_the_least_recently_used_goes_first_until_the_new_entry_fits():
    cache = EmbeddingCache(100)
    for key in (b"a", b"b", b"c"):
        cache.put(key, embeddings(32))
    cache.get(b"a")  # b is now the least recently used

    cache.put(b"d", embeddings(32))

    assert cache.get(b"b") is None
    assert all(cache.get(key) is not None for key in (b"a", b"c", b"d"))
    assert cache.num_bytes == 96

    cache.put(b"e", embeddings(68))  # evicts a and c (the least recently used), keeps d

    assert [cache.get(key) is not None for key in (b"a", b"c", b"d", b"e")] == [False, False, True, True]
    assert cache.num_bytes == 100


def test_an_entry_larger_than_the_cache_is_not_kept_and_a_zero_cache_keeps_nothing():
    cache = EmbeddingCache(100)
    cache.put(b"a", embeddings(40))
    cache.put(b"big", embeddings(101))
    assert cache.get(b"big") is None and cache.get(b"a") is not None

    empty = EmbeddingCache(0)
    empty.put(b"a", embeddings(4))
    assert empty.get(b"a") is None and empty.num_bytes == 0


def test_putting_a_key_again_replaces_its_bytes():
    cache = EmbeddingCache(100)
    cache.put(b"a", embeddings(40))
    cache.put(b"a", embeddings(60, b"y"))

    assert cache.num_bytes == 60 and len(cache) == 1
    assert cache.get(b"a").data == b"y" * 60


def test_a_negative_capacity_is_refused():
    with pytest.raises(ValueError, match="capacity_bytes must be >= 0"):
        EmbeddingCache(-1)
