"""What the global KV store keeps per block for each model shape of bench.shapes, measured on disk:

    python -m bench.kv_store_bytes [--shapes deepseek_v2_lite,llama3_8b] [--block-tokens 128]

For each shape its KV cache spec (bf16) gives the bytes per token per layer and a block's payload;
one block of random KV of that layout is written through the store (workers.kvstore) into a fresh
directory and its file's size read back, header and metadata included. Prints one JSON object with
each shape's figures and every shape's block size over the first one's.
"""

import argparse
import json
import tempfile
from pathlib import Path

import torch

from bench.shapes import SHAPES, kv_specs
from workers.kvstore.block_hash import hash_chain
from workers.kvstore.store import open_store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="deepseek_v2_lite,llama3_8b,qwen3_30b_a3b_16_layers,deepseek_v3")
    parser.add_argument("--block-tokens", type=int, default=128)
    args = parser.parse_args()
    rows = [_measure(name, args.block_tokens) for name in args.shapes.split(",")]
    first = rows[0]["file_bytes"]
    for row in rows:
        row["file_bytes_over_first"] = round(row["file_bytes"] / first, 3)
    print(json.dumps({"benchmark": "kv_store_bytes", "block_tokens": args.block_tokens, "shapes": rows}, indent=2))


def _measure(name: str, block_tokens: int) -> dict:
    if name not in SHAPES:
        raise SystemExit(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    (spec,) = kv_specs(name).groups
    block = torch.randn(spec.run_shape(block_tokens), generator=torch.Generator().manual_seed(0)).to(spec.dtype)
    payload = block.view(torch.uint8).numpy().tobytes()
    (key,) = hash_chain(list(range(block_tokens)), block_tokens)
    with tempfile.TemporaryDirectory() as directory:
        store = open_store(Path(directory))
        store.write(key, payload, depth=1, traffic_class="bench", layout=spec.layout)
        (path,) = [p for p in Path(directory).rglob("*") if p.is_file()]
        file_bytes = path.stat().st_size
    return {
        "shape": name,
        "kv_layout": spec.layout,
        "bytes_per_token_per_layer": spec.bytes_per_token_per_layer,
        "bytes_per_token": spec.bytes_per_token,
        "payload_bytes": len(payload),
        "file_bytes": file_bytes,
    }


if __name__ == "__main__":
    main()
