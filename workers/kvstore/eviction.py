"""Eviction policies: which stored blocks the GC removes when the store is over its high watermark.

A policy ranks a snapshot of index entries and holds no state of its own. The GC may run in another
process or on another host than the readers that touch blocks (with the Redis index), so everything
a policy knows comes from what the index records: last access, hit count, depth, size, creation
time, whether the writing request started a fresh chain (`new_chain`), and the uses a block had
before an earlier eviction (`uses_before`, which the index remembers for a while; see index.py).
Policies are picked by name (`get_policy`), e.g. from worker configuration. Blocks with a client's
retention hint go after every other block, whatever the policy (`Snapshot.take`).

Every policy breaks ties the same way: among blocks last accessed at the same time (typically the
blocks of one request) the deepest goes first. Under the chained hash a block can only be hit
together with every block before it, so a chain's tail is worthless once its head is gone, while its
head still serves every prompt that shares only the head.

The classics, kept as peers: `lru` (least recent first, the baseline); `slru` (a segmented LRU: hit
blocks are protected up to half of what stays); `gdsf` and `lru_logfreq` (frequency with aging,
recency plus log-frequency; leaf first by the tie rule).

`proven_reuse` (also `best`) rests on what distinguishes reused blocks from the others
(`python -m bench.reuse_study`, on the Mooncake synthetic trace and on traces of
`bench.multiturn_trace`: chat, agent, documents, one-off questions under shared prompts, seeds):
1. Recency first. Reuse gaps are heavy tailed and a block's chance of another use falls with its
   idle time in every trace. Frequency as a bonus lets the many-times-hit blocks of finished long
   sessions squat: on agent-like traces `gdsf` and `lru_logfreq` fall to 0.15-0.37 of Belady's hit
   rate where `lru` gets 0.69. Within recency, a block that was used before is a much better bet than
   a new one: in the synthetic trace a new block has a 0.45 chance of another use (a median 153 s
   later), a block used twice 0.85 (111 s), and similarly, less sharply, in the generated traces.
2. But a store forgets what it evicted, and at 5% capacity it evicts most blocks before their first
   reuse: the synthetic trace's LRU store keeps a block about 21 s, and 60% of what it writes are
   blocks it had written and evicted before, each taken for new, so no policy that reads only live
   entries can tell a returning prompt from a one-off (`slru` gains nothing there). The index
   therefore remembers the uses of evicted blocks (4 per block held, a few dozen bytes each) and
   gives them back when a block is written again.
3. Admission. A request that found none of its prompt stored or cached starts a fresh chain (a new
   conversation, a pasted document, a one-off); its blocks are reused less often than those that
   extend a stored prefix: under LRU at 5%, 0.57 vs 0.78 (chat), 0.23 vs 0.57 (documents), 0.26 vs
   0.63 (one-off questions); no difference in agent traces (0.92 vs 0.93), and in the synthetic
   trace, whose prompts come back whole, almost every write is a fresh chain. Such blocks are still
   stored (they may be a conversation's first turn) but at the lowest priority.
Not used, having helped no policy tried in these traces: depth or position in the request, the
popularity of the prefix a block extends, the request's length (in the synthetic trace long
prompts come back more often, but ranking by length, even with the trace's true rates, gained
nothing). The
rest of the gap to Belady is sessions that end or come back after a long pause, which nothing known
at write time predicts in these traces; where that is all there is (agent traces), `best` is within
0.004 of the best classic, ahead or behind.

The rule (`ProvenReusePolicy`): blocks used once (`uses == 1`: never hit, not remembered) are on
probation and may fill at most `probation_share` (0.35) of what stays after the eviction; the
excess goes first. Then everything by idle time, oldest first, where probation blocks of fresh
chains age `fresh_aging` (2) times as fast. The constants are not knife-edge: probation shares of
0.2-0.5 and aging of 2-3 move hit rates by at most 0.02 on the traces studied. Results:
bench/results/trace_replay_synthetic.json, bench/results/trace_replay_generated.json.
"""

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

import numpy as np

from workers.kvstore.index import BlockEntry


class Snapshot:
    """An index snapshot as columns, so ranking runs in numpy: a GC pass may see millions of entries."""

    def __init__(self, entries: Iterable[BlockEntry]) -> None:
        self.entries = list(entries)
        count = len(self.entries)
        self.last_access = np.fromiter((entry.last_access for entry in self.entries), np.float64, count)
        self.created_at = np.fromiter((entry.created_at for entry in self.entries), np.float64, count)
        self.depth = np.fromiter((entry.depth for entry in self.entries), np.int64, count)
        self.hit_count = np.fromiter((entry.hit_count for entry in self.entries), np.int64, count)
        self.size = np.fromiter((entry.size for entry in self.entries), np.int64, count)
        self.retain_until = np.fromiter((entry.retain_until for entry in self.entries), np.float64, count)
        self.uses = np.fromiter((entry.uses for entry in self.entries), np.int64, count)
        self.new_chain = np.fromiter((entry.new_chain for entry in self.entries), np.bool_, count)

    def lru_order(self, *, last: np.ndarray | None = None) -> np.ndarray:
        """Indices least recently accessed first, deepest first among equals; entries flagged in
        `last` come after all the others."""
        keys = (-self.depth, self.last_access) if last is None else (-self.depth, self.last_access, last)
        return np.lexsort(keys)

    def score_order(self, score: np.ndarray) -> np.ndarray:
        """Indices lowest `score` first, deepest first among equals."""
        return np.lexsort((-self.depth, score))

    def take(self, order: np.ndarray, bytes_to_free: int, now: float) -> list[BlockEntry]:
        """The shortest head of `order` whose sizes reach `bytes_to_free` (all of it if they can't),
        after moving blocks with a live retention hint (retain_until > now) behind all the others,
        each group keeping its order."""
        if bytes_to_free <= 0:
            return []
        order = order[np.argsort(self.retain_until[order] > now, kind="stable")]
        count = int(np.searchsorted(np.cumsum(self.size[order]), bytes_to_free)) + 1
        return [self.entries[i] for i in order[:count]]


class EvictionPolicy(ABC):
    def select_victims(self, entries: Iterable[BlockEntry], bytes_to_free: int, now: float) -> list[BlockEntry]:
        """The entries to remove, in eviction order: the fewest whose sizes reach `bytes_to_free`
        (every entry when all of them together are smaller). Blocks with a live retention hint go
        only after every block without one, whatever the policy."""
        snapshot = Snapshot(entries)
        if not snapshot.entries:
            return []
        return snapshot.take(self.order(snapshot, bytes_to_free, now), bytes_to_free, now)

    @abstractmethod
    def order(self, snapshot: Snapshot, bytes_to_free: int, now: float) -> np.ndarray:
        """Indices of the snapshot's entries, first victim first."""


class LRUPolicy(EvictionPolicy):
    def order(self, snapshot: Snapshot, bytes_to_free: int, now: float) -> np.ndarray:
        return snapshot.lru_order()


class SegmentedLRUPolicy(EvictionPolicy):
    """Probation holds blocks never hit since they were written; protected holds blocks hit at least
    once, LRU-ordered, capped at `protected_share` of what the store keeps after the eviction, filled
    most recent and shallowest first (a chain that straddles the cap loses its tail, not its head).
    Victims come from probation and from protected blocks beyond the cap, least recent first. The
    cap is 0.5 rather than the textbook 0.8 because a prefix's first reuse comes much later than its
    later ones, so probation needs room to keep new blocks until their first hit."""

    def __init__(self, protected_share: float = 0.5) -> None:
        if not 0 <= protected_share < 1:
            raise ValueError(f"protected_share must be in [0, 1), got {protected_share}")
        self.protected_share = protected_share

    def order(self, snapshot: Snapshot, bytes_to_free: int, now: float) -> np.ndarray:
        protected = np.flatnonzero(snapshot.hit_count > 0)
        # Most recent first, shallowest first among equals: the order in which protected blocks fill the cap.
        protected = protected[np.lexsort((snapshot.depth[protected], -snapshot.last_access[protected]))]
        budget = self.protected_share * (int(snapshot.size.sum()) - bytes_to_free)
        kept = np.zeros(len(snapshot.entries), dtype=bool)
        kept[protected[np.cumsum(snapshot.size[protected]) <= budget]] = True
        # Blocks within the cap go last. The rest always covers bytes_to_free, since the cap is a share
        # of what stays, so these fall only when everything must go.
        return snapshot.lru_order(last=kept)


def _mean_idle(snapshot: Snapshot, now: float) -> float:
    """The snapshot's mean time since last access: the store's own time scale, so that a policy
    weighs recency against frequency the same way at any load and capacity."""
    return max(float(np.mean(now - snapshot.last_access)), 1e-9)


class GDSFPolicy(EvictionPolicy):
    """Greedy-dual-size-frequency with aging, stateless: priority = accesses / size in units of the
    mean block size, minus idle time in units of the snapshot's mean idle time (the aging that
    GDSF's inflation value L provides, read from the clock instead of from past evictions)."""

    def order(self, snapshot: Snapshot, bytes_to_free: int, now: float) -> np.ndarray:
        frequency = (snapshot.hit_count + 1) * (float(snapshot.size.mean()) / snapshot.size)
        return snapshot.score_order(frequency - (now - snapshot.last_access) / _mean_idle(snapshot, now))


class LogFrequencyLRUPolicy(EvictionPolicy):
    """Recency plus log-frequency, leaf first: priority = log2(1 + hit count) minus idle time in units
    of the snapshot's mean idle time. A chain written together has children no more recent and no
    more hit than their parents, so with deepest-first ties leaves go before the prefixes they extend."""

    def order(self, snapshot: Snapshot, bytes_to_free: int, now: float) -> np.ndarray:
        score = np.log2(1 + snapshot.hit_count) - (now - snapshot.last_access) / _mean_idle(snapshot, now)
        return snapshot.score_order(score)


class ProvenReusePolicy(EvictionPolicy):
    """`proven_reuse` (the default, `best`): recency, with a capped probation for blocks that have not
    proven reuse and faster aging for blocks of fresh chains. See the module docstring for why.

    - Probation holds blocks used once (written, never hit, not remembered from an earlier stay:
      `BlockEntry.uses == 1`). It may fill at most `probation_share` of what the store keeps after
      the eviction; the excess goes first, oldest first.
    - Everything is then ranked by idle time, oldest first, where a probation block of a fresh chain
      (`new_chain`: its request found none of its prompt stored) ages `fresh_aging` times as fast.
    """

    def __init__(self, probation_share: float = 0.35, fresh_aging: float = 2.0) -> None:
        if not 0 < probation_share <= 1:
            raise ValueError(f"probation_share must be in (0, 1], got {probation_share}")
        if not (math.isfinite(fresh_aging) and fresh_aging >= 1):
            raise ValueError(f"fresh_aging must be a finite number >= 1, got {fresh_aging}")
        self.probation_share = probation_share
        self.fresh_aging = fresh_aging

    def order(self, snapshot: Snapshot, bytes_to_free: int, now: float) -> np.ndarray:
        probation = snapshot.uses == 1
        aging = np.where(probation & snapshot.new_chain, self.fresh_aging, 1.0)
        order = snapshot.score_order(-(now - snapshot.last_access) * aging)
        budget = self.probation_share * (int(snapshot.size.sum()) - bytes_to_free)
        excess = int(snapshot.size[probation].sum()) - budget
        if excess <= 0:
            return order
        in_probation = order[probation[order]]
        # The fewest probation blocks, in order, whose sizes reach the excess.
        count = int(np.searchsorted(np.cumsum(snapshot.size[in_probation]), excess)) + 1
        first = np.zeros(len(snapshot.entries), dtype=bool)
        first[in_probation[:count]] = True
        return np.concatenate([in_probation[:count], order[~first[order]]])


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "slru": SegmentedLRUPolicy,
    "gdsf": GDSFPolicy,
    "lru_logfreq": LogFrequencyLRUPolicy,
    "proven_reuse": ProvenReusePolicy,
    "best": ProvenReusePolicy,
}


def get_policy(name: str) -> EvictionPolicy:
    """A new policy with its default settings, by name: one of `POLICIES` ("best" = the best we have)."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {', '.join(POLICIES)}")
    return factory()
