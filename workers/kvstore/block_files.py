"""Block data on a directory: one checksummed file per block, written atomically.

The directory may be a local disk or a mount shared by many hosts (CephFS, 3FS, NFS). Nothing here
locks: a writer writes a temp file next to the final path and renames it into place, so a reader
sees either no file or a whole one, and two writers of the same key (same key = same content) race
harmlessly. A writer killed mid-write leaves only a temp file, which `recover()` removes later.

File layout (little-endian):

    magic "SKVB" | version u16 | meta_len u32 | payload_len u64 | checksum 16 B   (the fixed header)
    meta: msgpack of {key, meta: BlockMeta}, meta_len bytes
    payload, payload_len bytes

The checksum covers meta + payload: a fetch verifies every byte it serves, so it is on the path of
every store hit and of every failover. Version 2 files carry a CRC-32 (zlib's, little-endian, in the
first 4 bytes of the field, the rest zero), what storage systems use against accidental corruption
(Ceph's BlueStore, ext4, iSCSI: it catches every error burst up to 32 bits and all but 2^-32 of
random damage), at about twice SHA-256's speed even where the CPU has SHA instructions (3.8 against
1.7 GB/s on this 2-core machine: `python -m bench.block_checksum`). Neither guards against a writer
with access to the store, which no checksum without a key could; the store is trusted storage.
Version 1 files (SHA-256, its first 16 bytes) are still read. The fixed fields the checksum does not
cover are checked on their own (magic, version, and meta_len + payload_len against the file's size).
The key is stored inside the file so that a file under the wrong name is caught. Bad files are
deleted on read: the caller then sees a miss and recomputes, and the block is rewritten later.

The metadata records the KV layout of the payload (workers.engine.kv.spec.KVCacheSpec.layout). A
reader that names its layout gets BlockLayoutError for a block of another one, before its payload is
read; the file is sound, so it stays for the readers it fits. Files written before layouts were
recorded say nothing ("") and are read by anyone, their payload's size still checked by the reader.
The layout names the KV storage too (--kv-cache-dtype): a block written by an FP8-KV worker is
refused by a bf16-KV reader and the other way round, not converted; the reader computes that KV
instead. (Their keys differ anyway, block_hash.kv_model_id; the layout is what guards the bytes.)

A reader may name where the payload goes (`read(key, into=...)`): the engine reads blocks straight
into aligned tensors, with no copy after the read.
"""

import logging
import os
import secrets
import struct
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from hashlib import sha256
from pathlib import Path

import msgspec

from workers.kvstore.block_hash import BlockHash
from workers.kvstore.fsync import fsync_path
from workers.kvstore.index import BlockEntry

log = logging.getLogger(__name__)

MAGIC = b"SKVB"
VERSION = 2  # the version written; READABLE_VERSIONS are read
READABLE_VERSIONS = (1, 2)
CHECKSUM_BYTES = 16
BLOCK_SUFFIX = ".blk"
TEMP_SUFFIX = ".tmp"

_FIXED = struct.Struct(f"<4sHIQ{CHECKSUM_BYTES}s")


class BlockMeta(msgspec.Struct, frozen=True, kw_only=True):
    """What a block file says about itself, enough to rebuild an index entry from the disk alone."""

    traffic_class: str
    depth: int
    created_at: float
    # A cache hint's retain_until when the block was written (later hints extend it in the index
    # only): an index rebuilt from the files, or one that finds the block in the directory, keeps it.
    retain_until: float = 0.0
    # The writing request's prompt shared no full block with a cache (BlockEntry.new_chain), which
    # the eviction policy ranks by: an index rebuilt from the files ranks the block as before.
    new_chain: bool = False
    layout: str = ""  # of the KV in the payload (KVCacheSpec.layout); "" in files older than layouts

    def index_entry(self, key: BlockHash, size: int, *, last_access: float, hit_count: int = 0) -> BlockEntry:
        """The index entry of this block, found in the directory rather than written through the index."""
        return BlockEntry(
            key=key,
            size=size,
            traffic_class=self.traffic_class,
            depth=self.depth,
            created_at=self.created_at,
            last_access=last_access,
            hit_count=hit_count,
            retain_until=self.retain_until,
            new_chain=self.new_chain,
        )


class _FileMeta(msgspec.Struct, frozen=True):
    key: BlockHash
    meta: BlockMeta


_encode_meta = msgspec.msgpack.Encoder().encode
_decode_meta = msgspec.msgpack.Decoder(_FileMeta).decode


class BlockLayoutError(Exception):
    """A sound block whose KV layout is not the reader's: the message names both."""


class BlockFiles:
    def __init__(self, root: Path, *, fsync: bool = False) -> None:
        """`fsync=True` makes a written block survive power loss; surviving a killed process
        needs only the rename, so it is off by default."""
        self.root = Path(root)
        self.fsync = fsync

    def path(self, key: BlockHash) -> Path:
        """`root/ab/cd/<hex>.blk`: two levels of 256 folders keep directories small."""
        name = key.hex()
        return self.root / name[:2] / name[2:4] / f"{name}{BLOCK_SUFFIX}"

    def write(self, key: BlockHash, payload: bytes | memoryview, meta: BlockMeta) -> int:
        """Store the block unless its file exists already; returns the file's size."""
        final = self.path(key)
        try:
            return final.stat().st_size
        except FileNotFoundError:
            pass
        data = memoryview(payload).cast("B")
        meta_bytes = _encode_meta(_FileMeta(key, meta))
        header = _FIXED.pack(MAGIC, VERSION, len(meta_bytes), data.nbytes, _checksum(VERSION, meta_bytes, data))
        temp = final.with_name(f".{final.stem}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
        changed_dirs = self._make_dirs(final.parent)
        try:
            with open(temp, "xb") as f:
                f.write(header)
                f.write(meta_bytes)
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            # The file's mtime is the block's last access (readers touch it): a block nobody read yet
            # has its creation time there, exactly, so the directory alone tells read blocks apart.
            os.utime(temp, (meta.created_at, meta.created_at))
            os.replace(temp, final)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        if self.fsync:
            for directory in (final.parent, *changed_dirs):
                fsync_path(directory)
        return len(header) + len(meta_bytes) + data.nbytes

    def read(
        self, key: BlockHash, into: Callable[[int], memoryview | None] | None = None, *, layout: str | None = None
    ) -> memoryview | None:
        """The block's payload, or None if the file is missing or bad (a bad file is deleted).

        `into(payload_bytes)` gives the writable buffer to read the payload into (None: the caller
        wants no payload of that size, and the read is a miss); by default a new bytearray's.
        `layout`: the reader's; BlockLayoutError if the block records another."""
        path = self.path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                fixed = f.read(_FIXED.size)
                problem = _check_fixed(fixed, size)
                if not problem:
                    _, version, meta_len, payload_len, checksum = _FIXED.unpack(fixed)
                    # A short read leaves zeros, which the checksum rejects.
                    meta = bytearray(meta_len)
                    f.readinto(meta)
                    if layout is not None:
                        _check_layout(key, meta, layout)
                    payload = into(payload_len) if into is not None else memoryview(bytearray(payload_len))
                    if payload is None:
                        return None
                    f.readinto(payload)
                    problem = _verify(key, version, checksum, meta, payload)
        except FileNotFoundError:
            return None
        if problem:
            log.warning("deleting bad KV block file %s: %s", path, problem)
            path.unlink(missing_ok=True)
            return None
        return payload

    def delete(self, keys: Iterable[BlockHash]) -> int:
        """Delete the blocks' files; returns how many existed."""
        deleted = 0
        for key in keys:
            try:
                self.path(key).unlink()
                deleted += 1
            except FileNotFoundError:
                pass
        return deleted

    def touch_access(self, key: BlockHash, now: float) -> None:
        """Record a read in the file's mtime, which is how a rebuilt index learns the last access.
        Best effort: a vanished file, or one another host owns on a shared mount, is left as is."""
        try:
            os.utime(self.path(key), (now, now))
        except OSError:
            pass

    def scan(self) -> Iterator[tuple[BlockHash, BlockMeta, int, float]]:
        """(key, meta, file size, mtime) of every block file whose header and metadata are sound.

        Reads headers only, so the payload checksum is left to `read`; temp files and files with an
        unreadable header are skipped."""
        for path in self._files(BLOCK_SUFFIX):
            try:
                key = bytes.fromhex(path.name[: -len(BLOCK_SUFFIX)])
            except ValueError:
                continue
            found = self._header(path, key)
            if found is not None:
                yield key, *found

    def listing(self) -> Iterator[tuple[BlockHash, int, float]]:
        """(key, file size, mtime) of every block file, from the directory alone: one stat per file,
        no header read (the store's GC lists the whole store each run this way)."""
        for path in self._files(BLOCK_SUFFIX):
            try:
                key = bytes.fromhex(path.name[: -len(BLOCK_SUFFIX)])
                stat = path.stat()
            except (ValueError, FileNotFoundError):
                continue
            yield key, stat.st_size, stat.st_mtime

    def stat(self, key: BlockHash) -> tuple[BlockMeta, int, float] | None:
        """(meta, file size, mtime) of the block's file if it exists with a sound header, else None
        (reads the header only, as `scan` does)."""
        return self._header(self.path(key), key)

    def _header(self, path: Path, key: BlockHash) -> tuple[BlockMeta, int, float] | None:
        try:
            with open(path, "rb") as f:
                stat = os.fstat(f.fileno())
                fixed = f.read(_FIXED.size)
                if len(fixed) < _FIXED.size:
                    return None
                magic, version, meta_len, payload_len, _ = _FIXED.unpack(fixed)
                if (
                    magic != MAGIC
                    or version not in READABLE_VERSIONS
                    or _FIXED.size + meta_len + payload_len != stat.st_size
                ):
                    return None
                file_meta = _decode_meta(f.read(meta_len))
        except (OSError, ValueError, msgspec.DecodeError):
            return None
        return (file_meta.meta, stat.st_size, stat.st_mtime) if file_meta.key == key else None

    def recover(self, older_than_s: float = 60) -> int:
        """Delete temp files older than `older_than_s`: leftovers of writers killed mid-write. Younger
        ones may belong to a writer still running (on this or another host), so they are kept."""
        cutoff = time.time() - older_than_s
        removed = 0
        for path in self._files(TEMP_SUFFIX):
            try:
                if path.stat().st_mtime <= cutoff:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                pass
        return removed

    def _files(self, suffix: str) -> Iterator[Path]:
        """Files ending in `suffix` in the two shard levels under root."""
        for top in _subdirs(self.root):
            for shard in _subdirs(top):
                try:
                    with os.scandir(shard) as it:
                        names = [e.name for e in it if e.name.endswith(suffix)]
                except FileNotFoundError:
                    continue
                for name in names:
                    yield Path(shard) / name

    def _make_dirs(self, directory: Path) -> list[Path]:
        """Create a block's shard folders if absent; returns the folders whose listing changed."""
        if directory.is_dir():
            return []
        changed = [directory.parent] if directory.parent.is_dir() else [directory.parent, directory.parent.parent]
        directory.mkdir(parents=True, exist_ok=True)
        return changed


def _check_fixed(fixed: bytes, size: int) -> str:
    """What is wrong with a file's fixed header, given the file's size; '' when nothing."""
    if len(fixed) < _FIXED.size:
        return f"truncated header ({len(fixed)} bytes)"
    magic, version, meta_len, payload_len, _ = _FIXED.unpack(fixed)
    if magic != MAGIC:
        return f"bad magic {magic!r}"
    if version not in READABLE_VERSIONS:
        return f"unknown format version {version}"
    if _FIXED.size + meta_len + payload_len != size:
        return f"size {size} does not match its header ({_FIXED.size + meta_len + payload_len})"
    return ""


def _check_layout(key: BlockHash, meta: bytearray, layout: str) -> None:
    """BlockLayoutError if the metadata records a layout other than `layout`. Metadata that does not
    decode is left to the checksum."""
    try:
        recorded = _decode_meta(meta).meta.layout
    except msgspec.DecodeError:
        return
    if recorded and recorded != layout:
        raise BlockLayoutError(f"KV block {key.hex()} holds {recorded}; the reader's KV is {layout}")


def _checksum(version: int, meta: bytes | bytearray, payload: memoryview) -> bytes:
    if version == 1:
        digest = sha256(meta)
        digest.update(payload)
        return digest.digest()[:CHECKSUM_BYTES]
    return zlib.crc32(payload, zlib.crc32(meta)).to_bytes(4, "little").ljust(CHECKSUM_BYTES, b"\0")


def _verify(key: BlockHash, version: int, checksum: bytes, meta: bytearray, payload: memoryview) -> str:
    """What is wrong with a file's metadata and payload; '' when nothing."""
    if _checksum(version, meta, payload) != checksum:
        return "checksum mismatch"
    try:
        file_key = _decode_meta(meta).key
    except msgspec.DecodeError as e:
        return f"unreadable metadata ({e})"
    if file_key != key:
        return f"holds block {file_key.hex()}"
    return ""


def _subdirs(directory: Path) -> list[str]:
    try:
        with os.scandir(directory) as it:
            return [e.path for e in it if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []
