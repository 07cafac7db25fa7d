"""KV store fetch throughput: a chain of 128-token SmolLM2-sized blocks written by the store's own
code (workers/kvstore/store.py, block_files.py: checksummed files, Redis index), then matched and
read back, checksums verified, by a reader on this host and, with `--across-namespaces`, by a reader
on another host (a network namespace reaching Redis over a veth pair and the harness's forwarder,
tests/e2e/netns.py; the directory is shared as a mount would be), in the same run.

    python -m bench.store_fetch [--blocks 64] [--repeats 5] [--across-namespaces]

Both readers find the files in this machine's page cache (the writer just wrote them), so this is
the store's own cost (read, SHA-256, index round trips), not a disk's or a network filesystem's.
Prints one JSON object: median seconds per chain, blocks/s and MB/s per reader, and the ratio.
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

import numpy as np
import redis

from bench.smollm2_config import SMOLLM2_135M_CONFIG
from workers.kvstore.block_hash import hash_chain, namespace_extra
from workers.kvstore.store import open_store

REDIS_URL = "redis://127.0.0.1:6379/0"
BYTES_PER_VALUE = 4  # float32, the CPU engine's KV dtype


def block_bytes(block_tokens: int) -> int:
    """One block's K and V for every layer of SmolLM2-135M."""
    c = SMOLLM2_135M_CONFIG
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * block_tokens * BYTES_PER_VALUE


def chain_keys(blocks: int, block_tokens: int) -> list[bytes]:
    tokens = np.random.default_rng(0).integers(0, 49152, blocks * block_tokens, dtype=np.int32)
    return hash_chain(tokens, block_tokens, namespace_extra("bench-model:float32", "tenant"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--redis-url", default=REDIS_URL)
    parser.add_argument("--across-namespaces", action="store_true", help="also read from another network namespace")
    parser.add_argument("--read", metavar="DIRECTORY", help="only read the chain stored there (index: --prefix)")
    parser.add_argument("--prefix", default="")
    args = parser.parse_args()
    if args.read:
        print(json.dumps(_read(args.read, f"{args.redis_url}?prefix={args.prefix}", args)))
        return
    prefix = f"sluice:bench-fetch:{uuid.uuid4().hex}"
    index_url = f"{args.redis_url}?prefix={prefix}"
    client = redis.Redis.from_url(args.redis_url)
    try:
        with tempfile.TemporaryDirectory(prefix="sluice-fetch-") as directory:
            store = open_store(directory, index_url)
            rng = np.random.default_rng(1)
            for depth, key in enumerate(chain_keys(args.blocks, args.block_tokens)):
                payload = rng.integers(0, 256, block_bytes(args.block_tokens), dtype=np.uint8)
                store.write(key, payload.data, depth=depth, traffic_class="chat")
            readers = {"this_host": _read(directory, index_url, args)}
            if args.across_namespaces:
                readers["other_host"] = _read_across_namespaces(directory, prefix, args)
    finally:
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
    result = {
        "benchmark": "store_fetch",
        "blocks": args.blocks,
        "block_tokens": args.block_tokens,
        "block_bytes": block_bytes(args.block_tokens),
        "readers": readers,
    }
    if "other_host" in readers:
        result["other_over_this_host_seconds"] = round(
            readers["other_host"]["median_chain_s"] / readers["this_host"]["median_chain_s"], 3
        )
    print(json.dumps(result, indent=2))


def _read(directory: str, index_url: str, args) -> dict[str, float]:
    store = open_store(directory, index_url)
    keys = chain_keys(args.blocks, args.block_tokens)
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        matched = store.match(keys)
        payloads = store.read(keys[:matched])
        times.append(time.perf_counter() - started)
        if len(payloads) != args.blocks:
            raise RuntimeError(f"expected all {args.blocks} blocks, read {len(payloads)}")
    median = statistics.median(times)
    return {
        "median_chain_s": round(median, 4),
        "blocks_per_s": round(args.blocks / median, 1),
        "mb_per_s": round(args.blocks * block_bytes(args.block_tokens) / median / 1e6, 1),
    }


def _read_across_namespaces(directory: str, prefix: str, args) -> dict[str, float]:
    # Imported here: only this mode needs the test harness (and root).
    from urllib.parse import urlsplit

    from tests.e2e.netns import VirtualNetwork

    parts = urlsplit(args.redis_url)
    with VirtualNetwork(["fetch-client"]) as network:
        address, port = network.forward(parts.port or 6379)
        command = [sys.executable, "-m", "bench.store_fetch", f"--read={directory}", f"--prefix={prefix}"]
        command += [f"--blocks={args.blocks}", f"--block-tokens={args.block_tokens}", f"--repeats={args.repeats}"]
        command.append(f"--redis-url=redis://{address}:{port}{parts.path or '/0'}")
        completed = subprocess.run(
            network.hosts["fetch-client"].argv(command), capture_output=True, text=True, check=True, env=os.environ
        )
    return json.loads(completed.stdout)


if __name__ == "__main__":
    main()
