"""One suite for every BlockIndex backend: MemoryIndex in process, RedisIndex on the real Redis, the
GC process's DirectoryIndex, and a RemoteIndex talking to an IndexServer over a real ipc socket."""

import multiprocessing
import shutil
import tempfile
import threading
from collections.abc import Iterator
from hashlib import blake2b

import pytest
import redis
import zmq

from tests.workers.kvstore.conftest import REDIS_URL
from workers.kvstore.directory_index import DirectoryIndex
from workers.kvstore.index import REMEMBERED_PER_BLOCK, BlockEntry, BlockIndex, IndexUsage
from workers.kvstore.index_server import IndexServer
from workers.kvstore.memory_index import MemoryIndex
from workers.kvstore.redis_index import RedisIndex
from workers.kvstore.remote_index import RemoteIndex


def key(i: int) -> bytes:
    """Realistic keys: 16 random-looking bytes, glob characters included."""
    return blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def entry(
    i: int,
    *,
    cls: str = "chat",
    last: float = 100.0,
    created: float = 50.0,
    hits: int = 0,
    retain: float = 0.0,
    new_chain: bool = False,
    before: int = 0,
) -> BlockEntry:
    return BlockEntry(
        key=key(i),
        size=1000 + i,
        traffic_class=cls,
        depth=i,
        created_at=created,
        last_access=last,
        hit_count=hits,
        retain_until=retain,
        new_chain=new_chain,
        uses_before=before,
    )


def assert_counters_match_entries(index: BlockIndex) -> None:
    entries = list(index.entries())
    assert len({e.key for e in entries}) == len(entries)
    assert index.usage() == IndexUsage(num_blocks=len(entries), num_bytes=sum(e.size for e in entries))
    assert index.traffic_classes() == {e.traffic_class for e in entries}
    for cls in index.traffic_classes():
        by_class = index.expired(cls, float("inf"), len(entries) + 1)
        assert sorted(e.key for e in by_class) == sorted(e.key for e in entries if e.traffic_class == cls)


@pytest.fixture
def served_index() -> Iterator[RemoteIndex]:
    """A RemoteIndex of a MemoryIndex that an IndexServer serves from a thread (ipc paths must be short)."""
    directory = tempfile.mkdtemp(prefix="kvidx-")
    context = zmq.Context()
    stop = threading.Event()
    server = IndexServer(MemoryIndex(), f"ipc://{directory}/index", context)
    thread = threading.Thread(target=server.serve, args=(stop,))
    thread.start()
    yield RemoteIndex(server.endpoint, context=context)
    stop.set()
    thread.join()
    context.destroy(linger=0)
    shutil.rmtree(directory)


@pytest.fixture(params=["memory", "redis", "directory", "served"])
def index(request: pytest.FixtureRequest) -> BlockIndex:
    if request.param == "memory":
        return MemoryIndex()
    if request.param == "directory":
        return DirectoryIndex()
    if request.param == "served":
        return request.getfixturevalue("served_index")
    return RedisIndex(redis.Redis.from_url(REDIS_URL), request.getfixturevalue("redis_prefix"))


def test_empty(index: BlockIndex) -> None:
    assert index.usage() == IndexUsage(num_blocks=0, num_bytes=0)
    assert index.traffic_classes() == set()
    assert list(index.entries()) == []
    assert index.get(key(0)) is None
    assert index.match_prefix([]) == 0
    assert index.expired("chat", float("inf"), 10) == []
    assert index.remove([key(0)]) == []
    index.touch([key(0)], 1.0)


def test_add_if_absent_keeps_counters_exact(index: BlockIndex) -> None:
    assert index.add([entry(1), entry(2), entry(3)]) == 3
    assert index.usage() == IndexUsage(num_blocks=3, num_bytes=1001 + 1002 + 1003)

    # A present key keeps its entry, even if the new one differs; duplicates in one call count once.
    changed = BlockEntry(key=key(1), size=9999, traffic_class="agent", depth=0, created_at=0.0, last_access=0.0)
    assert index.add([changed, entry(4), entry(4)]) == 1
    assert index.get(key(1)) == entry(1)
    assert index.usage() == IndexUsage(num_blocks=4, num_bytes=1001 + 1002 + 1003 + 1004)
    assert index.traffic_classes() == {"chat"}


def test_get_round_trips_every_field(index: BlockIndex) -> None:
    stored = entry(7, cls="agent", last=1_700_000_000.123456, created=1_699_999_999.000001, hits=3, new_chain=True)
    stored_before = entry(8, before=5)
    index.add([stored, stored_before])
    assert index.get(key(7)) == stored
    assert index.get(key(8)) == stored_before
    assert index.get(key(9)) is None
    assert {e.key: e for e in index.entries()} == {key(7): stored, key(8): stored_before}
    assert index.remove([key(7)]) == [stored]


def test_match_prefix_stops_at_the_first_gap(index: BlockIndex) -> None:
    chain = [key(i) for i in range(10)]
    index.add([entry(i) for i in range(10) if i != 6])
    assert index.match_prefix(chain) == 6
    assert index.match_prefix(chain[:6]) == 6
    assert index.match_prefix(chain[6:]) == 0
    assert index.match_prefix(chain[7:]) == 3


def test_match_prefix_of_a_long_chain(index: BlockIndex) -> None:
    index.add([entry(i) for i in range(1000)])
    chain = [key(i) for i in range(1000)]
    assert index.match_prefix(chain) == 1000
    assert index.match_prefix(chain + [key(5000)] + chain) == 1000


def test_touch_counts_hits_and_keeps_the_latest_access(index: BlockIndex) -> None:
    index.add([entry(1, last=100.0), entry(2, last=200.0), entry(3, last=300.0)])

    index.touch([key(1), key(999)], now=400.5)
    assert index.get(key(1)) == entry(1, last=400.5, hits=1)
    index.touch([key(1)], now=250.0)  # an older clock never moves last access back
    assert index.get(key(1)) == entry(1, last=400.5, hits=2)
    assert index.get(key(2)) == entry(2, last=200.0)

    assert [e.key for e in index.expired("chat", float("inf"), 10)] == [key(2), key(3), key(1)]
    assert [e.key for e in index.expired("chat", 350.0, 10)] == [key(2), key(3)]


def test_remove_returns_removed_entries_and_keeps_counters_exact(index: BlockIndex) -> None:
    index.add([entry(1), entry(2), entry(3, cls="agent")])
    index.touch([key(2)], now=500.0)

    removed = index.remove([key(2), key(999), key(2), key(3)])
    assert removed == [entry(2, last=500.0, hits=1), entry(3, cls="agent")]
    assert index.get(key(2)) is None
    assert index.match_prefix([key(1), key(2)]) == 1
    assert index.usage() == IndexUsage(num_blocks=1, num_bytes=1001)
    assert index.traffic_classes() == {"chat"}
    assert index.expired("agent", float("inf"), 10) == []
    assert [e.key for e in index.expired("chat", float("inf"), 10)] == [key(1)]


def test_an_evicted_block_written_again_gets_its_uses_back(index: BlockIndex) -> None:
    index.add([entry(1, new_chain=True), entry(2), entry(3, before=2)])
    index.touch([key(1), key(3)], now=200.0)
    index.touch([key(1)], now=300.0)

    assert index.remove([key(1), key(3)], remember=True) == [
        entry(1, last=300.0, hits=2, new_chain=True),
        entry(3, last=200.0, hits=1, before=2),
    ]
    # Remembered blocks are gone: no match, no usage, no entry.
    assert index.match_prefix([key(1)]) == 0
    assert index.contains_many([key(1), key(2), key(3)]) == [False, True, False]
    assert index.usage() == IndexUsage(num_blocks=1, num_bytes=1002)
    assert_counters_match_entries(index)

    # Written again: each gets the uses of its last stay (write + hits + earlier stays) and a fresh entry.
    assert index.add([entry(1, last=400.0), entry(3, last=400.0, before=1)]) == 2
    assert index.get(key(1)) == entry(1, last=400.0, before=3)
    assert index.get(key(3)) == entry(3, last=400.0, before=1 + 4)
    # Once restored, forgotten: a second eviction without `remember` leaves nothing to restore.
    index.remove([key(1)])
    index.add([entry(1, last=500.0)])
    assert index.get(key(1)) == entry(1, last=500.0)


def test_a_plain_remove_remembers_nothing(index: BlockIndex) -> None:
    index.add([entry(1), entry(2)])
    index.touch([key(1)], now=200.0)
    index.remove([key(1)])
    index.add([entry(1)])
    assert index.get(key(1)) == entry(1)


def test_the_oldest_remembered_evictions_are_forgotten_beyond_the_cap(index: BlockIndex) -> None:
    held = 2
    evicted = REMEMBERED_PER_BLOCK * held + 3
    index.add([entry(i) for i in range(evicted + held)])
    for i in range(evicted):  # one at a time: eviction order is remove order
        index.remove([key(i)], remember=True)

    index.add([entry(i) for i in range(evicted)])
    restored = [i for i in range(evicted) if index.get(key(i)).uses_before == 1]
    assert restored == list(range(3, evicted))
    assert_counters_match_entries(index)


def test_expired_per_class_with_cutoff_and_limit(index: BlockIndex) -> None:
    index.add([entry(i, last=10.0 * i) for i in range(1, 5)] + [entry(10, cls="agent", last=15.0)])

    assert [e.key for e in index.expired("chat", 30.0, 10)] == [key(1), key(2), key(3)]  # cutoff inclusive
    assert [e.key for e in index.expired("chat", 30.0, 2)] == [key(1), key(2)]
    assert index.expired("chat", 30.0, 0) == []
    assert index.expired("chat", 5.0, 10) == []
    assert index.expired("agent", 100.0, 10) == [entry(10, cls="agent", last=15.0)]
    assert index.expired("batch", 100.0, 10) == []


def test_retain_until_is_stored_and_only_ever_extended(index: BlockIndex) -> None:
    index.add([entry(1, retain=1_700_000_300.25), entry(2)])
    assert index.get(key(1)) == entry(1, retain=1_700_000_300.25)

    index.retain([key(1), key(2), key(999)], 1_700_003_600.5)
    assert index.get(key(1)) == entry(1, retain=1_700_003_600.5)
    assert index.get(key(2)) == entry(2, retain=1_700_003_600.5)
    index.retain([key(1)], 1_700_000_000.0)  # a shorter hint never shortens a longer one
    assert index.get(key(1)) == entry(1, retain=1_700_003_600.5)
    index.touch([key(1)], now=500.0)  # a plain hit leaves the retention as it is
    assert index.get(key(1)) == entry(1, last=500.0, hits=1, retain=1_700_003_600.5)
    assert index.remove([key(1)]) == [entry(1, last=500.0, hits=1, retain=1_700_003_600.5)]
    assert_counters_match_entries(index)


def test_expired_leaves_out_entries_retained_past_now(index: BlockIndex) -> None:
    # The five oldest are retained: more than one page of the limit, so the expired ones behind them
    # are still found.
    index.add([entry(i, last=float(i), retain=1000.0) for i in range(5)])
    index.add([entry(i, last=float(i), retain=10.0 if i == 6 else 0.0) for i in range(5, 9)])

    assert [e.key for e in index.expired("chat", 100.0, 2, now=500.0)] == [key(5), key(6)]
    assert [e.key for e in index.expired("chat", 100.0, 10, now=500.0)] == [key(5), key(6), key(7), key(8)]
    assert [e.key for e in index.expired("chat", 7.0, 10, now=5.0)] == [key(5), key(7)]
    assert len(index.expired("chat", 100.0, 10, now=1000.0)) == 9  # a retention that ended
    assert len(index.expired("chat", 100.0, 100)) == 9  # without a clock, none is left out


def test_entries_and_usage_and_traffic_classes(index: BlockIndex) -> None:
    added = [entry(i, cls=("chat", "agent", "batch")[i % 3]) for i in range(30)]
    index.add(added)
    index.touch([key(4)], now=999.0)
    expected = {e.key: e for e in added} | {key(4): entry(4, cls="agent", last=999.0, hits=1)}

    assert {e.key: e for e in index.entries()} == expected
    assert index.usage() == IndexUsage(num_blocks=30, num_bytes=sum(1000 + i for i in range(30)))
    assert index.traffic_classes() == {"chat", "agent", "batch"}
    index.remove([e.key for e in added if e.traffic_class == "batch"])
    assert index.traffic_classes() == {"chat", "agent"}
    assert_counters_match_entries(index)


def test_concurrent_adds_from_threads_keep_counters_exact(index: BlockIndex) -> None:
    num_threads, stride, span = 8, 50, 200  # thread t adds keys [t*50, t*50+200): heavy overlap
    barrier = threading.Barrier(num_threads)
    added = [0] * num_threads

    def add_range(t: int) -> None:
        barrier.wait()
        for start in range(t * stride, t * stride + span, 10):
            added[t] += index.add([entry(i) for i in range(start, start + 10)])

    threads = [threading.Thread(target=add_range, args=(t,)) for t in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    unique = (num_threads - 1) * stride + span
    assert sum(added) == unique
    assert index.usage() == IndexUsage(num_blocks=unique, num_bytes=sum(1000 + i for i in range(unique)))
    assert_counters_match_entries(index)


def test_redis_entries_written_before_the_newer_fields_read_with_their_defaults(redis_prefix: str) -> None:
    client = redis.Redis.from_url(REDIS_URL)
    index = RedisIndex(client, redis_prefix)
    index.add([entry(1, retain=900.0, new_chain=True, before=2), entry(2)])  # 2 stays: room to remember 1
    client.hdel(f"{redis_prefix}:e:".encode() + key(1), "retain", "newchain", "before")
    assert index.get(key(1)) == entry(1)
    assert index.remove([key(1)], remember=True) == [entry(1)]
    index.add([entry(1)])
    assert index.get(key(1)) == entry(1, before=1)


def test_two_redis_clients_see_each_others_writes(redis_prefix: str) -> None:
    a = RedisIndex(redis.Redis.from_url(REDIS_URL), redis_prefix)
    b = RedisIndex(redis.Redis.from_url(REDIS_URL), redis_prefix)

    a.add([entry(1), entry(2)])
    assert b.match_prefix([key(1), key(2)]) == 2
    assert b.add([entry(2), entry(3)]) == 1
    b.touch([key(1)], now=700.0)
    assert a.get(key(1)) == entry(1, last=700.0, hits=1)
    assert a.remove([key(3)]) == [entry(3)]
    assert b.usage() == IndexUsage(num_blocks=2, num_bytes=1001 + 1002)
    assert {e.key for e in b.entries()} == {key(1), key(2)}


def add_range(prefix: str, worker: int) -> int:
    """One process's share: add keys [40w, 40w + 160) in small batches, overlapping its neighbours."""
    index = RedisIndex(redis.Redis.from_url(REDIS_URL), prefix)
    return sum(
        index.add([entry(i, cls=("chat", "agent")[i % 2]) for i in range(start, start + 8)])
        for start in range(worker * 40, worker * 40 + 160, 8)
    )


def remove_range(prefix: str, worker: int) -> int:
    """One process's share: remove the same overlapping range, touching what is still there."""
    index = RedisIndex(redis.Redis.from_url(REDIS_URL), prefix)
    removed = 0
    for start in range(worker * 40, worker * 40 + 160, 8):
        index.touch([key(start + 4)], now=float(start))
        removed += len(index.remove([key(i) for i in range(start, start + 8)]))
    return removed


def test_concurrent_adds_and_removes_from_processes_keep_counters_exact(redis_prefix: str) -> None:
    index = RedisIndex(redis.Redis.from_url(REDIS_URL), redis_prefix)
    unique = 3 * 40 + 160
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        assert sum(pool.starmap(add_range, [(redis_prefix, w) for w in range(4)])) == unique
        assert index.usage() == IndexUsage(num_blocks=unique, num_bytes=sum(1000 + i for i in range(unique)))
        assert_counters_match_entries(index)

        assert sum(pool.starmap(remove_range, [(redis_prefix, w) for w in range(4)])) == unique
    assert index.usage() == IndexUsage(num_blocks=0, num_bytes=0)
    assert index.traffic_classes() == set()
