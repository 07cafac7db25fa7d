"""What tells a reused KV block from one never used again, in a Mooncake-format trace: the study
behind the `best` eviction policy (workers.kvstore.eviction).

    python -m bench.reuse_study --trace FILE [--capacity-share 0.05]

Prints one JSON object:
- `after_use`: for a block's k-th use (1 = the write that first stores it; "5+" pools the rest), the
  chance of another use and the median gap to it in seconds, with unbounded capacity;
- `lru_store`: a store of `--capacity-share` of the trace's unique full blocks evicting least recent
  first (a request's deepest blocks first among equals), as `lru` does:
  - `turnover_s`: its capacity over the rate at which it writes blocks, about how long it keeps one;
  - `rewritten_share`: of the blocks it writes, those it had written before and evicted, which an
    index that forgets evicted blocks takes for new ones;
  - `new_chain` / `continuation`: blocks written by a request that matched nothing stored (a fresh
    chain) and by one that extended a stored prefix: how many, and the chance each is used again.
"""

import argparse
import json
import statistics
from collections import Counter, OrderedDict
from pathlib import Path

from bench.trace_replay import TRACE_BLOCK_TOKENS, Chain, load_chains


def after_use(chains: list[Chain], pooled_from: int = 5) -> dict[str, dict[str, float]]:
    uses: dict[bytes, list[float]] = {}
    for now, keys in chains:
        for key in keys:
            uses.setdefault(key, []).append(now)
    continued: Counter[int] = Counter()
    total: Counter[int] = Counter()
    gaps: dict[int, list[float]] = {k: [] for k in range(1, pooled_from + 1)}
    for times in uses.values():
        for k, at in enumerate(times, start=1):
            ordinal = min(k, pooled_from)
            total[ordinal] += 1
            if k < len(times):
                continued[ordinal] += 1
                gaps[ordinal].append(times[k] - at)
    return {
        (str(k) if k < pooled_from else f"{k}+"): {
            "p_another_use": continued[k] / total[k],
            "median_gap_s": statistics.median(gaps[k]) if gaps[k] else None,
        }
        for k in sorted(total)
    }


def lru_store(chains: list[Chain], capacity_blocks: int) -> dict[str, object]:
    next_use = _used_again(chains)
    held: OrderedDict[bytes, None] = OrderedDict()  # least recent first
    ever_written: set[bytes] = set()
    written = rewritten = 0
    by_kind = {"new_chain": [0, 0], "continuation": [0, 0]}  # [blocks written, used again]
    for i, (_, keys) in enumerate(chains):
        hit = 0
        while hit < len(keys) and keys[hit] in held:
            hit += 1
        kind = by_kind["new_chain" if hit == 0 else "continuation"]
        new = [depth for depth in range(hit, len(keys)) if keys[depth] not in held]
        for depth in new:
            written += 1
            rewritten += keys[depth] in ever_written
            ever_written.add(keys[depth])
            kind[0] += 1
            kind[1] += next_use[i][depth]
        # This request's blocks become the most recent, its head last so that its tail goes first.
        for depth in sorted(list(range(hit)) + new, reverse=True):
            held[keys[depth]] = None
            held.move_to_end(keys[depth])
        while len(held) > capacity_blocks:
            held.popitem(last=False)
    duration = chains[-1][0] - chains[0][0]
    return {
        "capacity_blocks": capacity_blocks,
        "turnover_s": capacity_blocks / (written / duration) if written and duration else None,
        "written_blocks": written,
        "rewritten_share": rewritten / written if written else 0.0,
        **{
            name: {"blocks": count, "p_used_again": reused / count if count else None}
            for name, (count, reused) in by_kind.items()
        },
    }


def _used_again(chains: list[Chain]) -> list[list[bool]]:
    """For each request and block: whether a later request uses the block."""
    seen: set[bytes] = set()
    result: list[list[bool]] = [[] for _ in chains]
    for i in range(len(chains) - 1, -1, -1):
        keys = chains[i][1]
        result[i] = [key in seen for key in keys]
        seen.update(keys)
    return result


def study(trace: Path, capacity_share: float) -> dict[str, object]:
    if not 0 < capacity_share <= 1:
        raise ValueError(f"--capacity-share must be in (0, 1], got {capacity_share}")
    chains = load_chains(trace, TRACE_BLOCK_TOKENS)
    if not chains:
        raise ValueError(f"{trace} holds no requests")
    unique = len({key for _, keys in chains for key in keys})
    return {
        "trace": trace.name,
        "requests": len(chains),
        "unique_blocks": unique,
        "duration_s": chains[-1][0] - chains[0][0],
        "after_use": after_use(chains),
        "lru_store": {"share": capacity_share, **lru_store(chains, max(1, round(capacity_share * unique)))},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL trace")
    parser.add_argument("--capacity-share", type=float, default=0.05, help="LRU store size, share of unique blocks")
    args = parser.parse_args()
    try:
        result = study(args.trace, args.capacity_share)
    except ValueError as error:
        parser.error(str(error))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
