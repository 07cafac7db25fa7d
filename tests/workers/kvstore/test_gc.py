import threading

import pytest

from workers.kvstore.eviction import LRUPolicy
from workers.kvstore.gc import GarbageCollector, GCReport
from workers.kvstore.index import BlockEntry, IndexUsage
from workers.kvstore.memory_index import MemoryIndex
from workers.kvstore.ttl import DAY_S, TTLPolicy


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class DeletedKeys:
    """The delete_data callback: records each call's keys."""

    def __init__(self) -> None:
        self.calls: list[list[bytes]] = []

    def __call__(self, keys: list[bytes]) -> None:
        self.calls.append(list(keys))

    @property
    def keys(self) -> set[bytes]:
        return {key for call in self.calls for key in call}


def key(name: str) -> bytes:
    return name.encode().ljust(16, b"\0")


def block(name: str, *, at: float, traffic_class: str = "chat", depth: int = 0, size: int = 10) -> BlockEntry:
    return BlockEntry(key=key(name), size=size, traffic_class=traffic_class, depth=depth, created_at=at, last_access=at)


@pytest.fixture
def index() -> MemoryIndex:
    return MemoryIndex()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def deleted() -> DeletedKeys:
    return DeletedKeys()


def make_gc(index, clock, deleted, *, ttl=None, policy="lru", capacity_bytes=1_000_000, **kwargs) -> GarbageCollector:
    return GarbageCollector(
        index,
        ttl or TTLPolicy(),
        policy,
        capacity_bytes=capacity_bytes,
        delete_data=deleted,
        clock=clock,
        **kwargs,
    )


def test_chat_block_outlives_agent_block_of_the_same_age(index, clock, deleted):
    index.add([block("agent", at=0.0, traffic_class="agent"), block("chat", at=0.0, traffic_class="chat")])
    gc = make_gc(index, clock, deleted)

    clock.now = 3 * DAY_S - 1
    assert gc.collect().expired == {}

    clock.now = 3 * DAY_S
    report = gc.collect()
    assert report.expired == {"agent": 1}
    assert deleted.keys == {key("agent")}
    assert index.get(key("chat")) is not None

    clock.now = 7 * DAY_S
    assert gc.collect().expired == {"chat": 1}
    assert index.usage() == IndexUsage(num_blocks=0, num_bytes=0)


def test_expiry_counts_from_the_last_access(index, clock, deleted):
    index.add([block("a", at=0.0, traffic_class="agent")])
    index.touch([key("a")], now=2 * DAY_S)
    clock.now = 4 * DAY_S
    assert make_gc(index, clock, deleted).collect().expired == {}


def test_unknown_class_expires_with_the_default_class_ttl(index, clock, deleted):
    index.add([block("batch", at=0.0, traffic_class="batch")])
    clock.now = 7 * DAY_S
    assert make_gc(index, clock, deleted).collect().expired == {"batch": 1}


def test_expiry_runs_in_batches(index, clock, deleted):
    index.add([block(f"b{i}", at=float(i), traffic_class="agent") for i in range(25)])
    clock.now = 10 * DAY_S
    report = make_gc(index, clock, deleted, expire_batch=10).collect()
    assert report.expired == {"agent": 25}
    assert [len(call) for call in deleted.calls] == [10, 10, 5]


def test_edited_ttl_policy_applies_at_the_next_run(index, clock, deleted):
    index.add([block("chat", at=0.0)])
    gc = make_gc(index, clock, deleted)
    clock.now = DAY_S
    assert gc.collect().expired == {}

    gc.set_ttl_policy(TTLPolicy.from_dict({"ttl_s": {"chat": 3600, "agent": 60}}))
    assert gc.collect().expired == {"chat": 1}
    assert deleted.keys == {key("chat")}


def test_nothing_is_evicted_at_or_below_the_high_watermark(index, clock, deleted):
    index.add([block(f"b{i}", at=float(i)) for i in range(9)])  # 90 of 100 bytes, high watermark 95
    report = make_gc(index, clock, deleted, capacity_bytes=100).collect()
    assert report.evicted == 0
    assert deleted.calls == []


def test_above_the_high_watermark_evicts_down_to_the_low_watermark_and_not_below(index, clock, deleted):
    index.add([block(f"b{i}", at=float(i)) for i in range(10)])  # 100 of 100 bytes
    clock.now = 100.0
    report = make_gc(index, clock, deleted, capacity_bytes=100).collect()
    assert report == GCReport(
        expired={},
        evicted=2,
        bytes_freed=20,
        usage_before=IndexUsage(num_blocks=10, num_bytes=100),
        usage_after=IndexUsage(num_blocks=8, num_bytes=80),
    )
    assert deleted.calls == [[key("b0"), key("b1")]]  # LRU: the two least recently used


def test_the_index_remembers_the_uses_of_evicted_blocks_not_of_expired_ones(index, clock, deleted):
    index.add([block("old", at=0.0, traffic_class="agent")] + [block(f"b{i}", at=10.0 + i) for i in range(10)])
    index.touch([key("b0")], now=20.0)  # b1 and b2 are now the least recent
    clock.now = 3 * DAY_S + 5.0  # "old" expires; the rest is 100 of 100 bytes
    report = make_gc(index, clock, deleted, capacity_bytes=100).collect()
    assert report.expired == {"agent": 1}
    assert deleted.calls[-1] == [key("b1"), key("b2")]

    index.add([block("old", at=clock.now), block("b1", at=clock.now), block("b0", at=clock.now)])
    assert index.get(key("b1")).uses_before == 1  # written once, evicted, written again
    assert index.get(key("old")).uses_before == 0
    assert index.get(key("b0")).hit_count == 1  # still held: the write changed nothing


def test_low_watermark_between_block_sizes_keeps_usage_at_or_below_it(index, clock, deleted):
    index.add([block(f"b{i}", at=float(i)) for i in range(10)])
    report = make_gc(index, clock, deleted, capacity_bytes=100, low_watermark=0.75, high_watermark=0.9).collect()
    assert report.usage_after.num_bytes == 70  # 75 is not a multiple of 10: one block more, not one less


def test_delete_data_gets_exactly_the_keys_removed_from_the_index(index, clock, deleted):
    index.add([block(f"old{i}", at=0.0, traffic_class="agent") for i in range(3)])
    index.add([block(f"new{i}", at=float(3 * DAY_S + i)) for i in range(12)])
    before = {entry.key for entry in index.entries()}
    clock.now = 3 * DAY_S + 20
    report = make_gc(index, clock, deleted, capacity_bytes=100).collect()
    after = {entry.key for entry in index.entries()}
    assert deleted.keys == before - after
    assert sum(len(call) for call in deleted.calls) == len(before - after)  # each key once
    assert report.expired == {"agent": 3}
    assert report.evicted == 12 - 8


def test_index_entry_is_removed_before_the_data(index, clock, deleted):
    index.add([block("a", at=0.0, traffic_class="agent")])
    seen_in_index = []
    clock.now = 10 * DAY_S

    def delete_data(keys: list[bytes]) -> None:
        seen_in_index.extend(index.get(k) is not None for k in keys)

    make_gc(index, clock, delete_data).collect()
    assert seen_in_index == [False]


@pytest.mark.parametrize(
    ("policy", "victim"), [("lru", "hot"), ("slru", "cold1"), ("best", "cold1"), (LRUPolicy(), "hot")]
)
def test_policies_are_pluggable_by_name_or_instance(index, clock, deleted, policy, victim):
    index.add([block("hot", at=0.0), block("cold1", at=1.0), block("cold2", at=2.0)])
    index.touch([key("hot")], now=0.5)
    gc = make_gc(index, clock, deleted, policy=policy, capacity_bytes=30, low_watermark=0.7, high_watermark=0.9)
    gc.collect()
    assert deleted.calls == [[key(victim)]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity_bytes": 0}, "capacity_bytes must be positive"),
        ({"low_watermark": 0.0}, "0 < low <= high <= 1"),
        ({"low_watermark": 0.9, "high_watermark": 0.8}, "0 < low <= high <= 1"),
        ({"high_watermark": 1.5}, "0 < low <= high <= 1"),
        ({"expire_batch": 0}, "expire_batch must be positive"),
        ({"policy": "nope"}, "unknown eviction policy"),
    ],
)
def test_invalid_configuration_is_rejected(index, clock, deleted, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_gc(index, clock, deleted, **kwargs)


def test_run_forever_collects_until_stopped_and_survives_failures(index, clock):
    index.add([block("a", at=0.0, traffic_class="agent"), block("b", at=0.0, traffic_class="agent")])
    clock.now = 10 * DAY_S
    stop = threading.Event()
    calls: list[list[bytes]] = []

    def delete_data(keys: list[bytes]) -> None:
        calls.append(keys)
        if len(calls) == 1:
            raise OSError("disk hiccup")
        stop.set()

    gc = make_gc(index, clock, delete_data, expire_batch=1)
    worker = threading.Thread(target=gc.run_forever, args=(stop, 0.001))
    worker.start()
    worker.join(timeout=5)
    assert not worker.is_alive()
    assert len(calls) == 2
    assert index.usage().num_blocks == 0


def test_run_forever_rejects_a_non_positive_interval(index, clock, deleted):
    with pytest.raises(ValueError, match="interval_s"):
        make_gc(index, clock, deleted).run_forever(threading.Event(), 0)


def test_expiry_keeps_a_block_retained_past_now_and_takes_it_once_the_retention_ends(index, clock, deleted):
    index.add([block("old", at=0.0), block("kept", at=0.0)])
    index.retain([key("kept")], 8 * DAY_S)
    gc = make_gc(index, clock, deleted)  # chat: 7 days
    clock.now = 7 * DAY_S + 1

    assert gc.collect().expired == {"chat": 1}
    assert deleted.keys == {key("old")}

    clock.now = 8 * DAY_S + 1
    assert gc.collect().expired == {"chat": 1}
    assert deleted.keys == {key("old"), key("kept")}


@pytest.mark.parametrize("policy", ["lru", "slru"])
def test_eviction_takes_retained_blocks_only_after_every_other(index, clock, deleted, policy):
    # The retained blocks are the oldest and shallowest: first in line under LRU otherwise.
    index.add([block(f"r{i}", at=float(i), depth=i) for i in range(3)])
    index.add([block(f"b{i}", at=10.0 + i, depth=5) for i in range(7)])
    index.retain([key(f"r{i}") for i in range(3)], 1000.0)
    index.touch([key("b6")], now=50.0)
    clock.now = 100.0

    gc = make_gc(index, clock, deleted, policy=policy, capacity_bytes=100, low_watermark=0.2, high_watermark=0.9)
    report = gc.collect()

    assert report.usage_after.num_bytes == 20
    # Every unretained block (b6 too, though hit), then the least recent retained one.
    assert deleted.keys == {key(f"b{i}") for i in range(7)} | {key("r0")}
