"""What the global KV store keeps per block for each model shape of bench.shapes, measured on disk, in
each KV storage dtype; and, on a Mooncake-format trace, what a store of equal bytes holds and hits:

    python -m bench.kv_store_bytes [--shapes deepseek_v2_lite,llama3_8b] [--block-tokens 128]
        [--kv-cache-dtypes auto,fp8] [--trace ../shared/data/mooncake_synthetic_trace.jsonl]

For each shape and KV dtype (--kv-cache-dtype: auto keeps bf16, fp8 stores e4m3 rows with their
scales) its KV cache spec gives the bytes per token per layer and a block's payload; one block of
random KV of that layout is written through the store (workers.kvstore) into a fresh directory and
its file's size read back, header and metadata included.

With --trace, per shape: a store of `--capacity-share` of the trace's unique blocks at the first
dtype's file size (bytes, not blocks), the blocks each dtype's files fit in those bytes, and the hit
rate of the store's index, GC and `--policy` holding that many blocks through the trace (as
bench.trace_replay replays it, re-blocked to --block-tokens).

Prints one JSON object with each row's figures and every row's block size over the first one's.
"""

import argparse
import json
import tempfile
from pathlib import Path

import torch

from bench.shapes import SHAPES, kv_specs
from bench.trace_replay import load_chains, replay_policy
from workers.kvstore.block_hash import hash_chain
from workers.kvstore.store import open_store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="deepseek_v2_lite,llama3_8b,qwen3_30b_a3b_16_layers,deepseek_v3")
    parser.add_argument("--block-tokens", type=int, default=128)
    parser.add_argument("--kv-cache-dtypes", default="auto", help="comma-separated --kv-cache-dtype values")
    parser.add_argument("--trace", type=Path, help="Mooncake-format JSONL trace for the equal-bytes hit rates")
    parser.add_argument("--capacity-share", type=float, default=0.05, help="of the trace's unique blocks")
    parser.add_argument("--policy", default="best", help="eviction policy (workers.kvstore.eviction)")
    args = parser.parse_args()
    kv_dtypes = args.kv_cache_dtypes.split(",")
    rows = [_measure(name, args.block_tokens, kv_dtype) for name in args.shapes.split(",") for kv_dtype in kv_dtypes]
    first = rows[0]["file_bytes"]
    for row in rows:
        row["file_bytes_over_first"] = round(row["file_bytes"] / first, 3)
    result = {"benchmark": "kv_store_bytes", "block_tokens": args.block_tokens, "shapes": rows}
    if args.trace:
        result["equal_bytes"] = _equal_bytes(rows, args)
    print(json.dumps(result, indent=2))


def _measure(name: str, block_tokens: int, kv_cache_dtype: str) -> dict:
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    spec = kv_specs(name, kv_cache_dtype=kv_cache_dtype).groups[0]  # what the store keeps: the first group
    values = torch.randn(spec.run_shape(block_tokens), generator=torch.Generator().manual_seed(0))
    if spec.fp8:  # random bytes would make NaN scales; the bytes' count is what matters
        values = values.abs()
    block = values.to(spec.storage_dtype)
    payload = block.view(torch.uint8).numpy().tobytes()
    (key,) = hash_chain(list(range(block_tokens)), block_tokens)
    with tempfile.TemporaryDirectory() as directory:
        store = open_store(Path(directory))
        store.write(key, payload, depth=1, traffic_class="bench", layout=spec.layout)
        (path,) = [p for p in Path(directory).rglob("*") if p.is_file()]
        file_bytes = path.stat().st_size
    return {
        "shape": name,
        "kv_cache_dtype": kv_cache_dtype,
        "kv_layout": spec.layout,
        "bytes_per_token_per_layer": spec.bytes_per_token_per_layer,
        "bytes_per_token": spec.bytes_per_token,
        "payload_bytes": len(payload),
        "file_bytes": file_bytes,
    }


def _equal_bytes(rows: list[dict], args: argparse.Namespace) -> list[dict]:
    """Per shape, the blocks a store of one byte budget holds in each KV dtype, and its hit rate."""
    chains = load_chains(args.trace, args.block_tokens)
    unique_blocks = len({key for _, keys in chains for key in keys})
    results = []
    for name in args.shapes.split(","):
        of_shape = [row for row in rows if row["shape"] == name]
        capacity_bytes = round(args.capacity_share * unique_blocks) * of_shape[0]["file_bytes"]
        for row in of_shape:
            blocks = capacity_bytes // row["file_bytes"]
            results.append(
                {
                    "shape": name,
                    "kv_cache_dtype": row["kv_cache_dtype"],
                    "capacity_bytes": capacity_bytes,
                    "blocks_held": blocks,
                    "unique_blocks": unique_blocks,
                    "hit_rate": round(replay_policy(chains, blocks, args.policy), 4),
                }
            )
    return results


if __name__ == "__main__":
    main()
