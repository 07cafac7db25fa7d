"""The SWA holder index (workers.kvstore.holders) that the store's GC process serves beside its block
index (workers.kvstore.index_server): the embedded default's workers, each its own process on one
host, share their "held by worker X" registrations this way. Calls fail as the remote index's do
(RemoteIndexError, a ConnectionError), which a caller takes as "no holder": a replay, not a failure.
"""

from collections.abc import Sequence

import zmq

from workers.kvstore.block_hash import BlockHash
from workers.kvstore.holders import HolderIndex, check_worker_id
from workers.kvstore.index_messages import KVHoldersDrop, KVHoldersDropWorker, KVHoldersLookup, KVHoldersRegister
from workers.kvstore.remote_index import TIMEOUT_S, IndexCalls


class RemoteHolders(HolderIndex):
    def __init__(self, endpoint: str, *, timeout_s: float = TIMEOUT_S, context: zmq.Context | None = None) -> None:
        """The cap per worker is the served holder index's."""
        self._call = IndexCalls(endpoint, timeout_s=timeout_s, context=context).call

    def register(self, keys: Sequence[BlockHash], worker_id: str) -> None:
        if keys:
            self._call(KVHoldersRegister, None, list(keys), check_worker_id(worker_id))

    def drop(self, keys: Sequence[BlockHash], worker_id: str) -> None:
        if keys:
            self._call(KVHoldersDrop, None, list(keys), worker_id)

    def drop_worker(self, worker_id: str) -> int:
        return self._call(KVHoldersDropWorker, int, worker_id)

    def holders(self, keys: Sequence[BlockHash]) -> list[set[str]]:
        if not keys:
            return []
        return [set(workers) for workers in self._call(KVHoldersLookup, list[list[str]], list(keys))]
