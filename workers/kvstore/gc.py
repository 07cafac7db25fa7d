"""The store's garbage collector: TTL expiry per traffic class, then watermark eviction.

One `collect()` run:
1. Expiry: per class, blocks last accessed more than `ttl_for(class)` ago, in batches, oldest first;
   a block a client's hint retains until later stays (workers.kvstore.index).
2. Eviction: only when usage is above the high watermark, down to the low watermark, victims chosen
   by the eviction policy from a snapshot of the index, which remembers their uses (a block written
   again soon after is known as one used before; workers.kvstore.index). The gap between the two watermarks turns a
   steady trickle of writes into occasional batch evictions instead of one eviction per write.

Removal order is index entry first, then data: a reader that matched the key just before finds no
data and recomputes, which is safe; the other order would let a reader match a key whose data is gone
for good. The data deleter gets exactly the keys the index reported removed, so when two collectors
race on the same index (several hosts sharing a Redis index) each block's data is deleted once.

The collector keeps no state between runs besides its configuration, so it can live in a worker
thread (`run_forever` with a threading.Event) or in a process of its own beside a shared index.
"""

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

import msgspec

from workers.kvstore.eviction import EvictionPolicy, get_policy
from workers.kvstore.index import BlockEntry, BlockIndex, IndexUsage
from workers.kvstore.ttl import TTLPolicy

logger = logging.getLogger(__name__)


class GCReport(msgspec.Struct, frozen=True, kw_only=True):
    expired: dict[str, int]  # blocks removed for age, by traffic class (classes with none are left out)
    evicted: int  # blocks removed by the eviction policy
    bytes_freed: int
    usage_before: IndexUsage
    usage_after: IndexUsage


class GarbageCollector:
    def __init__(
        self,
        index: BlockIndex,
        ttl: TTLPolicy,
        policy: EvictionPolicy | str,
        *,
        capacity_bytes: int,
        low_watermark: float = 0.8,
        high_watermark: float = 0.95,
        delete_data: Callable[[list[bytes]], object],
        clock: Callable[[], float] = time.time,
        expire_batch: int = 1000,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if not 0 < low_watermark <= high_watermark <= 1:
            raise ValueError(
                f"watermarks must satisfy 0 < low <= high <= 1, got low={low_watermark}, high={high_watermark}"
            )
        if expire_batch <= 0:
            raise ValueError(f"expire_batch must be positive, got {expire_batch}")
        self._index = index
        self._ttl = ttl
        self._policy = get_policy(policy) if isinstance(policy, str) else policy
        self.capacity_bytes = capacity_bytes
        self.low_watermark = low_watermark
        self.high_watermark = high_watermark
        self._high_bytes = high_watermark * capacity_bytes
        self._low_bytes = low_watermark * capacity_bytes
        self._delete_data = delete_data
        self._clock = clock
        self._expire_batch = expire_batch
        # Blocks this collector removed since it was made, by reason: for heartbeats and /metrics.
        self.evicted_expired = 0
        self.evicted_capacity = 0

    def set_ttl_policy(self, ttl: TTLPolicy) -> None:
        """Use `ttl` from the next run on (a run in progress finishes with the policy it started with)."""
        self._ttl = ttl

    def collect(self) -> GCReport:
        now = self._clock()
        ttl = self._ttl
        usage_before = self._index.usage()
        expired: dict[str, int] = {}
        bytes_freed = 0
        for traffic_class in sorted(self._index.traffic_classes()):
            removed = self._expire_class(traffic_class, now - ttl.ttl_for(traffic_class), now)
            if removed:
                expired[traffic_class] = len(removed)
                self.evicted_expired += len(removed)
                bytes_freed += sum(entry.size for entry in removed)
        evicted = 0
        usage = self._index.usage()
        if usage.num_bytes > self._high_bytes:
            while usage.num_bytes > self._low_bytes:
                bytes_to_free = math.ceil(usage.num_bytes - self._low_bytes)
                victims = self._policy.select_victims(self._index.entries(), bytes_to_free, now)
                removed = self._remove(victims, remember=True)
                if not removed:
                    break
                evicted += len(removed)
                self.evicted_capacity += len(removed)
                bytes_freed += sum(entry.size for entry in removed)
                # Writers may have added blocks meanwhile: check again rather than trust the arithmetic.
                usage = self._index.usage()
        report = GCReport(
            expired=expired, evicted=evicted, bytes_freed=bytes_freed, usage_before=usage_before, usage_after=usage
        )
        if expired or evicted:
            logger.debug("kv store gc: %s", report)
        return report

    def run_forever(self, stop: threading.Event, interval_s: float) -> None:
        """Collect every `interval_s` seconds until `stop` is set; a failed run is logged, not fatal,
        so a transient index or disk error does not leave the store growing unchecked."""
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        while not stop.is_set():
            try:
                self.collect()
            except Exception:
                logger.exception("kv store gc run failed")
            stop.wait(interval_s)

    def _expire_class(self, traffic_class: str, cutoff: float, now: float) -> list[BlockEntry]:
        removed: list[BlockEntry] = []
        while True:
            batch = self._index.expired(traffic_class, cutoff, self._expire_batch, now=now)
            removed += self._remove(batch)
            if len(batch) < self._expire_batch:
                return removed

    def _remove(self, entries: Sequence[BlockEntry], *, remember: bool = False) -> list[BlockEntry]:
        if not entries:
            return []
        removed = self._index.remove([entry.key for entry in entries], remember=remember)
        if removed:
            self._delete_data([entry.key for entry in removed])
        return removed
