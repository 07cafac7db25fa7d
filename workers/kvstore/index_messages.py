"""The messages of the store index's process boundary (workers.kvstore.index_server).

A store without a shared Redis index has its GC process keep the index and serve it: each other
process sends one request per BlockIndex call on a DEALER (workers.kvstore.remote_index) and gets
one KVIndexReply with the same call id; the SWA holder index (workers.kvstore.holders) is served the
same way, on the same socket. ipc:// only: the socket is not authenticated.
"""

import msgspec

from workers.kvstore.index import BlockEntry


class KVIndexAdd(msgspec.Struct, tag="kv_index.add", frozen=True, forbid_unknown_fields=True):
    call_id: int
    entries: list[BlockEntry]


class KVIndexGet(msgspec.Struct, tag="kv_index.get", frozen=True, forbid_unknown_fields=True):
    call_id: int
    key: bytes


class KVIndexMatchPrefix(msgspec.Struct, tag="kv_index.match_prefix", frozen=True, forbid_unknown_fields=True):
    call_id: int
    keys: list[bytes]


class KVIndexContainsMany(msgspec.Struct, tag="kv_index.contains_many", frozen=True, forbid_unknown_fields=True):
    call_id: int
    keys: list[bytes]


class KVIndexTouch(msgspec.Struct, tag="kv_index.touch", frozen=True, forbid_unknown_fields=True):
    call_id: int
    keys: list[bytes]
    now: float


class KVIndexRetain(msgspec.Struct, tag="kv_index.retain", frozen=True, forbid_unknown_fields=True):
    call_id: int
    keys: list[bytes]
    until: float


class KVIndexRemove(msgspec.Struct, tag="kv_index.remove", frozen=True, forbid_unknown_fields=True):
    call_id: int
    keys: list[bytes]
    remember: bool = False  # keep the removed blocks' uses (the GC's evictions; BlockIndex.remove)


class KVIndexExpired(msgspec.Struct, tag="kv_index.expired", frozen=True, forbid_unknown_fields=True):
    call_id: int
    traffic_class: str
    cutoff: float
    limit: int
    now: float  # the GC's clock; inf: leave no retained entry out


class KVIndexEntries(msgspec.Struct, tag="kv_index.entries", frozen=True, forbid_unknown_fields=True):
    call_id: int


class KVIndexUsage(msgspec.Struct, tag="kv_index.usage", frozen=True, forbid_unknown_fields=True):
    call_id: int


class KVIndexTrafficClasses(msgspec.Struct, tag="kv_index.traffic_classes", frozen=True, forbid_unknown_fields=True):
    call_id: int


# The SWA holder index (workers.kvstore.holders) served beside the block index: one request per
# HolderIndex call, answered with a KVIndexReply as the others are.


class KVHoldersRegister(msgspec.Struct, tag="kv_holders.register", frozen=True, forbid_unknown_fields=True):
    call_id: int
    keys: list[bytes]
    worker_id: str


class KVHoldersDrop(msgspec.Struct, tag="kv_holders.drop", frozen=True, forbid_unknown_fields=True):
    call_id: int
    keys: list[bytes]
    worker_id: str


class KVHoldersDropWorker(msgspec.Struct, tag="kv_holders.drop_worker", frozen=True, forbid_unknown_fields=True):
    call_id: int
    worker_id: str


class KVHoldersLookup(msgspec.Struct, tag="kv_holders.holders", frozen=True, forbid_unknown_fields=True):
    call_id: int
    keys: list[bytes]


KVIndexRequest = (
    KVIndexAdd
    | KVIndexGet
    | KVIndexMatchPrefix
    | KVIndexContainsMany
    | KVIndexTouch
    | KVIndexRetain
    | KVIndexRemove
    | KVIndexExpired
    | KVIndexEntries
    | KVIndexUsage
    | KVIndexTrafficClasses
    | KVHoldersRegister
    | KVHoldersDrop
    | KVHoldersDropWorker
    | KVHoldersLookup
)


class KVIndexReply(msgspec.Struct, tag="kv_index.reply", frozen=True):
    """The answer to one request: `result` is the msgpack of what the BlockIndex method returned (the
    caller knows its type), or `error` says why there is none (a request that could not be read has
    call id 0)."""

    call_id: int
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack nil
    error: str = ""
