import msgspec
import pytest

from workers.kvstore.eviction import LRUPolicy, ProvenReusePolicy, SegmentedLRUPolicy, get_policy
from workers.kvstore.gc import GarbageCollector
from workers.kvstore.index import BlockEntry
from workers.kvstore.memory_index import MemoryIndex
from workers.kvstore.ttl import TTLPolicy


def entry(
    name: str,
    *,
    last_access: float,
    depth: int = 0,
    hit_count: int = 0,
    size: int = 1,
    new_chain: bool = False,
    uses_before: int = 0,
) -> BlockEntry:
    return BlockEntry(
        key=name.encode().ljust(16, b"\0"),
        size=size,
        traffic_class="chat",
        depth=depth,
        created_at=0.0,
        last_access=last_access,
        hit_count=hit_count,
        new_chain=new_chain,
        uses_before=uses_before,
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
                BlockEntry(
                    key=key,
                    size=1,
                    traffic_class="chat",
                    depth=d,
                    created_at=now[0],
                    last_access=now[0],
                    new_chain=hit == 0,
                )
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
    assert isinstance(get_policy("proven_reuse"), ProvenReusePolicy)
    assert isinstance(get_policy("best"), ProvenReusePolicy)
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        get_policy("mru")
    with pytest.raises(ValueError, match="unknown eviction policy 'reuse_interval'"):
        get_policy("reuse_interval")


@pytest.mark.parametrize("policy", ["lru", "slru", "gdsf", "lru_logfreq", "proven_reuse", "best"])
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


def test_proven_reuse_is_lru_while_probation_is_within_its_share():
    # 10 blocks, free 2 -> 8 kept, probation share 0.35 -> 2.8: the two never-hit blocks fit.
    entries = [entry(f"hit-{i}", last_access=float(i), hit_count=1) for i in range(8)]
    entries += [entry("new-a", last_access=0.5), entry("new-b", last_access=9.0)]
    victims = ProvenReusePolicy().select_victims(entries, 2, now=10.0)
    assert names(victims) == ["hit-0", "new-a"]
    assert names(victims) == names(LRUPolicy().select_victims(entries, 2, now=10.0))


def test_proven_reuse_evicts_probation_beyond_its_share_before_older_proven_blocks():
    entries = [
        entry("hit-old", last_access=1.0, hit_count=2),
        entry("remembered-old", last_access=2.0, uses_before=1),  # used before its last eviction
        entry("hit-mid", last_access=3.0, hit_count=1),
        entry("hit-new", last_access=9.0, hit_count=1),
    ]
    entries += [entry(f"new-{i}", last_access=5.0 + i) for i in range(4)]
    policy = ProvenReusePolicy(probation_share=0.4)
    # Free 3 -> 5 kept, probation may hold 2 of them: the 2 oldest of its 4 go, then the oldest of the rest.
    assert names(policy.select_victims(entries, 3, now=10.0)) == ["new-0", "new-1", "hit-old"]
    assert names(policy.select_victims(entries, 1, now=10.0)) == ["new-0"]
    assert names(LRUPolicy().select_victims(entries, 1, now=10.0)) == ["hit-old"]
    # SLRU knows nothing of earlier stays: the remembered block is on probation there.
    assert names(SegmentedLRUPolicy().select_victims(entries, 2, now=10.0)) == ["remembered-old", "new-0"]


def test_proven_reuse_ages_probation_blocks_of_fresh_chains_faster():
    # Probation within its share (share 1), so only the aging decides: idle 4 x 2 = 8 > 6.
    entries = [
        entry("continuation", last_access=4.0),
        entry("fresh", last_access=6.0, new_chain=True),
        entry("fresh-but-hit", last_access=5.0, new_chain=True, hit_count=1),
        entry("recent", last_access=9.0),
    ]
    policy = ProvenReusePolicy(probation_share=1.0, fresh_aging=2.0)
    assert names(policy.select_victims(entries, 3, now=10.0)) == ["fresh", "continuation", "fresh-but-hit"]
    assert names(ProvenReusePolicy(probation_share=1.0, fresh_aging=1.0).select_victims(entries, 1, now=10.0)) == [
        "continuation"
    ]


def test_proven_reuse_takes_a_chains_tail_before_its_head():
    entries = [entry(f"chain-{d}", last_access=5.0, depth=d, new_chain=True) for d in range(3)]
    entries.append(entry("hit", last_access=1.0, hit_count=1))
    assert names(ProvenReusePolicy().select_victims(entries, 2, now=10.0)) == ["chain-2", "chain-1"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"probation_share": 0.0}, "probation_share"),
        ({"probation_share": 1.5}, "probation_share"),
        ({"fresh_aging": 0.5}, "fresh_aging"),
        ({"fresh_aging": float("nan")}, "fresh_aging"),
        ({"fresh_aging": float("inf")}, "fresh_aging"),
    ],
)
def test_proven_reuse_refuses_out_of_range_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        ProvenReusePolicy(**settings)


def test_proven_reuse_keeps_a_prompt_that_came_back_after_eviction_where_lru_and_slru_lose_it():
    # A 3-block document D, then one-off prompts of 3 blocks; the store holds 6. LRU and SLRU evict D
    # before each of its returns. Under proven_reuse, D's second write is remembered as a return
    # (uses before its eviction), so it leaves probation and outlives the one-offs to its third use.
    document = [f"doc-{j}" for j in range(3)]
    requests = [document]
    for name in ("a", "b"):
        requests.append([f"{name}-{j}" for j in range(3)])
    requests.append(document)
    for name in ("c", "e"):
        requests.append([f"{name}-{j}" for j in range(3)])
    requests.append(document)
    assert replay_hits("lru", requests, capacity=6) == 0
    assert replay_hits("slru", requests, capacity=6) == 0
    assert replay_hits("best", requests, capacity=6) == 3
