"""Replay a Mooncake-format trace through the KV store's index, GC and eviction policy; compare policies.

    python -m bench.trace_replay --trace /work/shared/data/mooncake_synthetic_trace.jsonl \\
        --capacity-blocks 2007 --policy best [--block-tokens 512]
    python -m bench.trace_replay --trace FILE --policies all [--capacity-shares 0.05,0.1] [--cost-blocks 20000]

`bench.trace_replay_generated` runs the comparison on generated multi-turn traces.

The second form (comparison mode) replays every named policy and Belady at each share of the trace's
unique blocks and adds, per policy, the cost of one eviction ranking per block in microseconds over
`--cost-blocks` entries: in-process `MemoryIndex`, and `RedisIndex` on `--redis-url` (DB 9, a unique
prefix deleted afterwards), where reading the snapshot dominates; and the GC's removal per block,
forgetting the blocks or remembering their uses (`best` needs the latter).

Each trace line has `timestamp` (ms), `input_length` and `hash_ids`: chained ids of the prompt's
512-token blocks (equal id = same prefix up to and including that block; the last id may cover a
partial block). Per request, in timestamp order: match the longest run of present blocks from the
first, touch them, add the request's other full blocks (marked `new_chain` when nothing matched, as
the engine marks the blocks of a prompt that shared no full block with a cache), run the GC. Only
metadata moves: the real `MemoryIndex` (remembering what the GC evicted, as in the store),
`GarbageCollector` and policy run with block size 1 and a no-op data deleter, on a fake clock that
reads the trace's timestamps. Every policy and Belady see the same full blocks: a request's last
partial block is never stored, as the engine stores only full blocks.

Prints one JSON object. Hit rates are token-weighted over full blocks: the sum over requests of
(leading present blocks x block tokens) over the sum of (full blocks x block tokens).
- `hit_rate`: the chosen policy at `--capacity-blocks`; `lru_hit_rate`: LRU at the same capacity;
- `belady_hit_rate`: offline optimum at the same capacity (evict the block whose next use is furthest
  away, deepest first among equals; a block never used again goes first);
- `oracle_hit_rate`: infinite capacity (every reuse hits);
- `ratio_to_belady` and `lru_ratio_to_belady`: the two policies' hit rates over Belady's;
- `unique_blocks`: distinct full blocks in the trace, the unit for choosing a capacity.

Fair comparison with Belady: every block has size 1, so capacity counts blocks, and the GC runs with
both watermarks at 1.0, so after each request the store holds at most `--capacity-blocks` blocks,
exactly Belady's budget. Both may exceed it while a request's new blocks are added and both then
evict down to it, which lets either drop a new block at once (Belady thereby also gets bypass).
The store's real watermarks (0.8 / 0.95) would hand the policies an average capacity below N.

`--block-tokens` re-blocks the trace: it must divide 512 or be a multiple of it. A divisor 512/s
splits each trace block into s sub-blocks (sub-block j of trace block b is taken to hold the same
tokens wherever b appears, so its key is (b, j)); a multiple 512*m merges m trace blocks, keyed by the
last of their ids, since a chained id names its whole prefix. A request's full blocks are then
`input_length // block_tokens`, capped by what its ids cover. Capacity and unique blocks count
blocks of the chosen size. TTLs (days) play no part in a trace of minutes, so the GC runs with the
default TTL policy and every block is of class "chat".
"""

import argparse
import heapq
import json
import math
import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from workers.kvstore.block_hash import BlockHash
from workers.kvstore.eviction import POLICIES, get_policy
from workers.kvstore.gc import GarbageCollector
from workers.kvstore.index import BlockEntry, BlockIndex
from workers.kvstore.memory_index import MemoryIndex
from workers.kvstore.redis_index import RedisIndex
from workers.kvstore.ttl import TTLPolicy

TRACE_BLOCK_TOKENS = 512

Chain = tuple[float, list[BlockHash]]  # (time in seconds, keys of the request's full blocks)


def load_chains(path: Path, block_tokens: int) -> list[Chain]:
    """The trace's requests in timestamp order, as full-block key chains at `block_tokens`."""
    to_keys = _reblocker(block_tokens)
    requests = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    requests.sort(key=lambda request: request["timestamp"])
    return [
        (request["timestamp"] / 1000.0, to_keys(request["hash_ids"], request["input_length"] // block_tokens))
        for request in requests
    ]


def _reblocker(block_tokens: int) -> Callable[[list[int], int], list[BlockHash]]:
    if block_tokens <= 0 or (TRACE_BLOCK_TOKENS % block_tokens and block_tokens % TRACE_BLOCK_TOKENS):
        raise ValueError(f"--block-tokens must divide {TRACE_BLOCK_TOKENS} or be a multiple of it, got {block_tokens}")
    if block_tokens <= TRACE_BLOCK_TOKENS:
        split = TRACE_BLOCK_TOKENS // block_tokens
        return lambda ids, full: [_key(ids[i // split], i % split) for i in range(min(full, len(ids) * split))]
    merge = block_tokens // TRACE_BLOCK_TOKENS
    return lambda ids, full: [_key(ids[(i + 1) * merge - 1], 0) for i in range(min(full, len(ids) // merge))]


def _key(trace_id: int, part: int) -> BlockHash:
    return trace_id.to_bytes(12, "little") + part.to_bytes(4, "little")


def replay_policy(chains: list[Chain], capacity_blocks: int, policy: str) -> float:
    """Hit rate of the store's own index + GC + `policy` holding at most `capacity_blocks` blocks."""
    index = MemoryIndex()
    clock = [0.0]
    gc = GarbageCollector(
        index,
        TTLPolicy(),
        policy,
        capacity_bytes=capacity_blocks,
        low_watermark=1.0,
        high_watermark=1.0,
        delete_data=lambda keys: None,
        clock=lambda: clock[0],
    )
    hits = 0
    for now, keys in chains:
        clock[0] = now
        hit = index.match_prefix(keys)
        index.touch(keys[:hit], now)
        index.add(
            [
                BlockEntry(
                    key=key,
                    size=1,
                    traffic_class="chat",
                    depth=depth,
                    created_at=now,
                    last_access=now,
                    new_chain=hit == 0,
                )
                for depth, key in enumerate(keys[hit:], start=hit)
            ]
        )
        gc.collect()
        hits += hit
    return _rate(hits, chains)


def replay_belady(chains: list[Chain], capacity_blocks: int) -> float:
    """Hit rate of the offline optimum: evict the block whose next use is furthest in the future."""
    next_use = _next_uses(chains)
    present: dict[BlockHash, int] = {}  # key -> request index of its next use
    heap: list[tuple[float, int, BlockHash]] = []  # (-next use, -depth, key); stale items skipped
    hits = 0
    for i, (_, keys) in enumerate(chains):
        hit = 0
        while hit < len(keys) and keys[hit] in present:
            hit += 1
        hits += hit
        for depth, (key, use) in enumerate(zip(keys, next_use[i])):
            present[key] = use
            heapq.heappush(heap, (-use, -depth, key))
        while len(present) > capacity_blocks:
            use, _, key = heapq.heappop(heap)
            if present.get(key) == -use:
                del present[key]
    return _rate(hits, chains)


def _next_uses(chains: list[Chain]) -> list[list[float]]:
    """For each request and block, the index of the next request using the block (inf if none)."""
    seen_at: dict[BlockHash, float] = {}
    result: list[list[float]] = [[] for _ in chains]
    for i in range(len(chains) - 1, -1, -1):
        keys = chains[i][1]
        result[i] = [seen_at.get(key, math.inf) for key in keys]
        for key in keys:
            seen_at[key] = i
    return result


def replay_oracle(chains: list[Chain]) -> float:
    """Hit rate with infinite capacity: every block ever written is still there."""
    seen: set[BlockHash] = set()
    hits = 0
    for _, keys in chains:
        hit = 0
        while hit < len(keys) and keys[hit] in seen:
            hit += 1
        hits += hit
        seen.update(keys)
    return _rate(hits, chains)


def _rate(hit_blocks: int, chains: list[Chain]) -> float:
    """Token-weighted hit rate; block tokens cancel out because every block has the same length."""
    total_blocks = sum(len(keys) for _, keys in chains)
    return hit_blocks / total_blocks if total_blocks else 0.0


def run(trace: Path, capacity_blocks: int, policy: str, block_tokens: int) -> dict[str, object]:
    if capacity_blocks <= 0:
        raise ValueError(f"--capacity-blocks must be positive, got {capacity_blocks}")
    get_policy(policy)  # fail on an unknown name before the replays
    started = time.perf_counter()
    chains = load_chains(trace, block_tokens)
    hit_rate = replay_policy(chains, capacity_blocks, policy)
    lru_hit_rate = hit_rate if policy == "lru" else replay_policy(chains, capacity_blocks, "lru")
    belady = replay_belady(chains, capacity_blocks)
    return {
        "policy": policy,
        "capacity_blocks": capacity_blocks,
        "block_tokens": block_tokens,
        "requests": len(chains),
        "unique_blocks": len({key for _, keys in chains for key in keys}),
        "hit_rate": hit_rate,
        "lru_hit_rate": lru_hit_rate,
        "belady_hit_rate": belady,
        "oracle_hit_rate": replay_oracle(chains),
        "ratio_to_belady": hit_rate / belady if belady else None,
        "lru_ratio_to_belady": lru_hit_rate / belady if belady else None,
        "seconds": round(time.perf_counter() - started, 2),
    }


def run_all(trace: Path, policies: list[str], shares: list[float], block_tokens: int) -> dict[str, object]:
    """Every policy in `policies` beside Belady at each capacity share of the trace's unique blocks."""
    for name in policies:
        get_policy(name)
    if not shares or not all(0 < share <= 1 for share in shares):
        raise ValueError(f"--capacity-shares must be fractions in (0, 1], got {shares}")
    chains = load_chains(trace, block_tokens)
    unique = len({key for _, keys in chains for key in keys})
    capacities = []
    for share in shares:
        capacity = max(1, round(share * unique))
        belady = replay_belady(chains, capacity)
        rates = {name: replay_policy(chains, capacity, name) for name in policies}
        capacities.append(
            {
                "share": share,
                "capacity_blocks": capacity,
                "belady_hit_rate": belady,
                "policies": {
                    name: {"hit_rate": rate, "ratio_to_belady": rate / belady if belady else None}
                    for name, rate in rates.items()
                },
            }
        )
    return {
        "trace": trace.name,
        "block_tokens": block_tokens,
        "requests": len(chains),
        "unique_blocks": unique,
        "oracle_hit_rate": replay_oracle(chains),
        "capacities": capacities,
    }


def _fill(index: BlockIndex, blocks: int, now: float) -> None:
    """`blocks` entries of varied recency, hits, depth, chain kind and earlier stays."""
    rng = random.Random(0)
    index.add(
        [
            BlockEntry(
                key=i.to_bytes(16, "little"),
                size=1,
                traffic_class="chat",
                depth=i % 64,
                created_at=now - rng.uniform(0, 3600),
                last_access=now - rng.uniform(0, 60),
                hit_count=rng.randrange(4),
                new_chain=rng.random() < 0.3,
                uses_before=rng.randrange(2),
            )
            for i in range(blocks)
        ]
    )


def policy_cost_us(index: BlockIndex, policies: list[str], blocks: int, rounds: int) -> dict[str, float]:
    """Microseconds per block of one eviction ranking over `blocks` entries of `index` (which it
    fills), per policy: the snapshot read from the index plus the ranking, freeing a tenth of them.
    The fastest of `rounds`, policies taking turns, so that load on the machine favours none."""
    now = 1_000_000.0
    _fill(index, blocks, now)
    best = dict.fromkeys(policies, math.inf)
    for _ in range(rounds):
        for name in policies:
            policy = get_policy(name)
            started = time.perf_counter()
            policy.select_victims(index.entries(), blocks // 10, now)
            best[name] = min(best[name], (time.perf_counter() - started) / blocks * 1e6)
    return best


def removal_cost_us(index: BlockIndex, blocks: int, rounds: int) -> dict[str, float]:
    """Microseconds per block the GC's removal takes, forgetting the blocks and remembering their uses
    (which `best` relies on), in batches of 100 over `blocks` entries (half each way); the fastest of
    `rounds`, each on a refilled index."""
    keys = [i.to_bytes(16, "little") for i in range(blocks)]
    cost = {"forget": math.inf, "remember": math.inf}
    for _ in range(rounds):
        _fill(index, blocks, 1_000_000.0)
        for remember, part in ((False, keys[: blocks // 2]), (True, keys[blocks // 2 :])):
            started = time.perf_counter()
            for start in range(0, len(part), 100):
                index.remove(part[start : start + 100], remember=remember)
            name = "remember" if remember else "forget"
            cost[name] = min(cost[name], (time.perf_counter() - started) / len(part) * 1e6)
    return cost


def policy_costs(policies: list[str], blocks: int, redis_url: str, rounds: int = 5) -> dict[str, object]:
    """Ranking cost per policy and removal cost, on the in-process index and on Redis (unique key
    prefixes, deleted afterwards)."""
    import redis

    client = redis.Redis.from_url(redis_url)

    def on_redis(measure: Callable[[BlockIndex], dict[str, float]]) -> dict[str, float]:
        prefix = f"bench:trace_replay:{uuid.uuid4().hex}"
        try:
            return measure(RedisIndex(client, prefix))
        finally:
            if names := list(client.scan_iter(match=f"{prefix}:*", count=1000)):
                client.delete(*names)

    try:
        memory = policy_cost_us(MemoryIndex(), policies, blocks, rounds)
        shared = on_redis(lambda index: policy_cost_us(index, policies, blocks, rounds))
        removal = {
            "memory_index_us": removal_cost_us(MemoryIndex(), blocks, rounds),
            "redis_index_us": on_redis(lambda index: removal_cost_us(index, blocks, rounds)),
        }
    finally:
        client.close()
    return {
        "ranking": {name: {"memory_index_us": memory[name], "redis_index_us": shared[name]} for name in policies},
        "removal": removal,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL trace")
    parser.add_argument("--capacity-blocks", type=int, help="store capacity in blocks (one policy vs LRU)")
    parser.add_argument("--policy", help=f"eviction policy name: {', '.join(POLICIES)}")
    parser.add_argument("--policies", help="comparison mode: comma-separated policy names, or 'all'")
    parser.add_argument("--capacity-shares", default="0.05,0.1", help="comparison mode: shares of unique blocks")
    parser.add_argument("--cost-blocks", type=int, default=20000, help="entries to time a ranking over (0: skip)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/9", help="comparison mode: Redis for the cost")
    parser.add_argument("--block-tokens", type=int, default=TRACE_BLOCK_TOKENS, help="divisor or multiple of 512")
    args = parser.parse_args()
    try:
        if args.policies:
            policies = list(POLICIES) if args.policies == "all" else args.policies.split(",")
            shares = [float(share) for share in args.capacity_shares.split(",")]
            result = run_all(args.trace, policies, shares, args.block_tokens)
            if args.cost_blocks > 0:
                result["cost_per_block"] = policy_costs(policies, args.cost_blocks, args.redis_url)
        elif args.capacity_blocks is None or args.policy is None:
            parser.error("give --capacity-blocks and --policy, or --policies")
        else:
            result = run(args.trace, args.capacity_blocks, args.policy, args.block_tokens)
    except ValueError as error:
        parser.error(str(error))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
