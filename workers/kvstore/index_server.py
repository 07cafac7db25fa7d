"""Serves one process's block index to the store's other processes: a ROUTER that answers each
KVIndex* request (workers.kvstore.index_messages) by calling the index, one request at a time; and,
when given one, the SWA holder index (workers.kvstore.holders) the same way, its KVHolders* requests.

Run by the store's GC process when the store has no shared Redis index, so that every process of
the store, however many, sees one index: what any of them wrote, read or was asked to keep. The
socket is not authenticated, so it binds ipc:// only (a path under a private directory); many
hosts share a store through the Redis index instead.
"""

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from workers.kvstore.holders import HolderIndex
from workers.kvstore.index import BlockIndex
from workers.kvstore.index_messages import (
    KVHoldersDrop,
    KVHoldersDropWorker,
    KVHoldersLookup,
    KVHoldersRegister,
    KVIndexAdd,
    KVIndexContainsMany,
    KVIndexEntries,
    KVIndexExpired,
    KVIndexGet,
    KVIndexMatchPrefix,
    KVIndexRemove,
    KVIndexReply,
    KVIndexRequest,
    KVIndexRetain,
    KVIndexTouch,
    KVIndexTrafficClasses,
    KVIndexUsage,
)

log = logging.getLogger(__name__)

POLL_MS = 100  # how often the loop looks at its stop event while idle


def check_ipc_endpoint(endpoint: str) -> str:
    """`endpoint` if it is an ipc:// endpoint, else ValueError: the index socket has no authentication."""
    if not endpoint.startswith("ipc://") or len(endpoint) == len("ipc://"):
        raise ValueError(
            f"the KV index is served on ipc:// endpoints only (its socket is not authenticated), got {endpoint!r}; "
            "share a store between hosts with the Redis index"
        )
    return endpoint


def _holder_handlers(holders: HolderIndex) -> dict[type, Callable[[Any], Any]]:
    return {
        KVHoldersRegister: lambda request: holders.register(request.keys, request.worker_id),
        KVHoldersDrop: lambda request: holders.drop(request.keys, request.worker_id),
        KVHoldersDropWorker: lambda request: holders.drop_worker(request.worker_id),
        KVHoldersLookup: lambda request: [sorted(workers) for workers in holders.holders(request.keys)],
    }


def _handlers(index: BlockIndex) -> dict[type, Callable[[Any], Any]]:
    return {
        KVIndexAdd: lambda request: index.add(request.entries),
        KVIndexGet: lambda request: index.get(request.key),
        KVIndexMatchPrefix: lambda request: index.match_prefix(request.keys),
        KVIndexContainsMany: lambda request: index.contains_many(request.keys),
        KVIndexTouch: lambda request: index.touch(request.keys, request.now),
        KVIndexRetain: lambda request: index.retain(request.keys, request.until),
        KVIndexRemove: lambda request: index.remove(request.keys, remember=request.remember),
        KVIndexExpired: lambda request: index.expired(
            request.traffic_class, request.cutoff, request.limit, now=request.now
        ),
        KVIndexEntries: lambda request: list(index.entries()),
        KVIndexUsage: lambda request: index.usage(),
        KVIndexTrafficClasses: lambda request: sorted(index.traffic_classes()),
    }


class IndexServer:
    def __init__(
        self, index: BlockIndex, endpoint: str, context: zmq.Context, *, holders: HolderIndex | None = None
    ) -> None:
        """Binds at once, so that clients started after this returns find the socket. `holders`: the
        SWA holder index to serve too (a holder request to a server without one is an error reply)."""
        self.endpoint = check_ipc_endpoint(endpoint)
        self._handlers = _handlers(index) | (_holder_handlers(holders) if holders is not None else {})
        self._decoder = msgspec.msgpack.Decoder(KVIndexRequest)
        self._encoder = msgspec.msgpack.Encoder()
        self._socket = context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)

    def serve(self, stop: threading.Event) -> None:
        """Answer requests until `stop` is set, then close the socket."""
        try:
            while not stop.is_set():
                if self._socket.poll(POLL_MS):
                    self._answer(*self._socket.recv_multipart())
        finally:
            self._socket.close()

    def _answer(self, peer: bytes, *frames: bytes) -> None:
        self._socket.send_multipart([peer, self._encoder.encode(self.reply(frames))])

    def reply(self, frames: tuple[bytes, ...]) -> KVIndexReply:
        """The reply to one request's frames: the index's answer, or why there is none."""
        if len(frames) != 1:
            return KVIndexReply(0, error=f"a KV index request is one frame, got {len(frames)}")
        try:
            request = self._decoder.decode(frames[0])
        except msgspec.DecodeError as error:
            return KVIndexReply(0, error=f"invalid KV index request: {error}")
        handler = self._handlers.get(type(request))
        if handler is None:
            return KVIndexReply(request.call_id, error=f"this index serves no SWA holders ({type(request).__name__})")
        try:
            result = handler(request)
        except Exception as error:
            log.exception("KV index request %s failed", type(request).__name__)
            return KVIndexReply(request.call_id, error=f"{type(request).__name__} failed: {error}")
        return KVIndexReply(request.call_id, result=msgspec.Raw(self._encoder.encode(result)))
