"""Fetching SWA state from the worker that holds it (workers.protocol.messages, "SWA state fetch").

The holder runs a `SwaStateServer`: a ROUTER answering each SwaStateRequest from its SwaStateCache at
once, with the runs it holds as raw frames and the rest named missing, so a block evicted meanwhile
costs the asker a replay, never a wait. A request it cannot read gets an error reply, and the server
goes on. It touches only the cache (thread-safe), so it may run on a thread of its own (`serve`) or
from the worker's loop (`answer`).

The asker's `SwaStateFetcher` sends one request and waits for its reply until a deadline: a holder
that is not connected, dead or too slow makes every block missing once the deadline passes (a late
reply is recognised by its fetch id and dropped). Nothing in a reply is trusted: a layout, dtype or
run shape other than the asker's SWA group's, keys it did not ask for, or frames of the wrong size
refuse the whole reply, and every block counts as missing. Over the network both ends are CURVE
(workers.curve), as the KV handoff is.
"""

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch
import zmq

from workers import curve
from workers.engine.dtypes import kv_storage_name
from workers.engine.kv.spec import KVCacheSpec
from workers.engine.kv.swa_state import SwaStateCache
from workers.kvstore.block_hash import BlockHash
from workers.protocol.messages import MAX_SWA_STATE_KEYS, SwaStateReply, SwaStateRequest
from workers.transfer.frames import DTYPES, MAX_LAYOUT_CHARS, frame_buffer, frame_tensor, tensor_frame

log = logging.getLogger(__name__)

FETCH_TIMEOUT_S = 1.0  # a holder answers from memory in milliseconds; past this a replay is cheaper
MAX_HOLDER_SOCKETS = 64  # connections a fetcher keeps open, the least recently used closed past this
POLL_MS = 100  # how often a serving thread looks at its stop event while idle

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(SwaStateRequest)
_reply_decoder = msgspec.msgpack.Decoder(SwaStateReply)


class SwaStateServer:
    def __init__(
        self, cache: SwaStateCache, endpoint: str, context: zmq.Context, *, key: curve.CurveKey | None = None
    ) -> None:
        """Binds at once; `endpoint` is then the bound one (a tcp port 0 or * resolved), to advertise."""
        self.cache = cache
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        try:
            curve.bind(self.socket, endpoint, key)
        except BaseException:
            self.socket.close()
            raise
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._dtype = kv_storage_name(cache.spec.storage_dtype)
        # Counters (the worker's /metrics).
        self.num_requests = 0
        self.num_refused = 0  # requests it could not read
        self.num_blocks_sent = 0
        self.num_blocks_missing = 0

    def answer(self, max_messages: int) -> int:
        """Answer up to `max_messages` requests waiting now; how many were answered."""
        for answered in range(max_messages):
            try:
                peer, *frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return answered
            reply, runs = self.reply(frames)
            # A ROUTER drops a reply to a peer that is gone rather than blocking.
            self.socket.send_multipart([peer, _encoder.encode(reply), *map(tensor_frame, runs)], copy=False)
        return max_messages

    def serve(self, stop: threading.Event) -> None:
        """Answer requests until `stop` is set, then close the socket."""
        try:
            while not stop.is_set():
                if self.socket.poll(POLL_MS):
                    self.answer(64)
        finally:
            self.socket.close()

    def reply(self, frames: Sequence[bytes]) -> tuple[SwaStateReply, list[torch.Tensor]]:
        """The reply to one request's frames, and the runs that go with it."""
        self.num_requests += 1
        try:
            request = self._request(frames)
        except ValueError as error:
            self.num_refused += 1
            log.warning("refused an SWA state request: %s", error)
            return SwaStateReply(0, error=str(error)), []
        found, missing, runs = [], [], []
        for key, run in zip(request.keys, self.cache.get(request.keys)):
            if run is None:
                missing.append(key)
            else:
                found.append(key)
                runs.append(run)
        self.num_blocks_sent += len(found)
        self.num_blocks_missing += len(missing)
        reply = SwaStateReply(
            request.fetch_id,
            kv_layout=self.cache.layout,
            dtype=self._dtype,
            run_shape=self.cache.run_shape,
            found=found,
            missing=missing,
        )
        return reply, runs

    def _request(self, frames: Sequence[bytes]) -> SwaStateRequest:
        if len(frames) != 1:
            raise ValueError(f"an SWA state request is one frame, got {len(frames)}")
        try:
            request = _request_decoder.decode(frames[0])
        except msgspec.DecodeError as error:
            raise ValueError(f"invalid SWA state request: {error}") from None
        if request.fetch_id < 1:
            raise ValueError(f"an SWA state request's fetch_id is positive, got {request.fetch_id}")
        if not 0 < len(request.keys) <= MAX_SWA_STATE_KEYS:
            raise ValueError(f"an SWA state request asks for 1 to {MAX_SWA_STATE_KEYS} keys, got {len(request.keys)}")
        return request


@dataclass(frozen=True, slots=True)
class SwaFetch:
    """What one fetch brought: per key asked for, its run or None (missing); `error` says why none
    came at all (a holder down or too slow, a reply refused), "" otherwise."""

    runs: list[torch.Tensor | None]
    error: str = ""

    def window(self) -> list[torch.Tensor] | None:
        """The runs, when every block came (the state at a prefix end is usable only whole)."""
        return None if any(run is None for run in self.runs) else list(self.runs)


class SwaStateFetcher:
    """One fetch at a time (ZMQ sockets are not thread-safe): the caller's loader thread, or a lock."""

    def __init__(
        self,
        spec: KVCacheSpec,
        block_tokens: int,
        context: zmq.Context,
        *,
        key: curve.CurveKey | None = None,
        timeout_s: float = FETCH_TIMEOUT_S,
    ) -> None:
        """`spec` is this worker's SWA group: a reply of another layout is refused."""
        self.layout = spec.layout
        self.dtype = spec.storage_dtype
        self.run_shape = spec.run_shape(block_tokens)
        self.run_bytes = spec.bytes_per_token * block_tokens
        self.timeout_s = timeout_s
        self._context = context
        self._key = key
        self._sockets: OrderedDict[str, zmq.Socket] = OrderedDict()  # endpoint → DEALER, least recent first
        self._fetch_ids = itertools.count(1)
        self._lock = threading.Lock()
        # Counters (the worker's /metrics): fetches that brought every block, some, or none (failed).
        self.num_fetches = 0
        self.num_complete = 0
        self.num_failed = 0
        self.num_blocks_fetched = 0
        self.num_blocks_missing = 0

    def fetch(self, endpoint: str, keys: Sequence[BlockHash]) -> SwaFetch:
        """The runs of `keys` from the holder at `endpoint`, within `timeout_s`."""
        if not 0 < len(keys) <= MAX_SWA_STATE_KEYS:
            raise ValueError(f"a fetch asks for 1 to {MAX_SWA_STATE_KEYS} keys, got {len(keys)}")
        with self._lock:
            try:
                fetched = SwaFetch(self._fetch(endpoint, list(keys)))
            except SwaFetchError as error:
                log.warning("SWA state from %s: %s", endpoint, error)
                fetched = SwaFetch([None] * len(keys), str(error))
            self._count(fetched)
        return fetched

    def close(self) -> None:
        with self._lock:
            for socket in self._sockets.values():
                socket.close(linger=0)
            self._sockets.clear()

    def _fetch(self, endpoint: str, keys: list[BlockHash]) -> list[torch.Tensor | None]:
        deadline = time.monotonic() + self.timeout_s
        socket = self._socket(endpoint)
        fetch_id = next(self._fetch_ids)
        # With ZMQ_IMMEDIATE a holder not connected takes nothing: wait for it until the deadline.
        if not socket.poll(self.timeout_s * 1000, zmq.POLLOUT):
            raise SwaFetchError(f"the holder is not connected within {self.timeout_s:g} s")
        try:
            socket.send(_encoder.encode(SwaStateRequest(fetch_id, keys)), zmq.NOBLOCK)
        except zmq.Again:
            raise SwaFetchError("the holder took no request") from None
        while (remaining := deadline - time.monotonic()) > 0 and socket.poll(remaining * 1000):
            frames = socket.recv_multipart(copy=False)
            reply = self._reply(frames[0])
            if reply.fetch_id == fetch_id:
                return self._runs(keys, reply, frames[1:])
            if reply.fetch_id == 0:
                raise SwaFetchError(f"the holder refused the request: {reply.error}")
            log.debug("dropping a late SWA state reply (fetch %d)", reply.fetch_id)
        raise SwaFetchError(f"no answer within {self.timeout_s:g} s")

    def _socket(self, endpoint: str) -> zmq.Socket:
        socket = self._sockets.get(endpoint)
        if socket is not None:
            self._sockets.move_to_end(endpoint)
            return socket
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IMMEDIATE, 1)
        try:
            curve.connect(socket, endpoint, self._key)
        except BaseException:
            socket.close()
            raise
        self._sockets[endpoint] = socket
        if len(self._sockets) > MAX_HOLDER_SOCKETS:
            self._sockets.popitem(last=False)[1].close(linger=0)
        return socket

    def _reply(self, frame: zmq.Frame) -> SwaStateReply:
        try:
            return _reply_decoder.decode(frame_buffer(frame))
        except msgspec.DecodeError as error:
            raise SwaFetchError(f"unreadable reply: {error}") from None

    def _runs(self, keys: list[BlockHash], reply: SwaStateReply, frames: Sequence[zmq.Frame]) -> list:
        """Per key, its run from the reply or None; SwaFetchError for a reply that does not fit."""
        if reply.error:
            raise SwaFetchError(f"the holder refused the request: {reply.error}")
        if reply.kv_layout != self.layout:
            raise SwaFetchError(
                f"it holds SWA state laid out as {reply.kv_layout[:MAX_LAYOUT_CHARS]!r}; "
                f"this worker's is {self.layout!r}"
            )
        if DTYPES.get(reply.dtype) != self.dtype or tuple(reply.run_shape) != self.run_shape:
            raise SwaFetchError(
                f"its runs are {reply.dtype[:16]!r} {list(reply.run_shape)[:8]}; this worker's are "
                f"{kv_storage_name(self.dtype)!r} {list(self.run_shape)}"
            )
        asked = set(keys)
        answered = [*reply.found, *reply.missing]
        if len(set(answered)) != len(answered) or not asked.issuperset(answered):
            raise SwaFetchError("the reply names keys twice or keys not asked for")
        if len(frames) != len(reply.found):
            raise SwaFetchError(f"the reply has {len(frames)} frames for {len(reply.found)} blocks")
        runs = {}
        for key, frame in zip(reply.found, frames):
            buffer = frame_buffer(frame)
            if buffer.nbytes != self.run_bytes:
                raise SwaFetchError(f"a run has {buffer.nbytes} bytes, expected {self.run_bytes}")
            runs[key] = frame_tensor(buffer, self.dtype, self.run_shape)
        return [runs.get(key) for key in keys]

    def _count(self, fetched: SwaFetch) -> None:
        found = sum(run is not None for run in fetched.runs)
        self.num_fetches += 1
        self.num_complete += found == len(fetched.runs)
        self.num_failed += bool(fetched.error)
        self.num_blocks_fetched += found
        self.num_blocks_missing += len(fetched.runs) - found


class SwaFetchError(Exception):
    """Why a fetch brought nothing."""
