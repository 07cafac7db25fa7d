"""The block index: what the store holds, without the data. One interface, two backends.

`MemoryIndex` (workers.kvstore.memory_index) lives in one process, for the embedded default;
`RedisIndex` (workers.kvstore.redis_index) is shared by every process and host that uses the same
Redis. Both pass the same test suite (tests/workers/kvstore/test_index.py).

An entry names a block by its chained hash (workers.kvstore.block_hash), so a block's presence implies
nothing about its ancestors: eviction may have removed a chain's middle. `match_prefix` therefore
walks the chain and stops at the first absent key.

Expiry is not stored: a block expires `ttl(traffic_class)` seconds after its last access, with the
TTL taken from the policy when the GC runs, so an edited policy applies to blocks already stored.
`expired()` serves that query per class, oldest access first.

A client's cache hint (a prompt_cache_retention, an Anthropic cache_control breakpoint) gives the
blocks of the prefix it covers a `retain_until`: until then the GC neither expires them nor evicts
them while it can evict anything else. A later hint only extends it (`retain`); a plain request
leaves it as it is.

The index also remembers blocks the GC evicted (`remove(..., remember=True)`): how many times each
was used, for the last `REMEMBERED_PER_BLOCK` x (blocks held) evictions. A block written again while
remembered gets those uses back as `uses_before`, so the eviction policy can tell a block that was
used before from one never seen (workers.kvstore.eviction). Remembered blocks are not present: they
match nothing and count in no usage.
"""

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

import msgspec

from workers.kvstore.block_hash import BlockHash

# Evicted blocks the index remembers, per block it holds: enough to span the several store
# lifetimes a prefix's next use may take, at a few dozen bytes each (blocks are megabytes).
REMEMBERED_PER_BLOCK = 4


class BlockEntry(msgspec.Struct, frozen=True, kw_only=True):
    key: BlockHash
    size: int  # bytes of the block's file
    traffic_class: str  # decides the TTL; e.g. "chat", "agent"
    depth: int  # the block's position in its chain (0 = first block of a prompt)
    created_at: float
    last_access: float
    hit_count: int = 0
    retain_until: float = 0.0  # a client asked to keep it until then (time.time()); 0: no such hint
    # The request that wrote it found none of its prompt's blocks stored or cached: a chain that
    # starts here (a new conversation, a one-off document) rather than one that extends a prefix.
    new_chain: bool = False
    # Uses (writes and hits) of this block before the GC last evicted it, as the index remembered them.
    uses_before: int = 0

    @property
    def uses(self) -> int:
        """Every use the index knows of: earlier stays, the write that stored it, and its hits."""
        return self.uses_before + 1 + self.hit_count


class IndexUsage(msgspec.Struct, frozen=True):
    num_blocks: int
    num_bytes: int


class BlockIndex(ABC):
    @abstractmethod
    def add(self, entries: Sequence[BlockEntry]) -> int:
        """Insert entries whose keys are absent (a present key keeps its entry); returns how many
        were inserted. An inserted key the index remembers (see `remove`) gets its remembered uses
        added to `uses_before`, and is forgotten."""

    @abstractmethod
    def get(self, key: BlockHash) -> BlockEntry | None: ...

    @abstractmethod
    def match_prefix(self, keys: Sequence[BlockHash]) -> int:
        """How many of `keys`, from the first, are present: the hit length in blocks. No side effects."""

    @abstractmethod
    def contains_many(self, keys: Sequence[BlockHash]) -> list[bool]:
        """Whether each of `keys` is present, in one round trip to a remote index. No side effects."""

    @abstractmethod
    def touch(self, keys: Sequence[BlockHash], now: float) -> None:
        """Record a hit on each present key: last access = now, hit count + 1."""

    @abstractmethod
    def retain(self, keys: Sequence[BlockHash], until: float) -> None:
        """Keep each present key until at least `until`: retain_until = max(retain_until, until)."""

    @abstractmethod
    def remove(self, keys: Sequence[BlockHash], *, remember: bool = False) -> list[BlockEntry]:
        """Delete the present keys; returns the entries removed. With `remember` (the GC's evictions),
        keep each removed key's uses, forgetting the oldest remembered beyond `REMEMBERED_PER_BLOCK`
        per block still held."""

    @abstractmethod
    def expired(self, traffic_class: str, cutoff: float, limit: int, *, now: float = math.inf) -> list[BlockEntry]:
        """Up to `limit` entries of the class last accessed at or before `cutoff`, oldest first,
        leaving out those retained past `now` (the GC's clock; by default none are left out)."""

    @abstractmethod
    def entries(self) -> Iterator[BlockEntry]:
        """Every entry, in no particular order (a snapshot for the eviction policy to rank)."""

    @abstractmethod
    def usage(self) -> IndexUsage: ...

    @abstractmethod
    def traffic_classes(self) -> set[str]:
        """The classes that have at least one entry."""
