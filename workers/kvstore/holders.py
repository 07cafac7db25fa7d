"""Which workers hold a block's SWA state in host memory: "held by worker X", beside the block index.

The global store keeps only full-attention blocks; a sliding-window group's KV stays on the worker that
computed it (workers.engine.kv.swa_state), per block, keyed by the same chained hash as the store's
blocks. A worker registers the blocks it keeps and drops those its cache evicts; another worker that
hits a prefix asks who holds every block of that prefix end's window (`holders_of_all`) and fetches
the state from one of them (workers.transfer.swa_fetch), or backs off and replays
(workers.kvstore.swa_replay).

One interface and the block index's backends (workers.kvstore.store.open_holders picks one from the
index's URL): `MemoryHolders` in one process; `RemoteHolders` (workers.kvstore.remote_holders), the
MemoryHolders the store's GC process serves beside its index to the embedded default's processes;
`RedisHolders` (workers.kvstore.redis_holders), shared by every process and host of a cluster. All
pass tests/workers/kvstore/test_holders.py.

A registration is a promise the holder may fail to keep (it restarted, its drop was lost): a fetch
from it then answers "missing", and the request replays. What keeps stale promises few: a worker's
registrations go at once when it is known dead (`drop_worker`, also at a worker's start, for those of
an earlier life under its id), and each backend keeps at most `max_per_worker` per worker, its oldest
going first past that.
"""

import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence

from workers.kvstore.block_hash import BlockHash

# Registrations one worker may hold: its SWA cache's blocks (a few GiB of host memory in blocks of
# tens to hundreds of KiB) with room to spare.
MAX_PER_WORKER = 1 << 16


class HolderIndex(ABC):
    @abstractmethod
    def register(self, keys: Sequence[BlockHash], worker_id: str) -> None:
        """`worker_id` holds these blocks; each counts as its newest registration, and its oldest
        beyond `max_per_worker` are dropped."""

    @abstractmethod
    def drop(self, keys: Sequence[BlockHash], worker_id: str) -> None:
        """`worker_id` no longer holds these blocks (those it did not register are ignored)."""

    @abstractmethod
    def drop_worker(self, worker_id: str) -> int:
        """Every registration of `worker_id` goes (it died, or restarted); returns how many."""

    @abstractmethod
    def holders(self, keys: Sequence[BlockHash]) -> list[set[str]]:
        """Per key, the workers that hold it, in one round trip to a shared backend."""

    def holders_of_all(self, keys: Sequence[BlockHash]) -> set[str]:
        """The workers that hold every one of `keys` (a prefix end's window): one round trip. No keys:
        no one needs to be asked, and the empty set says so."""
        found = self.holders(keys)
        return set.intersection(*found) if found else set()


def check_worker_id(worker_id: str) -> str:
    if not isinstance(worker_id, str) or not worker_id:
        raise ValueError(f"a holder's worker_id is a non-empty string, got {worker_id!r}")
    return worker_id


def check_max_per_worker(max_per_worker: int) -> int:
    if max_per_worker < 1:
        raise ValueError(f"max_per_worker must be positive, got {max_per_worker}")
    return max_per_worker


class MemoryHolders(HolderIndex):
    """Thread-safe: an engine's thread registers while its fetch server's thread reads."""

    def __init__(self, max_per_worker: int = MAX_PER_WORKER) -> None:
        self.max_per_worker = check_max_per_worker(max_per_worker)
        self._lock = threading.Lock()
        self._by_key: dict[BlockHash, set[str]] = {}
        self._by_worker: dict[str, OrderedDict[BlockHash, None]] = {}  # oldest registration first

    def register(self, keys: Sequence[BlockHash], worker_id: str) -> None:
        check_worker_id(worker_id)
        with self._lock:
            held = self._by_worker.setdefault(worker_id, OrderedDict())
            for key in keys:
                held[key] = None
                held.move_to_end(key)
                self._by_key.setdefault(key, set()).add(worker_id)
            while len(held) > self.max_per_worker:
                self._unlink(held.popitem(last=False)[0], worker_id)

    def drop(self, keys: Sequence[BlockHash], worker_id: str) -> None:
        with self._lock:
            held = self._by_worker.get(worker_id)
            if held is None:
                return
            for key in keys:
                if key in held:
                    del held[key]
                    self._unlink(key, worker_id)
            if not held:
                del self._by_worker[worker_id]

    def drop_worker(self, worker_id: str) -> int:
        with self._lock:
            held = self._by_worker.pop(worker_id, OrderedDict())
            for key in held:
                self._unlink(key, worker_id)
        return len(held)

    def holders(self, keys: Sequence[BlockHash]) -> list[set[str]]:
        with self._lock:
            return [set(self._by_key.get(key, ())) for key in keys]

    def _unlink(self, key: BlockHash, worker_id: str) -> None:
        workers = self._by_key[key]
        workers.discard(worker_id)
        if not workers:
            del self._by_key[key]
