"""Entrypoint prefix match: token ids → hit length for a long stored chain, on the in-process index,
on the index the store's GC process serves over ipc (the embedded default's workers and gateway use
it: one local round trip) and on the Redis index (one network round trip), in one run.

    python -m bench.prefix_match [--blocks 1000] [--block-tokens 128] [--repeats 200] [--across-namespaces]

Times, per index, the whole call (`store_hit_tokens`: hashing the chain plus walking the index) and
the index walk alone (`match_prefix` on precomputed keys); medians in milliseconds. Needs Redis on
127.0.0.1:6379 for the peer (skipped, and said so, when it is down). Prints one JSON object.

`--across-namespaces` (root, `ip netns`): also from another host, a network namespace reaching the
same Redis over a veth pair and the harness's TCP forwarder (tests/e2e/netns.py), in the same run;
`across_over_localhost` is that run's medians over the localhost one's.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import redis

from workers.client.routing.prefix_match import store_hit_tokens
from workers.kvstore.block_hash import hash_chain, namespace_extra
from workers.kvstore.index import BlockEntry, BlockIndex
from workers.kvstore.memory_index import MemoryIndex
from workers.kvstore.redis_index import RedisIndex
from workers.kvstore.remote_index import RemoteIndex

REDIS_URL = "redis://127.0.0.1:6379/0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=1000)
    parser.add_argument("--block-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--redis-url", default=REDIS_URL)
    parser.add_argument("--redis-only", action="store_true", help="time the Redis index alone")
    parser.add_argument("--across-namespaces", action="store_true", help="also from another network namespace")
    args = parser.parse_args()
    tokens = np.random.default_rng(0).integers(0, 49152, args.blocks * args.block_tokens + 1, dtype=np.int32)
    extra = namespace_extra("bench-model:float32", "tenant")
    keys = hash_chain(tokens, args.block_tokens, extra)
    entries = [
        BlockEntry(key=key, size=1, traffic_class="chat", depth=depth, created_at=0.0, last_access=0.0)
        for depth, key in enumerate(keys)
    ]

    results = {}
    if not args.redis_only:
        results["in_process"] = _measure(MemoryIndex(), entries, tokens, keys, extra, args)
        results["served"] = _measure_served(entries, tokens, keys, extra, args)
    prefix = f"sluice:bench:{uuid.uuid4().hex}"
    client = redis.Redis.from_url(args.redis_url)
    try:
        client.ping()
    except redis.ConnectionError:
        results["redis"] = "skipped: Redis is not reachable at " + args.redis_url
    else:
        try:
            results["redis"] = _measure(RedisIndex(client, prefix), entries, tokens, keys, extra, args)
        finally:
            for key in client.scan_iter(f"{prefix}*"):
                client.delete(key)
    summary = {}
    if args.across_namespaces and isinstance(results.get("redis"), dict):
        results["redis_across_namespaces"] = _across_namespaces(args)
        summary["across_over_localhost"] = {
            timing: round(results["redis_across_namespaces"][timing] / results["redis"][timing], 3)
            for timing in ("token_ids_to_hit", "index_walk_only")
        }
    print(
        json.dumps(
            {
                "benchmark": "prefix_match",
                "blocks": args.blocks,
                "block_tokens": args.block_tokens,
                "tokens": len(tokens),
                "median_ms": results,
                **summary,
            },
            indent=2,
        )
    )


def _across_namespaces(args) -> dict[str, float]:
    """This benchmark's Redis timings from a process in another network namespace."""
    # Imported here: only this mode needs the test harness (and root).
    from tests.e2e.netns import VirtualNetwork

    with VirtualNetwork(["bench-client"]) as network:
        address, port = network.forward(urlsplit(args.redis_url).port or 6379)
        command = [sys.executable, "-m", "bench.prefix_match", "--redis-only"]
        command += [f"--blocks={args.blocks}", f"--block-tokens={args.block_tokens}", f"--repeats={args.repeats}"]
        command.append(f"--redis-url=redis://{address}:{port}{urlsplit(args.redis_url).path or '/0'}")
        completed = subprocess.run(
            network.hosts["bench-client"].argv(command), capture_output=True, text=True, check=True, env=os.environ
        )
    return json.loads(completed.stdout)["median_ms"]["redis"]


def _measure_served(entries, tokens, keys, extra: bytes, args) -> dict[str, float]:
    """The index a store GC process (python -m workers.kvstore.gc_process) serves, on an empty store."""
    with tempfile.TemporaryDirectory(prefix="kvbench-") as runtime:
        endpoint = f"ipc://{runtime}/index"
        command = [sys.executable, "-m", "workers.kvstore.gc_process", f"--kv-store={runtime}/store"]
        command += [f"--serve-index={endpoint}", "--kv-gc-interval=3600"]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while not Path(runtime, "index").exists():
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the store's GC process did not serve its index")
                time.sleep(0.05)
            return _measure(RemoteIndex(endpoint), entries, tokens, keys, extra, args)
        finally:
            process.terminate()
            process.wait()


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
