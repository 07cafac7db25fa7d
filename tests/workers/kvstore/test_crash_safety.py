"""Crash safety: a writer killed with SIGKILL at a random moment never leaves the store serving bad
data, and a bad or missing block costs a recompute, not an error."""

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.workers.kvstore.crash_writer import block_key, block_payload
from workers.kvstore.block_files import BlockFiles
from workers.kvstore.memory_index import MemoryIndex
from workers.kvstore.store import KVStore, open_store

REPO_ROOT = Path(__file__).resolve().parents[3]
REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def index_url(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "memory":
        yield "memory"
        return
    prefix = f"test:sluice:kv:{uuid.uuid4().hex}"
    yield f"{REDIS_URL}?prefix={prefix}"
    client = redis.Redis.from_url(REDIS_URL)
    if names := list(client.scan_iter(match=f"{prefix}:*", count=1000)):
        client.delete(*names)
    client.close()


def run_and_kill(directory: Path, index_url: str, seed: int, rng: random.Random) -> list[int]:
    """Start a writer, SIGKILL it at a random moment; returns the blocks whose write returned."""
    writer = subprocess.Popen(
        [sys.executable, "-m", "tests.workers.kvstore.crash_writer", str(directory), index_url, str(seed)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout.readline() == "ready\n"
    time.sleep(rng.uniform(0.0, 0.2))
    os.kill(writer.pid, signal.SIGKILL)
    written = [int(line) for line in writer.stdout]
    assert writer.wait() == -signal.SIGKILL  # killed while still writing, not dead of its own
    return written


@pytest.mark.parametrize(("index_url", "rounds"), [("memory", 15), ("redis", 6)], indirect=["index_url"])
def test_a_writer_killed_mid_write_never_leaves_bad_data(tmp_path: Path, index_url: str, rounds: int) -> None:
    rng = random.Random(1234)
    rounds_with_temp_files = 0
    for seed in range(rounds):
        directory = tmp_path / f"round-{seed}"
        written = run_and_kill(directory, index_url, seed, rng)

        store = open_store(directory, index_url)
        listed = {entry.key for entry in store.index.entries()}
        assert {block_key(seed, i) for i in written} <= listed  # a write that returned survives the kill
        for key in listed:
            assert store.read([key]) == [block_payload(key)]

        rounds_with_temp_files += bool(list(directory.rglob("*.tmp")))
        store.files.recover(older_than_s=0)
        assert not list(directory.rglob("*.tmp"))
        store.index.remove(list(listed))  # a Redis index outlives the round
        store.files.delete(listed)  # keep the disk small
    print(f"{rounds_with_temp_files}/{rounds} rounds were killed mid-write")


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_bad_block_ends_the_read_and_drops_its_index_entry(tmp_path: Path, damage: str) -> None:
    store = KVStore(BlockFiles(tmp_path), MemoryIndex())
    keys = [block_key(99, i) for i in range(5)]
    for depth, key in enumerate(keys):
        store.write(key, block_payload(key)[:4096], depth=depth, traffic_class="chat")
    path = store.files.path(keys[2])
    if damage == "corrupt":
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    else:
        path.unlink()

    assert store.match(keys) == 5
    assert store.read(keys) == [block_payload(key)[:4096] for key in keys[:2]]
    assert store.match(keys) == 2
    assert not store.contains(keys[2])
    assert not path.exists()
    assert store.read(keys[3:]) == [block_payload(key)[:4096] for key in keys[3:]]  # the rest is intact
