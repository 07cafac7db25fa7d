"""Eviction policies: which stored blocks the GC removes when the store is over its high watermark.

A policy ranks a snapshot of index entries and holds no state of its own. The GC may run in another
process or on another host than the readers that touch blocks (with the Redis index), so everything
a policy knows must come from what the index records: last access, hit count, depth, size and
creation time. Policies are picked by name (`get_policy`), e.g. from worker configuration.

Both policies evict a block that a client's hint retains (retain_until in the future) only after
every other block. Both break ties the same way: among blocks last accessed at the same time (typically the
blocks of one request) the deepest goes first. Under the chained hash a block can only be hit
together with every block before it, so a chain's tail is worthless once its head is gone, while its
head still serves every prompt that shares only the head.

`lru`: least recent last access first. The baseline.

`slru` (also `best`): a segmented LRU whose segments are derived from the hit count.
- Probation holds blocks never hit since they were written; protected holds blocks hit at least
  once, LRU-ordered, capped at `protected_share` of what the store keeps after the eviction.
- Victims come from probation and from protected blocks beyond the cap, least recent first.
Most written blocks are never read again (a prompt's unique tail, a one-off document); under LRU a
burst of them flushes everything older, including a system prompt shared by thousands of requests
or the history of a conversation that is about to send its next turn. Here such a burst only churns
probation, and blocks that have proven reuse survive it; the cap keeps protected blocks from
squatting forever once their traffic stops, because the cap is filled by recency. The cap is filled
most recent and shallowest first, so a chain that straddles it loses its tail, not its head.
Why the cap is 0.5 rather than the textbook 0.8: a prefix's first reuse comes much later than its
later ones (in the Mooncake trace, a median 150 s from first to second use, 30 s between uses from
the fourth on), so probation needs a large share to keep new blocks long enough to see their first
hit; with a small probation the store degenerates into "whoever was hit first keeps their place".
Segment membership and order are both read from the index, so any process ranks any snapshot the
same way.

What no index-only policy can do: remember a block after it is evicted. A block that comes back
after eviction is indistinguishable from a new one, which caps how far frequency can help (ghost
lists and admission sketches, as in ARC or TinyLFU, need per-key history outside the index).
"""

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

import numpy as np

from workers.kvstore.index import BlockEntry


class Snapshot:
    """An index snapshot as columns, so ranking runs in numpy: a GC pass may see millions of entries."""

    def __init__(self, entries: Iterable[BlockEntry], now: float) -> None:
        self.entries = list(entries)
        count = len(self.entries)
        self.last_access = np.fromiter((entry.last_access for entry in self.entries), np.float64, count)
        self.depth = np.fromiter((entry.depth for entry in self.entries), np.int64, count)
        self.hit_count = np.fromiter((entry.hit_count for entry in self.entries), np.int64, count)
        self.size = np.fromiter((entry.size for entry in self.entries), np.int64, count)
        self.retained = np.fromiter((entry.retain_until > now for entry in self.entries), bool, count)

    def lru_order(self, *, last: np.ndarray | None = None) -> np.ndarray:
        """Indices least recently accessed first, deepest first among equals; entries flagged in
        `last` come after all the others, and retained entries after those."""
        keys = (-self.depth, self.last_access) if last is None else (-self.depth, self.last_access, last)
        return np.lexsort((*keys, self.retained))

    def take(self, order: np.ndarray, bytes_to_free: int) -> list[BlockEntry]:
        """The shortest head of `order` whose sizes reach `bytes_to_free` (all of it if they can't)."""
        if bytes_to_free <= 0:
            return []
        count = int(np.searchsorted(np.cumsum(self.size[order]), bytes_to_free)) + 1
        return [self.entries[i] for i in order[:count]]


class EvictionPolicy(ABC):
    @abstractmethod
    def select_victims(self, entries: Iterable[BlockEntry], bytes_to_free: int, now: float) -> list[BlockEntry]:
        """The entries to remove, in eviction order: the fewest whose sizes reach `bytes_to_free`
        (every entry when all of them together are smaller)."""


class LRUPolicy(EvictionPolicy):
    def select_victims(self, entries: Iterable[BlockEntry], bytes_to_free: int, now: float) -> list[BlockEntry]:
        snapshot = Snapshot(entries, now)
        return snapshot.take(snapshot.lru_order(), bytes_to_free)


class SegmentedLRUPolicy(EvictionPolicy):
    def __init__(self, protected_share: float = 0.5) -> None:
        if not 0 <= protected_share < 1:
            raise ValueError(f"protected_share must be in [0, 1), got {protected_share}")
        self.protected_share = protected_share

    def select_victims(self, entries: Iterable[BlockEntry], bytes_to_free: int, now: float) -> list[BlockEntry]:
        snapshot = Snapshot(entries, now)
        protected = np.flatnonzero(snapshot.hit_count > 0)
        # Most recent first, shallowest first among equals: the order in which protected blocks fill the cap.
        protected = protected[np.lexsort((snapshot.depth[protected], -snapshot.last_access[protected]))]
        budget = self.protected_share * (int(snapshot.size.sum()) - bytes_to_free)
        kept = np.zeros(len(snapshot.entries), dtype=bool)
        kept[protected[np.cumsum(snapshot.size[protected]) <= budget]] = True
        # Blocks within the cap go last. The rest always covers bytes_to_free, since the cap is a share
        # of what stays, so these fall only when everything must go.
        return snapshot.take(snapshot.lru_order(last=kept), bytes_to_free)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "slru": SegmentedLRUPolicy,
    "best": SegmentedLRUPolicy,
}


def get_policy(name: str) -> EvictionPolicy:
    """A new policy with its default settings, by name: "lru", "slru" or "best" (= the best we have)."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}")
    return factory()
