import msgspec
import pytest

from workers.kvstore.eviction import LRUPolicy, SegmentedLRUPolicy, get_policy
from workers.kvstore.gc import GarbageCollector
from workers.kvstore.index import BlockEntry
from workers.kvstore.memory_index import MemoryIndex
from workers.kvstore.ttl import TTLPolicy


def entry(name: str, *, last_access: float, depth: int = 0, hit_count: int = 0, size: int = 1) -> BlockEntry:
    return BlockEntry(
        key=name.encode().ljust(16, b"\0"),
        size=size,
        traffic_class="chat",
        depth=depth,
        created_at=0.0,
        last_access=last_access,
        hit_count=hit_count,
    )


def names(entries: list[BlockEntry]) -> list[str]:
    return [e.key.rstrip(b"\0").decode() for e in entries]


def test_lru_evicts_least_recent_first_and_deeper_first_among_equals():
    entries = [
        entry("new", last_access=9.0),
        entry("old-head", last_access=1.0, depth=0),
        entry("old-tail", last_access=1.0, depth=2),
        entry("old-mid", last_access=1.0, depth=1),
        entry("mid", last_access=5.0),
    ]
    assert names(LRUPolicy().select_victims(entries, 4, now=10.0)) == ["old-tail", "old-mid", "old-head", "mid"]


def test_victims_are_the_fewest_that_reach_the_bytes_to_free():
    entries = [
        entry("a", last_access=1.0, size=100),
        entry("b", last_access=2.0, size=100),
        entry("c", last_access=3.0),
    ]
    assert names(LRUPolicy().select_victims(entries, 101, now=4.0)) == ["a", "b"]
    assert names(LRUPolicy().select_victims(entries, 100, now=4.0)) == ["a"]
    assert LRUPolicy().select_victims(entries, 0, now=4.0) == []
    assert LRUPolicy().select_victims([], 10, now=4.0) == []
    assert SegmentedLRUPolicy().select_victims([], 10, now=4.0) == []
    assert len(LRUPolicy().select_victims(entries, 10_000, now=4.0)) == 3


def test_slru_evicts_never_hit_blocks_before_older_hit_blocks():
    entries = [
        entry("hot", last_access=1.0, hit_count=3),
        entry("one-off-a", last_access=2.0),
        entry("one-off-b", last_access=3.0),
    ]
    assert names(LRUPolicy().select_victims(entries, 1, now=4.0)) == ["hot"]
    assert names(SegmentedLRUPolicy().select_victims(entries, 1, now=4.0)) == ["one-off-a"]


def test_slru_demotes_protected_blocks_beyond_the_share_oldest_and_deepest_first():
    # 6 blocks, free 2 -> 4 kept; protected cap = 0.5 * 4 = 2 blocks: the two most recent hit blocks.
    entries = [
        entry("hit-new", last_access=8.0, hit_count=1),
        entry("hit-mid-head", last_access=6.0, hit_count=1, depth=0),
        entry("hit-mid-tail", last_access=6.0, hit_count=1, depth=1),
        entry("hit-old", last_access=2.0, hit_count=5),
        entry("probation", last_access=7.0),
        entry("probation-new", last_access=9.0),
    ]
    victims = SegmentedLRUPolicy(protected_share=0.5).select_victims(entries, 2, now=10.0)
    assert names(victims) == ["hit-old", "hit-mid-tail"]


def test_slru_gives_up_everything_when_asked_for_more_than_it_holds():
    entries = [entry("hit", last_access=1.0, hit_count=1), entry("probation", last_access=2.0)]
    assert sorted(names(SegmentedLRUPolicy().select_victims(entries, 5, now=3.0))) == ["hit", "probation"]
    assert SegmentedLRUPolicy().select_victims(entries, 0, now=3.0) == []


def test_protected_share_is_validated():
    with pytest.raises(ValueError, match="protected_share"):
        SegmentedLRUPolicy(protected_share=1.0)


def replay_hits(policy: str, requests: list[list[str]], capacity: int) -> int:
    """Blocks hit when `requests` (chains of block names) go through a MemoryIndex + GC of `capacity` blocks."""
    index = MemoryIndex()
    now = [0.0]
    gc = GarbageCollector(
        index,
        TTLPolicy(),
        get_policy(policy),
        capacity_bytes=capacity,
        low_watermark=1.0,
        high_watermark=1.0,
        delete_data=lambda keys: None,
        clock=lambda: now[0],
    )
    hits = 0
    for step, chain in enumerate(requests):
        now[0] = float(step)
        keys = [name.encode().ljust(16, b"\0") for name in chain]
        hit = index.match_prefix(keys)
        index.touch(keys[:hit], now[0])
        index.add(
            [
                BlockEntry(key=key, size=1, traffic_class="chat", depth=d, created_at=now[0], last_access=now[0])
                for d, key in enumerate(keys[hit:], start=hit)
            ]
        )
        gc.collect()
        hits += hit
    return hits


def test_slru_keeps_a_shared_prefix_through_bursts_of_one_off_prompts_where_lru_loses_it():
    # A 2-block system prompt used twice in a row, then every third request, between one-off prompts
    # of 3 blocks each; the store holds 6 blocks. LRU flushes the prompt with every pair of one-offs.
    system = ["sys0", "sys1"]
    requests = [system, system]
    for i in range(5):
        requests += [[f"a{i}-{j}" for j in range(3)], [f"b{i}-{j}" for j in range(3)], system]
    assert replay_hits("lru", requests, capacity=6) == 2
    assert replay_hits("slru", requests, capacity=6) == 2 + 5 * 2


def test_policies_by_name():
    assert isinstance(get_policy("lru"), LRUPolicy)
    assert isinstance(get_policy("slru"), SegmentedLRUPolicy)
    assert isinstance(get_policy("best"), SegmentedLRUPolicy)
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        get_policy("mru")


@pytest.mark.parametrize("policy", ["lru", "slru", "gdsf", "lru_logfreq", "reuse_interval", "best"])
def test_blocks_with_a_live_retention_hint_go_after_every_other_block(policy):
    hinted = msgspec.structs.replace(entry("hinted", last_access=1.0), retain_until=100.0)
    lapsed = msgspec.structs.replace(entry("lapsed", last_access=2.0), retain_until=5.0)
    entries = [hinted, lapsed, entry("hot", last_access=9.0, hit_count=5)]
    assert names(get_policy(policy).select_victims(entries, 2, now=10.0)) == ["lapsed", "hot"]
    assert names(get_policy(policy).select_victims(entries, 3, now=10.0))[-1] == "hinted"


def test_gdsf_and_logfreq_trade_idle_time_for_hits():
    # Mean idle 4 s: a block hit 3 times and idle 6 s outranks a never-hit block idle 2 s.
    entries = [entry("hit-old", last_access=4.0, hit_count=3), entry("new", last_access=8.0)]
    assert names(get_policy("gdsf").select_victims(entries, 1, now=10.0)) == ["new"]
    assert names(get_policy("lru_logfreq").select_victims(entries, 1, now=10.0)) == ["new"]
    assert names(LRUPolicy().select_victims(entries, 1, now=10.0)) == ["hit-old"]
