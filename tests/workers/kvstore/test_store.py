"""The store façade: index URLs, rebuilding the in-process index from disk, idempotent writes."""

import itertools
from hashlib import blake2b
from pathlib import Path

import msgspec
import pytest

from workers.kvstore.block_files import BlockFiles, BlockMeta
from workers.kvstore.memory_index import MemoryIndex
from workers.kvstore.redis_index import RedisIndex
from workers.kvstore.store import KVStore, open_index, open_store


def key(i: int) -> bytes:
    return blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def test_open_index_memory() -> None:
    assert isinstance(open_index("memory"), MemoryIndex)


def test_open_index_redis_url() -> None:
    index = open_index("redis://127.0.0.1:6379/3?prefix=test:kv&socket_timeout=2.5")
    assert isinstance(index, RedisIndex)
    assert index.prefix == "test:kv"
    kwargs = index.client.connection_pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["db"], kwargs["socket_timeout"]) == ("127.0.0.1", 6379, 3, 2.5)
    assert open_index("redis://127.0.0.1:6379/0").prefix == "sluice:kv"


@pytest.mark.parametrize("url", ["", "Memory", "memory://", "postgres://127.0.0.1/kv", "127.0.0.1:6379"])
def test_open_index_rejects_unknown_urls(url: str) -> None:
    with pytest.raises(ValueError, match="expected 'memory', 'redis://.* or 'ipc://"):
        open_index(url)


def test_open_index_rejects_an_empty_prefix() -> None:
    with pytest.raises(ValueError, match="empty prefix"):
        open_index("redis://127.0.0.1:6379/0?prefix=")


def test_write_is_idempotent(tmp_path: Path) -> None:
    store = open_store(tmp_path / "a" / "b")
    assert store.write(key(1), b"x" * 1000, depth=0, traffic_class="chat")
    size = store.files.path(key(1)).stat().st_size
    assert not store.write(key(1), b"x" * 1000, depth=0, traffic_class="chat")
    assert store.index.usage().num_blocks == 1
    assert store.index.get(key(1)).size == size
    assert store.contains(key(1)) and not store.contains(key(2))


def test_write_indexes_an_orphan_file(tmp_path: Path) -> None:
    """A writer that died between file and index left the file: the next write only indexes it."""
    files = BlockFiles(tmp_path)
    size = files.write(key(1), b"x" * 1000, BlockMeta(traffic_class="chat", depth=0, created_at=1.0))
    store = KVStore(files, MemoryIndex())
    assert store.write(key(1), b"x" * 1000, depth=0, traffic_class="chat")
    assert store.index.get(key(1)).size == size
    assert store.read([key(1)]) == [b"x" * 1000]


def test_open_store_rebuilds_the_memory_index_after_a_restart(tmp_path: Path) -> None:
    clock = itertools.count(1000.0, 10.0).__next__
    before = KVStore(BlockFiles(tmp_path), MemoryIndex(), clock=clock)
    for i in range(4):
        before.write(key(i), bytes([i]) * (100 + i), depth=i, traffic_class=("chat", "agent")[i % 2])
    for i in (2, 0, 3, 1):  # last access order differs from write order
        assert before.read([key(i)]) == [bytes([i]) * (100 + i)]
    (tmp_path / "ab" / "cd").mkdir(parents=True, exist_ok=True)
    (tmp_path / "ab" / "cd" / ".leftover.1.ffff.tmp").write_bytes(b"partial")

    after = open_store(tmp_path)

    def without_hits(store: KVStore) -> dict[bytes, object]:
        return {e.key: msgspec.structs.replace(e, hit_count=0) for e in store.index.entries()}

    assert without_hits(after) == without_hits(before)
    assert after.index.usage() == before.index.usage()
    assert [e.key for e in after.index.expired("chat", float("inf"), 10)] == [key(2), key(0)]
    assert [e.key for e in after.index.expired("agent", float("inf"), 10)] == [key(3), key(1)]
    assert after.match([key(0), key(1), key(2), key(3)]) == 4
    assert after.files.recover(older_than_s=0) == 1  # young temp files survive open_store's recover


def test_a_later_hint_extends_the_retention_of_a_block_already_stored(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    assert store.write(key(1), b"x" * 100, depth=0, traffic_class="chat", retain_until=500.0)
    assert not store.write(key(1), b"x" * 100, depth=0, traffic_class="chat", retain_until=900.0)
    assert store.index.get(key(1)).retain_until == 900.0
    assert not store.write(key(1), b"x" * 100, depth=0, traffic_class="chat")  # no hint: unchanged
    store.retain([key(1), key(2)], 700.0)
    assert store.index.get(key(1)).retain_until == 900.0


def test_the_hint_a_block_was_written_under_outlives_the_in_process_index(tmp_path: Path) -> None:
    writer = open_store(tmp_path)
    writer.write(key(1), b"x" * 100, depth=0, traffic_class="chat", retain_until=500.0)
    writer.write(key(2), b"y" * 100, depth=1, traffic_class="chat")
    # Another process's index, which finds the blocks in the directory.
    other = KVStore(BlockFiles(tmp_path), MemoryIndex(), fall_back_to_files=True)

    rebuilt = open_store(tmp_path)
    other.match([key(1), key(2)])

    assert [rebuilt.index.get(k).retain_until for k in (key(1), key(2))] == [500.0, 0.0]
    assert [other.index.get(k).retain_until for k in (key(1), key(2))] == [500.0, 0.0]


def test_write_records_whether_the_block_starts_a_new_chain(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    assert store.write(key(1), b"x" * 100, depth=0, traffic_class="chat", new_chain=True)
    assert store.write(key(2), b"y" * 100, depth=1, traffic_class="chat")
    assert store.index.get(key(1)).new_chain
    assert not store.index.get(key(2)).new_chain
    assert not store.write(key(1), b"x" * 100, depth=0, traffic_class="chat")  # held: the entry stays as it was
    assert store.index.get(key(1)).new_chain


def test_a_read_stops_at_a_block_of_another_layout_which_stays_stored(tmp_path: Path, caplog) -> None:
    store = open_store(tmp_path)
    for depth in range(3):
        layout = "B" if depth == 1 else "A"
        store.write(key(depth), bytes([depth]) * 100, depth=depth, traffic_class="chat", layout=layout)
    assert store.files.stat(key(1))[0].layout == "B"

    assert store.read([key(0), key(1), key(2)], layout="A") == [b"\x00" * 100]
    assert f"KV block {key(1).hex()} holds B; the reader's KV is A: recomputing from there" in caplog.text
    assert store.match([key(0), key(1), key(2)]) == 3  # still indexed, for readers of its layout
    assert store.read([key(1)], layout="B") == [b"\x01" * 100]
