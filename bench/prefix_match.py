"""Entrypoint prefix match: token ids → hit length for a long stored chain, on the in-process index
and on the Redis index (the peer: one network round trip), in one run.

    python -m bench.prefix_match [--blocks 1000] [--block-tokens 128] [--repeats 200]

Times, per index, the whole call (`store_hit_tokens`: hashing the chain plus walking the index) and
the index walk alone (`match_prefix` on precomputed keys); medians in milliseconds. Needs Redis on
127.0.0.1:6379 for the peer (skipped, and said so, when it is down). Prints one JSON object.
"""

import argparse
import json
import statistics
import time
import uuid

import numpy as np
import redis

from workers.block_hash import hash_chain, namespace_extra
from workers.entrypoint.prefix_match import store_hit_tokens
from workers.kvstore.index import BlockEntry, BlockIndex
from workers.kvstore.memory_index import MemoryIndex
from workers.kvstore.redis_index import RedisIndex

REDIS_URL = "redis://127.0.0.1:6379/0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1000)
    parser.add_argument("--block-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    tokens = np.random.default_rng(0).integers(0, 49152, args.blocks * args.block_tokens + 1, dtype=np.int32)
    extra = namespace_extra("bench-model:float32", "tenant")
    keys = hash_chain(tokens, args.block_tokens, extra)
    entries = [
        BlockEntry(key=key, size=1, traffic_class="chat", depth=depth, created_at=0.0, last_access=0.0)
        for depth, key in enumerate(keys)
    ]

    results = {"in_process": _measure(MemoryIndex(), entries, tokens, keys, extra, args)}
    prefix = f"sluice:bench:{uuid.uuid4().hex}"
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError:
        results["redis"] = "skipped: Redis is not reachable at " + REDIS_URL
    else:
        try:
            results["redis"] = _measure(RedisIndex(client, prefix), entries, tokens, keys, extra, args)
        finally:
            for key in client.scan_iter(f"{prefix}*"):
                client.delete(key)
    print(
        json.dumps(
            {
                "benchmark": "prefix_match",
                "blocks": args.blocks,
                "block_tokens": args.block_tokens,
                "tokens": len(tokens),
                "median_ms": results,
            },
            indent=2,
        )
    )


def _measure(index: BlockIndex, entries, tokens, keys, extra: bytes, args) -> dict[str, float]:
    index.add(entries)
    hit = store_hit_tokens(index, tokens, block_tokens=args.block_tokens, extra=extra)
    if hit != args.blocks * args.block_tokens:
        raise RuntimeError(f"expected a hit on all {args.blocks} blocks, got {hit} tokens")
    whole = _median_ms(lambda: store_hit_tokens(index, tokens, block_tokens=args.block_tokens, extra=extra), args)
    walk = _median_ms(lambda: index.match_prefix(keys), args)
    return {"token_ids_to_hit": whole, "index_walk_only": walk, "hashing": round(whole - walk, 4)}


def _median_ms(call, args) -> float:
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1000, 4)


if __name__ == "__main__":
    main()
