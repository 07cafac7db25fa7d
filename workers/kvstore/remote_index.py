"""A block index that another process serves (workers.kvstore.index_server), used as a BlockIndex: the
embedded default's workers and gateway share the store's one index this way, kept by its GC process.

Each call is one request and one reply on a DEALER, under a lock (an engine's threads share one
client). A call that gets no answer raises RemoteIndexError, a ConnectionError, so that the store's
users treat it as they treat a failing disk or Redis: a miss, a block not stored. It fails at once
while the server is not connected (ZMQ_IMMEDIATE: nothing queues up for a server that is down, for
instance while its supervisor restarts it), after TIMEOUT_S without a reply, or when the server
answers with an error. Nothing is retried; the next call tries again, and the socket reconnects on
its own. A late reply to a call that timed out is recognised by its call id and dropped.
"""

import itertools
import logging
import math
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import msgspec
import zmq

from workers.kvstore.block_hash import BlockHash
from workers.kvstore.index import BlockEntry, BlockIndex, IndexUsage
from workers.kvstore.index_messages import (
    KVIndexAdd,
    KVIndexContainsMany,
    KVIndexEntries,
    KVIndexExpired,
    KVIndexGet,
    KVIndexMatchPrefix,
    KVIndexRemove,
    KVIndexReply,
    KVIndexRetain,
    KVIndexTouch,
    KVIndexTrafficClasses,
    KVIndexUsage,
)
from workers.kvstore.index_server import check_ipc_endpoint

log = logging.getLogger(__name__)

# A served index answers in well under a millisecond; a GC run holding its lock for a big snapshot
# takes longer, but not this long.
TIMEOUT_S = 2.0
# The first call waits this long for the socket to connect (a client made just before its first use).
CONNECT_WAIT_S = 1.0


class RemoteIndexError(ConnectionError):
    """The served index did not answer: its server is down, too slow, or failed the call."""


class IndexCalls:
    """One DEALER to a served index: each call a request and its reply (see the module docstring).
    Thread-safe: calls take turns."""

    def __init__(self, endpoint: str, *, timeout_s: float = TIMEOUT_S, context: zmq.Context | None = None) -> None:
        self.endpoint = check_ipc_endpoint(endpoint)
        self.timeout_s = timeout_s
        self._context = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._socket: zmq.Socket | None = None
        self._call_ids = itertools.count(1)
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode_reply = msgspec.msgpack.Decoder(KVIndexReply).decode

    def call(self, request_type: type, result_type: Any, *fields: Any) -> Any:
        """The result of one request, decoded as `result_type`; RemoteIndexError when none comes."""
        with self._lock:
            call_id = next(self._call_ids)
            socket = self._connected()
            try:
                socket.send(self._encode(request_type(call_id, *fields)), zmq.NOBLOCK)
            except zmq.Again:
                raise RemoteIndexError(f"the KV index at {self.endpoint} is not up") from None
            reply = self._reply(socket, call_id)
        if reply.error:
            raise RemoteIndexError(f"the KV index at {self.endpoint} failed: {reply.error}")
        return msgspec.msgpack.decode(reply.result, type=result_type)

    def _connected(self) -> zmq.Socket:
        if self._socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.IMMEDIATE, 1)
            socket.connect(self.endpoint)
            socket.poll(CONNECT_WAIT_S * 1000, zmq.POLLOUT)
            self._socket = socket
        return self._socket

    def _reply(self, socket: zmq.Socket, call_id: int) -> KVIndexReply:
        deadline = time.monotonic() + self.timeout_s
        while (remaining := deadline - time.monotonic()) > 0 and socket.poll(remaining * 1000):
            try:
                reply = self._decode_reply(socket.recv())
            except msgspec.DecodeError as error:
                raise RemoteIndexError(f"the KV index at {self.endpoint} sent an unreadable reply: {error}") from None
            if reply.call_id == call_id:
                return reply
            log.debug("dropping a late KV index reply (call %d)", reply.call_id)
        raise RemoteIndexError(f"the KV index at {self.endpoint} did not answer within {self.timeout_s} s")


class RemoteIndex(BlockIndex):
    def __init__(self, endpoint: str, *, timeout_s: float = TIMEOUT_S, context: zmq.Context | None = None) -> None:
        self._calls = IndexCalls(endpoint, timeout_s=timeout_s, context=context)
        self.endpoint = self._calls.endpoint
        self.timeout_s = timeout_s
        self._call = self._calls.call

    def add(self, entries: Sequence[BlockEntry]) -> int:
        return self._call(KVIndexAdd, int, list(entries)) if entries else 0

    def get(self, key: BlockHash) -> BlockEntry | None:
        return self._call(KVIndexGet, BlockEntry | None, key)

    def match_prefix(self, keys: Sequence[BlockHash]) -> int:
        return self._call(KVIndexMatchPrefix, int, list(keys)) if keys else 0

    def contains_many(self, keys: Sequence[BlockHash]) -> list[bool]:
        return self._call(KVIndexContainsMany, list[bool], list(keys)) if keys else []

    def touch(self, keys: Sequence[BlockHash], now: float) -> None:
        if keys:
            self._call(KVIndexTouch, None, list(keys), now)

    def retain(self, keys: Sequence[BlockHash], until: float) -> None:
        if keys:
            self._call(KVIndexRetain, None, list(keys), until)

    def remove(self, keys: Sequence[BlockHash], *, remember: bool = False) -> list[BlockEntry]:
        return self._call(KVIndexRemove, list[BlockEntry], list(keys), remember) if keys else []

    def expired(self, traffic_class: str, cutoff: float, limit: int, *, now: float = math.inf) -> list[BlockEntry]:
        return self._call(KVIndexExpired, list[BlockEntry], traffic_class, cutoff, limit, now)

    def entries(self) -> Iterator[BlockEntry]:
        return iter(self._call(KVIndexEntries, list[BlockEntry]))

    def usage(self) -> IndexUsage:
        return self._call(KVIndexUsage, IndexUsage)

    def traffic_classes(self) -> set[str]:
        return set(self._call(KVIndexTrafficClasses, list[str]))
