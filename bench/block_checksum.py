"""The KV store's block checksum, version 1 (SHA-256) against version 2 (CRC-32), in one run:

    python -m bench.block_checksum [--blocks 62] [--block-tokens 128] [--repeats 5]

For a chain of SmolLM2-sized blocks (62 of 128 tokens is what a resume of an 8,000-token request
fetches): the checksum alone over the payloads, and whole block reads through BlockFiles.read (into
a new buffer each, as the engine reads them into its block tensors) of files written in each
format. The files are in the page cache (just written), so this is the store's own cost. Prints one
JSON object: median seconds per chain and GB/s for each, and the ratios version 2 / version 1.
"""

import argparse
import hashlib
import json
import statistics
import struct
import tempfile
import time
import zlib
from pathlib import Path

import msgspec
import numpy as np

from bench.store_fetch import block_bytes, chain_keys
from workers.kvstore.block_files import BlockFiles, BlockMeta

META = BlockMeta(traffic_class="chat", depth=0, created_at=0.0)


def write_version_1(files: BlockFiles, key: bytes, payload: bytes) -> None:
    """A block file as version 1 writes it: the first 16 bytes of SHA-256 over meta + payload."""
    meta = msgspec.msgpack.encode({"key": key, "meta": msgspec.to_builtins(META)})
    checksum = hashlib.sha256(meta + payload).digest()[:16]
    path = files.path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<4sHIQ16s", b"SKVB", 1, len(meta), len(payload), checksum) + meta + payload)


def timed(work, repeats: int) -> float:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=62)
    parser.add_argument("--block-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    size = block_bytes(args.block_tokens)
    keys = chain_keys(args.blocks, args.block_tokens)
    payloads = [np.random.default_rng(i).bytes(size) for i in range(args.blocks)]
    total = size * args.blocks
    result = {"benchmark": "block_checksum", "blocks": args.blocks, "block_bytes": size, "repeats": args.repeats}

    def sha256_all() -> None:
        for payload in payloads:
            hashlib.sha256(payload).digest()

    def crc32_all() -> None:
        for payload in payloads:
            zlib.crc32(payload)

    with tempfile.TemporaryDirectory(prefix="sluice-checksum-") as directory:
        v1, v2 = BlockFiles(Path(directory) / "v1"), BlockFiles(Path(directory) / "v2")
        for key, payload in zip(keys, payloads, strict=True):
            write_version_1(v1, key, payload)
            v2.write(key, payload, META)

        def read_all(files: BlockFiles):
            def read() -> None:
                for key in keys:
                    assert files.read(key, into=lambda n: memoryview(bytearray(n))) is not None

            return read

        for name, work in (
            ("checksum_v1_sha256", sha256_all),
            ("checksum_v2_crc32", crc32_all),
            ("read_v1_sha256", read_all(v1)),
            ("read_v2_crc32", read_all(v2)),
        ):
            seconds = timed(work, args.repeats)
            result[name] = {"seconds": round(seconds, 4), "gb_per_s": round(total / seconds / 1e9, 2)}
    result["checksum_v2_over_v1"] = round(
        result["checksum_v2_crc32"]["seconds"] / result["checksum_v1_sha256"]["seconds"], 3
    )
    result["read_v2_over_v1"] = round(result["read_v2_crc32"]["seconds"] / result["read_v1_sha256"]["seconds"], 3)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
