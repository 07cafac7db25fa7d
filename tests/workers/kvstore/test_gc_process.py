"""The store's GC as a process of its own (`python -m workers.kvstore.gc_process`), with two other real
processes writing and reading the same store, in each of the ways processes share a store: the
in-process index the GC process keeps and serves ("served"), in-process indexes of their own that
the GC process reconciles with the directory ("own"), and the Redis index ("redis").

Whoever wrote and read the blocks, it expires them by TTL (sparing a block a client asked to retain,
where the index records it), evicts down to the low watermark in the policy's order, deletes
checkpoint files no request can resume from, and a block it deletes under a reader is a clean miss
for that reader.
"""

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from hashlib import blake2b
from pathlib import Path

import pytest

from tests.waiting import wait_until
from tests.workers.kvstore.conftest import REDIS_URL
from tests.workers.kvstore.store_client import StoreClient, payload
from workers.kvstore.block_files import BlockFiles, BlockMeta
from workers.kvstore.checkpoint_files import FOLDER, SUFFIX
from workers.kvstore.gc_process import StoreGC, StoreGCConfig, StoreGCReport
from workers.kvstore.ttl import TTLPolicy

MODES = ["served", "own", "redis"]
# Chat blocks expire two seconds after their last access (the steps of a test that need one to be there
# take milliseconds); agent blocks outlive the test.
TTL = TTLPolicy(ttl_s={"chat": 2.0, "agent": 86_400.0}, default_class="agent")


def key(name: str) -> bytes:
    return blake2b(name.encode(), digest_size=16).digest()


def block_file_size() -> int:
    """What one of the clients' blocks takes on disk (they all have one payload size and meta layout)."""
    with tempfile.TemporaryDirectory() as scratch:
        return BlockFiles(Path(scratch)).write(
            key("x"), payload(key("x")), BlockMeta(traffic_class="agent", depth=3, created_at=time.time())
        )


@dataclass
class Store:
    directory: Path
    client_index: str  # what the other processes open the store with
    gc_options: list[str]  # how the GC process shares it
    log: Path

    def blocks(self) -> set[bytes]:
        return {bytes.fromhex(path.stem) for path in self.directory.rglob("*.blk")}


@pytest.fixture(params=MODES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    runtime = Path(tempfile.mkdtemp(prefix="kvgc-"))  # ipc paths must be short
    directory = tmp_path / "kvstore"
    if request.param == "served":
        endpoint = f"ipc://{runtime}/index"
        client_index, gc_options = endpoint, ["--kv-store-index=memory", f"--serve-index={endpoint}"]
    elif request.param == "own":
        client_index, gc_options = "memory", ["--kv-store-index=memory"]
    else:
        client_index = f"{REDIS_URL}?prefix={request.getfixturevalue('redis_prefix')}"
        gc_options = [f"--kv-store-index={client_index}"]
    yield Store(directory, client_index, gc_options, tmp_path / "gc.log")
    shutil.rmtree(runtime)


def read_a_head_then_fill(a: StoreClient, b: StoreClient) -> None:
    """a writes two blocks that b reads, then a's chain goes on to five blocks and b writes five of its own."""
    a.write(key("a0"), 0)
    a.write(key("a1"), 1)
    assert b.read([key("a0"), key("a1")]) == 2
    for depth in range(2, 5):
        a.write(key(f"a{depth}"), depth)
    for depth in range(5):
        b.write(key(f"b{depth}"), depth)


class GCProcess:
    def __init__(self, store: Store, *options: str) -> None:
        self.log = store.log
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workers.kvstore.gc_process",
                f"--kv-store={store.directory}",
                *store.gc_options,
                "--kv-gc-interval=0.1",
                f"--ttl-policy={TTL.to_json().decode()}",
                *options,
            ],
            stdout=open(self.log, "w"),
            stderr=subprocess.STDOUT,
        )
        # Ready once it has built its view (and serves it, if it does).
        wait_until(lambda: "kv store gc kv-gc-" in self.log.read_text() or self.process.poll() is not None)
        assert self.process.poll() is None, self.log.read_text()

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=30)


def test_it_expires_evicts_in_the_policy_order_and_removes_stale_checkpoints(store: Store) -> None:
    # given a GC process whose capacity eleven blocks pass (ten agent blocks and a retained chat one)
    capacity = math.ceil(11 * block_file_size() / 0.96)
    gc = GCProcess(store, f"--kv-store-capacity-bytes={capacity}", "--kv-eviction-policy=best")
    a, b = StoreClient(store.directory, store.client_index), StoreClient(store.directory, store.client_index)
    try:
        # when chat blocks pass their TTL, one of them retained by a client, beside checkpoint files
        a.write(key("chat-0"), 0, "chat")
        a.write(key("chat-1"), 0, "chat", retain_until=time.time() + 3600)
        checkpoints = store.directory / FOLDER
        checkpoints.mkdir()
        stale, fresh = checkpoints / f"stale{SUFFIX}", checkpoints / f"fresh{SUFFIX}"
        left_by_a_killed_writer = checkpoints / f".fresh.{os.getpid()}.0a1b2c3d.tmp"
        for path in (stale, fresh, left_by_a_killed_writer):
            path.write_bytes(b"SKVC")
        os.utime(stale, (time.time() - 7200, time.time() - 7200))
        os.utime(left_by_a_killed_writer, (time.time() - 600, time.time() - 600))
        wait_until(lambda: key("chat-0") not in store.blocks() and not stale.exists())

        # then the expired block is gone, the retained one stays (its hint is in the block file, so a
        # GC beside processes with indexes of their own spares it too), and of the checkpoints only the
        # fresh one is left
        assert store.blocks() == {key("chat-1")}
        assert sorted(checkpoints.iterdir()) == [fresh]

        # when a reads its chain's head, writes on, and b's chain fills the store past its high watermark
        read_a_head_then_fill(a, b)

        # then it evicts down to the low watermark: the two least recent blocks never hit (the
        # segmented LRU keeps a0 and a1, which b read, though they are older)
        survivors = {key(f"a{i}") for i in (0, 1, 4)} | {key(f"b{i}") for i in range(5)} | {key("chat-1")}
        wait_until(lambda: store.blocks() == survivors)
        # in one run, whose report the GC logs once the files are gone
        wait_until(lambda: "evicted 2," in gc.log.read_text(), timeout_s=10)
        assert store.blocks() == survivors
    finally:
        assert a.close() == 0 and b.close() == 0
        assert gc.stop() == 0


@pytest.mark.parametrize("store", ["served"], indirect=True)  # the other ways of sharing: the test above
def test_lru_evicts_the_least_recent_blocks_whoever_read_them(store: Store) -> None:
    # given a GC process with the LRU policy and room for not quite ten blocks
    capacity = math.ceil(10 * block_file_size() / 0.96)
    gc = GCProcess(store, f"--kv-store-capacity-bytes={capacity}", "--kv-eviction-policy=lru")
    a, b = StoreClient(store.directory, store.client_index), StoreClient(store.directory, store.client_index)
    try:
        # when b reads a's first blocks before a writes on, then fills the store
        read_a_head_then_fill(a, b)

        # then the blocks read longest ago go first, hits or not
        wait_until(lambda: store.blocks() == {key(f"a{i}") for i in (2, 3, 4)} | {key(f"b{i}") for i in range(5)})
    finally:
        assert a.close() == 0 and b.close() == 0
        assert gc.stop() == 0


def test_a_block_it_deletes_under_a_reader_is_a_clean_miss_there(store: Store) -> None:
    # given a chain that b has matched whole, whose middle block is a chat block about to expire
    gc = GCProcess(store)
    a, b = StoreClient(store.directory, store.client_index), StoreClient(store.directory, store.client_index)
    chain = [key("k0"), key("k1"), key("k2")]
    try:
        a.write(chain[0], 0)
        a.write(chain[1], 1, "chat")
        a.write(chain[2], 2)
        assert b.match(chain) == 3

        # when the GC process deletes the middle block
        wait_until(lambda: chain[1] not in store.blocks())

        # then b's read of the chain ends before it, with the block before it intact, and b stops
        # promising the rest
        assert b.read(chain) == 1
        assert b.match(chain) == 1
    finally:
        assert a.close() == 0 and b.close() == 0
        assert gc.stop() == 0


def test_a_block_file_deleted_after_a_reader_opened_it_is_still_read_whole(tmp_path: Path, monkeypatch) -> None:
    # given a block and a reader that has just opened its file
    files = BlockFiles(tmp_path)
    k = key("open")
    files.write(k, payload(k), BlockMeta(traffic_class="chat", depth=0, created_at=time.time()))
    real_fstat = os.fstat

    def deleted_once_open(fd: int) -> os.stat_result:
        files.delete([k])  # what the GC does, between the reader's open and its read
        return real_fstat(fd)

    monkeypatch.setattr("workers.kvstore.block_files.os.fstat", deleted_once_open)

    # when it reads on
    read = files.read(k)

    # then it gets the whole block, checksum checked, and the next reader finds none
    assert bytes(read) == payload(k)
    assert not files.path(k).exists()
    assert files.read(k) is None


def test_bad_settings_are_refused_in_one_line(tmp_path: Path) -> None:
    def run(*options: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "workers.kvstore.gc_process", f"--kv-store={tmp_path}", *options],
            capture_output=True,
            text=True,
            timeout=60,
        )

    for options, problem in [
        (["--kv-gc-interval=0"], "the GC interval must be positive"),
        (["--serve-index=tcp://127.0.0.1:5000"], "ipc:// endpoints only"),
        (["--kv-store-index=redis://127.0.0.1:6379/0", "--serve-index=ipc:///tmp/x"], "needs --kv-store-index memory"),
        (["--kv-store-index=ipc:///tmp/x"], "not one it reads"),
        (['--ttl-policy={"ttl_s": {"chat": -1}}'], "invalid TTL policy"),
    ]:
        completed = run(*options)
        assert completed.returncode == 2, (options, completed.stderr)
        assert problem in completed.stderr.splitlines()[-1], completed.stderr
        assert "Traceback" not in completed.stderr


def test_its_report_counts_what_it_removed(tmp_path: Path) -> None:
    # given a store GC in this process, on its own clock, and three chat blocks
    reports: list[StoreGCReport] = []
    now = [1_800_000_000.0]
    files = BlockFiles(tmp_path)
    sizes = [
        files.write(key(f"r{i}"), payload(key(f"r{i}")), BlockMeta(traffic_class="chat", depth=i, created_at=now[0]))
        for i in range(3)
    ]
    store_gc = StoreGC(
        StoreGCConfig(store=str(tmp_path), ttl_policy=TTL, gc_id="gc-test"),
        on_report=reports.append,
        clock=lambda: now[0],
    )

    # when their TTL has passed
    now[0] += TTL.ttl_for("chat") + 1
    report = store_gc.run_once()

    # then
    assert reports == [report]
    assert (report.gc_id, report.evicted_expired, report.evicted_capacity) == ("gc-test", 3, 0)
    assert (report.num_blocks, report.num_bytes, report.bytes_freed) == (0, 0, sum(sizes))
    assert report.reported_at == now[0] and report.index_kind == "memory"
    assert list(tmp_path.rglob("*.blk")) == []
