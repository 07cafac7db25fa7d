import numpy as np
import pytest

from workers.kvstore.block_hash import ROOT_HASH, hash_block, hash_chain, namespace_extra, scoped_namespace


def test_chain_equals_block_by_block_hashing():
    tokens = list(range(1000, 1000 + 5 * 16 + 7))
    chain = hash_chain(tokens, 16, b"extra")
    parent = ROOT_HASH
    expected = []
    for i in range(5):
        parent = hash_block(parent, tokens[i * 16 : (i + 1) * 16], b"extra")
        expected.append(parent)
    assert chain == expected
    assert len(chain) == 5  # the 7-token tail has no key


def test_key_names_the_whole_prefix():
    a = hash_chain([1] * 16 + [2] * 16, 16)
    b = hash_chain([3] * 16 + [2] * 16, 16)
    assert a[1] != b[1]  # same second block, different first block


def test_extra_separates_namespaces_in_every_block():
    tokens = list(range(64))
    tenant_a = hash_chain(tokens, 16, namespace_extra("m", "a"))
    tenant_b = hash_chain(tokens, 16, namespace_extra("m", "b"))
    assert not set(tenant_a) & set(tenant_b)


def test_extra_is_length_prefixed():
    # Without the length prefix these two would hash the same bytes.
    assert hash_block(ROOT_HASH, [1], b"\x02\x00\x00\x00") != hash_block(ROOT_HASH, [1, 2], b"")


def test_max_blocks_and_numpy_input():
    tokens = np.arange(100, dtype=np.int64)
    assert hash_chain(tokens, 10, max_blocks=3) == hash_chain(list(range(100)), 10)[:3]


def test_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        hash_chain([1, 2], 0)


def test_a_prompt_cache_key_narrows_a_namespace_and_no_key_leaves_it() -> None:
    assert scoped_namespace("tenant-a", None) == scoped_namespace("tenant-a", "") == "tenant-a"
    keyed = scoped_namespace("tenant-a", "user-1")
    assert keyed == scoped_namespace("tenant-a", "user-1")
    assert len({keyed, scoped_namespace("tenant-a", "user-2"), scoped_namespace("tenant-b", "user-1")}) == 3
    # A key that spells another namespace stays inside its own tenant's.
    assert scoped_namespace("tenant-a", "tenant-b").startswith("tenant-a\x00")
