"""A writer for test_crash_safety: writes blocks of a few MB through KVStore as fast as it can until
it is killed, printing each block's number once `write` has returned.

    python -m tests.workers.kvstore.crash_writer DIRECTORY INDEX_URL SEED
"""

import sys
from hashlib import blake2b
from pathlib import Path

import numpy as np

from workers.kvstore.store import open_store


def block_key(seed: int, i: int) -> bytes:
    return blake2b(f"{seed}:{i}".encode(), digest_size=16).digest()


def block_payload(key: bytes) -> bytes:
    """1-3 MiB of content derived from the key alone, so a reader can check every byte."""
    seed = int.from_bytes(key[:8], "little")
    return np.random.default_rng(seed).bytes((1 << 20) + seed % (2 << 20))


def main(directory: str, index_url: str, seed: int) -> None:
    store = open_store(Path(directory), index_url)
    print("ready", flush=True)
    i = 0
    while True:
        key = block_key(seed, i)
        store.write(key, block_payload(key), depth=i, traffic_class=("chat", "agent")[i % 2])
        print(i, flush=True)
        i += 1


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
