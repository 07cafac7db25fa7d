"""Block files: round trip, every kind of bad file read as a miss and deleted, scan, recover, and
many processes writing and reading the same directory."""

import logging
import multiprocessing
import os
import random
import struct
import time
from collections.abc import Callable
from hashlib import blake2b, sha256
from pathlib import Path

import msgspec
import numpy as np
import pytest

from workers.kvstore.block_files import BlockFiles, BlockLayoutError, BlockMeta

META = BlockMeta(traffic_class="chat", depth=3, created_at=1_700_000_000.5)


def key(i: int) -> bytes:
    return blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def payload(k: bytes, size: int = 4096) -> bytes:
    """Deterministic content per key, so any reader can check what it got."""
    return np.random.default_rng(int.from_bytes(k[:8], "little")).bytes(size)


@pytest.fixture
def files(tmp_path: Path) -> BlockFiles:
    return BlockFiles(tmp_path / "blocks")


@pytest.mark.parametrize("fsync", [False, True])
def test_round_trip(tmp_path: Path, fsync: bool) -> None:
    files = BlockFiles(tmp_path, fsync=fsync)
    k = key(1)
    size = files.write(k, payload(k), META)

    path = files.path(k)
    assert path == tmp_path / k.hex()[:2] / k.hex()[2:4] / f"{k.hex()}.blk"
    assert size == path.stat().st_size > 4096
    assert files.read(k) == payload(k)
    assert files.read(key(2)) is None


def test_write_accepts_a_numpy_buffer_and_an_empty_payload(files: BlockFiles) -> None:
    array = np.arange(1000, dtype=np.float32)
    files.write(key(1), array.view(np.uint8).data, META)
    files.write(key(2), b"", META)
    assert np.frombuffer(files.read(key(1)), dtype=np.float32).tolist() == array.tolist()
    assert bytes(files.read(key(2))) == b""


def test_a_payload_is_read_into_the_buffer_the_reader_names_or_not_at_all(files: BlockFiles) -> None:
    k = key(1)
    files.write(k, payload(k), META)
    buffer = np.zeros(4096, dtype=np.uint8)

    got = files.read(k, into=lambda size: memoryview(buffer) if size == buffer.nbytes else None)

    assert got.obj is buffer and buffer.tobytes() == payload(k)
    # a reader that wants no payload of that size gets a miss, and the sound file stays
    assert files.read(k, into=lambda size: None) is None
    assert files.read(k) == payload(k)


def version_1_file(files: BlockFiles, k: bytes, data: bytes) -> Path:
    """A block file as version 1 wrote it: the first 16 bytes of SHA-256 over meta + payload."""
    meta = msgspec.msgpack.encode({"key": k, "meta": msgspec.to_builtins(META)})
    checksum = sha256(meta + data).digest()[:16]
    path = files.path(k)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<4sHIQ16s", b"SKVB", 1, len(meta), len(data), checksum) + meta + data)
    return path


def test_a_version_1_file_is_still_read_and_its_corruption_still_caught(files: BlockFiles) -> None:
    k = key(1)
    path = version_1_file(files, k, payload(k))
    assert files.read(k) == payload(k)
    assert [found for found, *_ in files.scan()] == [k]

    flip_byte(-100)(path)

    assert files.read(k) is None and not path.exists()


def test_write_leaves_an_existing_file(files: BlockFiles) -> None:
    k = key(1)
    size = files.write(k, payload(k), META)
    assert files.write(k, b"other bytes", META) == size
    assert files.read(k) == payload(k)


def truncate_payload(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


def truncate_header(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:20])


def empty(path: Path) -> None:
    path.write_bytes(b"")


def garbage(path: Path) -> None:
    path.write_bytes(random.Random(0).randbytes(5000))


def append_byte(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0")


def flip_byte(offset: int) -> Callable[[Path], None]:
    def flip(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x01
        path.write_bytes(bytes(data))

    return flip


# Header offsets: magic 0-3, version 4-5, meta length 6-9, payload length 10-17, checksum 18-33 (version 2:
# CRC-32 in 18-21), meta 34-.
CORRUPTIONS = {
    "truncated payload": truncate_payload,
    "truncated header": truncate_header,
    "empty": empty,
    "garbage": garbage,
    "extra byte": append_byte,
    "flipped payload byte": flip_byte(-100),
    "flipped magic": flip_byte(0),
    "flipped version": flip_byte(4),
    "flipped meta length": flip_byte(6),
    "flipped payload length": flip_byte(10),
    "flipped checksum": flip_byte(20),
    "flipped metadata": flip_byte(40),
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_a_bad_file_reads_as_a_miss_and_is_deleted(
    files: BlockFiles, corrupt: Callable[[Path], None], caplog: pytest.LogCaptureFixture
) -> None:
    k = key(1)
    files.write(k, payload(k), META)
    corrupt(files.path(k))

    with caplog.at_level(logging.WARNING):
        assert files.read(k) is None
    assert not files.path(k).exists()
    assert "bad KV block file" in caplog.text
    files.write(k, payload(k), META)  # rewritten later, like any miss
    assert files.read(k) == payload(k)


def test_a_file_under_another_keys_name_is_a_miss(files: BlockFiles) -> None:
    files.write(key(1), payload(key(1)), META)
    files.path(key(2)).parent.mkdir(parents=True, exist_ok=True)
    os.replace(files.path(key(1)), files.path(key(2)))

    assert files.read(key(2)) is None
    assert not files.path(key(2)).exists()
    assert list(files.scan()) == []


def test_scan_lists_sound_blocks_and_skips_temp_and_broken_files(files: BlockFiles) -> None:
    good = [key(i) for i in range(3)]
    for depth, k in enumerate(good):
        files.write(k, payload(k), BlockMeta(traffic_class="agent", depth=depth, created_at=float(depth)))
    for i, corrupt in enumerate([truncate_payload, truncate_header, empty, garbage, flip_byte(0)]):
        k = key(100 + i)
        files.write(k, payload(k), META)
        corrupt(files.path(k))
    shard = files.path(good[0]).parent
    (shard / f".{good[0].hex()}.123.abcd.tmp").write_bytes(files.path(good[0]).read_bytes()[:100])
    (shard / "not-hex.blk").write_bytes(files.path(good[0]).read_bytes())

    found = {k: (meta, size, mtime) for k, meta, size, mtime in files.scan()}
    assert set(found) == set(good)
    for depth, k in enumerate(good):
        stat = files.path(k).stat()
        meta = BlockMeta(traffic_class="agent", depth=depth, created_at=float(depth))
        assert found[k] == (meta, stat.st_size, stat.st_mtime)


def test_scan_of_a_missing_directory_is_empty(tmp_path: Path) -> None:
    assert list(BlockFiles(tmp_path / "absent").scan()) == []


def test_recover_deletes_old_temp_files_only(files: BlockFiles) -> None:
    k = key(1)
    files.write(k, payload(k), META)
    shard = files.path(k).parent
    old, young = shard / f".{k.hex()}.1.aaaa.tmp", shard / f".{k.hex()}.2.bbbb.tmp"
    old.write_bytes(b"partial")
    young.write_bytes(b"partial")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))

    assert files.recover(older_than_s=60) == 1
    assert not old.exists() and young.exists()
    assert files.recover(older_than_s=0) == 1
    assert not young.exists()
    assert files.read(k) == payload(k)


def test_delete_and_touch_access(files: BlockFiles) -> None:
    for i in range(3):
        files.write(key(i), payload(key(i)), META)
    files.touch_access(key(0), 1234.5)
    files.touch_access(key(99), 1234.5)  # missing: ignored
    assert files.path(key(0)).stat().st_mtime == 1234.5

    assert files.delete([key(0), key(1), key(99)]) == 2
    assert files.read(key(0)) is None
    assert [k for k, *_ in files.scan()] == [key(2)]


class CountWarnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def hammer(root: str, worker: int, rounds: int) -> tuple[int, int, int]:
    """One process: write, read and delete shared and own keys at random.

    Returns (bad payloads, bad files seen, good reads). With atomic writes a reader never even meets
    a partial file; without them the checksum would still stop a bad payload, so both are counted."""
    warnings = CountWarnings()
    logging.getLogger("workers.kvstore.block_files").addHandler(warnings)
    files = BlockFiles(Path(root))
    rng = random.Random(worker)
    keys = [key(i) for i in range(8)] + [key(100 + 10 * worker + i) for i in range(4)]
    bad = good = 0
    for _ in range(rounds):
        k = rng.choice(keys)
        action = rng.random()
        if action < 0.4:
            files.write(k, payload(k, 1 << 19), META)
        elif action < 0.9:
            data = files.read(k)
            if data is not None:
                good += 1
                bad += data != payload(k, 1 << 19)
        else:
            files.delete([k])
    return bad, warnings.count, good


def test_many_processes_never_see_a_bad_payload(tmp_path: Path) -> None:
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        results = pool.starmap(hammer, [(str(tmp_path), w, 150) for w in range(4)])
    bad_payloads, bad_files, good_reads = map(sum, zip(*results))
    assert (bad_payloads, bad_files) == (0, 0)
    assert good_reads > 0
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_block_of_another_layout_is_refused_clearly_before_its_payload_and_kept(files: BlockFiles) -> None:
    k = key(7)
    files.write(k, payload(k), msgspec.structs.replace(META, layout="full attention of layers 0-2: A"))
    asked: list[int] = []

    def into(size: int) -> memoryview:
        asked.append(size)
        return memoryview(bytearray(size))

    with pytest.raises(BlockLayoutError, match=f"KV block {k.hex()} holds full attention of layers 0-2: A; the re"):
        files.read(k, into, layout="full attention of layers 0-2: B")
    assert asked == [] and files.path(k).exists()  # a sound file, for the readers it fits
    assert bytes(files.read(k, layout="full attention of layers 0-2: A")) == payload(k)
    assert bytes(files.read(k)) == payload(k)  # a reader naming no layout checks none


def test_a_block_written_before_layouts_were_recorded_is_read_by_any_layout(files: BlockFiles) -> None:
    k = key(8)
    files.write(k, payload(k), META)
    assert bytes(files.read(k, layout="full attention of layers 0-2: B")) == payload(k)
