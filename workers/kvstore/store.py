"""The KV block store as the engine sees it: block files plus an index of them.

The index answers "how much of this chain is stored" without touching the disk; the files hold the
data and have the last word. Writes go file first, then index, so a crash in between leaves at worst
an orphan file (found again by a rebuild or the GC), never an index entry without data. Reads trust
the file, not the index: a block that turns out missing or corrupt ends the read there, and its
index entry is removed so that later matches stop promising it; the caller recomputes the rest.
"""

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from workers.kvstore.block_files import BlockFiles, BlockLayoutError, BlockMeta
from workers.kvstore.block_hash import BlockHash
from workers.kvstore.holders import HolderIndex, MemoryHolders
from workers.kvstore.index import BlockEntry, BlockIndex
from workers.kvstore.memory_index import MemoryIndex

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

INDEX_URL_HELP = (
    "'memory', 'redis://host:port/db?prefix=...' (rediss:// for TLS) or 'ipc:///path' (the index the store's GC "
    "process serves: manage.py run_kv_gc --serve-index)"
)


class KVStore:
    def __init__(
        self,
        files: BlockFiles,
        index: BlockIndex,
        *,
        clock: Callable[[], float] = time.time,
        fall_back_to_files: bool = False,
    ) -> None:
        """`fall_back_to_files`: the index is this process's alone (in-process) while other processes
        write to the same directory (the embedded default's workers share one store this way), so a
        block the index misses is looked for in the directory and, when its file is there, indexed."""
        self.files = files
        self.index = index
        self.clock = clock
        self.fall_back_to_files = fall_back_to_files

    def match(self, keys: Sequence[BlockHash]) -> int:
        """How many blocks of the chain, from the first, the index holds (or, falling back to files,
        the directory); reads no block data."""
        matched = self.index.match_prefix(keys)
        if not self.fall_back_to_files:
            return matched
        found = []
        for key in keys[matched:]:
            header = self.files.stat(key)
            if header is None:
                break
            meta, size, mtime = header
            found.append(meta.index_entry(key, size, last_access=mtime))
        if found:
            self.index.add(found)
        return matched + len(found)

    def read(
        self,
        keys: Sequence[BlockHash],
        into: Callable[[int], memoryview | None] | None = None,
        *,
        layout: str | None = None,
    ) -> list[memoryview]:
        """The payloads of the chain's blocks in order, up to the first missing or corrupt one, or
        the first of another KV layout than `layout` (which stays stored and indexed, for readers it
        fits); `into` gives the buffer each is read into (BlockFiles.read)."""
        payloads = []
        for key in keys:
            try:
                payload = self.files.read(key, into, layout=layout)
            except BlockLayoutError as refused:
                log.warning("%s: recomputing from there", refused)
                break
            if payload is None:
                self.index.remove([key])
                break
            payloads.append(payload)
        if payloads:
            now = self.clock()
            found = keys[: len(payloads)]
            self.index.touch(found, now)
            for key in found:
                self.files.touch_access(key, now)
        return payloads

    def write(
        self,
        key: BlockHash,
        payload: bytes | memoryview,
        *,
        depth: int,
        traffic_class: str,
        retain_until: float = 0.0,
        new_chain: bool = False,
        layout: str = "",
    ) -> bool:
        """Store a block; False if the index holds it already (the payload is then not written, and
        the block held is retained until `retain_until` if that is later than it was). `new_chain`:
        the request writing it found none of its prompt's blocks stored or cached, which the
        eviction policy reads as weaker evidence of reuse (workers.kvstore.eviction). `layout`: the
        payload's KV layout, recorded in the block's file (BlockMeta.layout)."""
        if self.contains(key):
            self.retain([key], retain_until)
            return False
        now = self.clock()
        meta = BlockMeta(
            traffic_class=traffic_class,
            depth=depth,
            created_at=now,
            retain_until=retain_until,
            new_chain=new_chain,
            layout=layout,
        )
        size = self.files.write(key, payload, meta)
        entry = BlockEntry(
            key=key,
            size=size,
            traffic_class=traffic_class,
            depth=depth,
            created_at=now,
            last_access=now,
            retain_until=retain_until,
            new_chain=new_chain,
        )
        if self.index.add([entry]) == 1:
            return True
        self.retain([key], retain_until)  # another writer indexed it meanwhile
        return False

    def retain(self, keys: Sequence[BlockHash], until: float) -> None:
        """A client's hint: keep these blocks (those present) until at least `until`."""
        if until > 0 and keys:
            self.index.retain(keys, until)

    def contains(self, key: BlockHash) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[BlockHash]) -> list[bool]:
        """Whether each block is stored: one index round trip for all of them (the engine asks once
        per step), then, falling back to files, a look in the directory for each miss."""
        present = self.index.contains_many(keys)
        if self.fall_back_to_files:
            present = [found or self.match([key]) == 1 for key, found in zip(keys, present)]
        return present


def open_index(url: str) -> BlockIndex:
    """An index backend from its URL: 'memory'; a Redis URL whose `prefix` query parameter (default
    'sluice:kv') names the keys, the other query parameters going to redis-py; or the ipc:// endpoint
    where the store's GC process serves its index (workers.kvstore.remote_index)."""
    if url == "memory":
        return MemoryIndex()
    if url.startswith("ipc://"):
        from workers.kvstore.remote_index import RemoteIndex

        return RemoteIndex(url)
    client, prefix = _redis(url)
    from workers.kvstore.redis_index import RedisIndex

    return RedisIndex(client, prefix)


def open_holders(url: str) -> HolderIndex:
    """The SWA holder index (workers.kvstore.holders) beside the block index at `url` (open_index's
    URL): its own in process ('memory'), the one the GC process serves beside its index (ipc://), or
    on the same Redis under the index's prefix + ':swa'."""
    if url == "memory":
        return MemoryHolders()
    if url.startswith("ipc://"):
        from workers.kvstore.remote_holders import RemoteHolders

        return RemoteHolders(url)
    client, prefix = _redis(url)
    from workers.kvstore.redis_holders import RedisHolders

    return RedisHolders(client, f"{prefix}:swa")


def _redis(url: str) -> "tuple[redis.Redis, str]":
    """The Redis client and key prefix of an index URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"unknown KV index URL {url!r}: expected {INDEX_URL_HELP}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    prefixes = [value for name, value in query if name == "prefix"]
    prefix = prefixes[-1] if prefixes else "sluice:kv"
    if not prefix:
        raise ValueError(f"KV index URL {url!r} has an empty prefix: expected {INDEX_URL_HELP}")
    client_url = urlunsplit(parts._replace(query=urlencode([(n, v) for n, v in query if n != "prefix"])))
    # Imported here: only a Redis index needs redis, which the engine's machines may lack.
    import redis

    return redis.Redis.from_url(client_url), prefix


def open_store(directory: Path, index_url: str = "memory", *, fsync: bool = False) -> KVStore:
    """A store on `directory` (created if absent), after clearing temp files left by killed writers.

    An in-process index starts empty, so it is rebuilt from the block files, added oldest access
    first because `MemoryIndex.expired` relies on insertion order; and since other processes may
    write blocks to the same directory meanwhile, its misses fall back to the files. A Redis index
    outlives processes and is shared, so it is used as it is."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = BlockFiles(directory, fsync=fsync)
    files.recover()
    index = open_index(index_url)
    if isinstance(index, MemoryIndex):
        found = sorted(files.scan(), key=lambda block: block[3])
        index.add([meta.index_entry(key, size, last_access=mtime) for key, meta, size, mtime in found])
    return KVStore(files, index, fall_back_to_files=isinstance(index, MemoryIndex))
