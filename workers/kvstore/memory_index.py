"""The in-process block index: the embedded default, for a store used by one process.

Entries sit in a dict; per traffic class an OrderedDict keeps them in order of last access, so the
GC's expiry query walks only what has expired; evicted blocks the index remembers sit in another
OrderedDict, oldest eviction first. Thread-safe: an engine worker's main thread matches
and touches while its store writer adds and its GC removes.
"""

import math
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import msgspec

from workers.kvstore.block_hash import BlockHash
from workers.kvstore.index import REMEMBERED_PER_BLOCK, BlockEntry, BlockIndex, IndexUsage


class MemoryIndex(BlockIndex):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[BlockHash, BlockEntry] = {}
        self._by_access: dict[str, OrderedDict[BlockHash, None]] = {}
        self._num_bytes = 0
        self._remembered: OrderedDict[BlockHash, int] = OrderedDict()  # evicted key -> its uses

    def add(self, entries: Sequence[BlockEntry]) -> int:
        added = 0
        with self._lock:
            for entry in entries:
                if entry.key in self._entries:
                    continue
                uses_before = self._remembered.pop(entry.key, 0)
                if uses_before:
                    entry = msgspec.structs.replace(entry, uses_before=entry.uses_before + uses_before)
                self._entries[entry.key] = entry
                self._by_access.setdefault(entry.traffic_class, OrderedDict())[entry.key] = None
                self._num_bytes += entry.size
                added += 1
        return added

    def get(self, key: BlockHash) -> BlockEntry | None:
        return self._entries.get(key)

    def match_prefix(self, keys: Sequence[BlockHash]) -> int:
        entries = self._entries
        for length, key in enumerate(keys):
            if key not in entries:
                return length
        return len(keys)

    def contains_many(self, keys: Sequence[BlockHash]) -> list[bool]:
        entries = self._entries
        return [key in entries for key in keys]

    def touch(self, keys: Sequence[BlockHash], now: float) -> None:
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    continue
                self._entries[key] = msgspec.structs.replace(
                    entry, last_access=max(entry.last_access, now), hit_count=entry.hit_count + 1
                )
                self._by_access[entry.traffic_class].move_to_end(key)

    def retain(self, keys: Sequence[BlockHash], until: float) -> None:
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and entry.retain_until < until:
                    self._entries[key] = msgspec.structs.replace(entry, retain_until=until)

    def remove(self, keys: Sequence[BlockHash], *, remember: bool = False) -> list[BlockEntry]:
        removed = []
        with self._lock:
            for key in keys:
                entry = self._entries.pop(key, None)
                if entry is None:
                    continue
                order = self._by_access[entry.traffic_class]
                del order[key]
                if not order:
                    del self._by_access[entry.traffic_class]
                self._num_bytes -= entry.size
                removed.append(entry)
                if remember:
                    self._remembered[key] = entry.uses
            while len(self._remembered) > REMEMBERED_PER_BLOCK * len(self._entries):
                self._remembered.popitem(last=False)
        return removed

    def expired(self, traffic_class: str, cutoff: float, limit: int, *, now: float = math.inf) -> list[BlockEntry]:
        found = []
        with self._lock:
            for key in self._by_access.get(traffic_class, ()):
                entry = self._entries[key]
                if entry.last_access > cutoff or len(found) >= limit:
                    break
                if entry.retain_until <= now:
                    found.append(entry)
        return found

    def entries(self) -> Iterator[BlockEntry]:
        with self._lock:
            snapshot = list(self._entries.values())
        return iter(snapshot)

    def usage(self) -> IndexUsage:
        with self._lock:
            return IndexUsage(num_blocks=len(self._entries), num_bytes=self._num_bytes)

    def traffic_classes(self) -> set[str]:
        with self._lock:
            return set(self._by_access)
