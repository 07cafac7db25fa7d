"""The worker ends of KV transfers: a prefill worker's sender thread and a decode worker's receiver.

Sender: each finished prefill's handoff is sent on a thread of its own, so that copying layers out of
pages and pushing them onto the wire overlaps the engine's next steps. One PUSH per decode endpoint,
kept open; ZMQ_IMMEDIATE queues nothing for a peer that is not connected, so a send to a decode
worker that is gone blocks, and the send timeout turns that into a failed transfer instead of
messages held forever. The layer frames are copies made as each layer is read (PagedLayers), and
ZMQ holds a reference to each until it is sent, so the engine may release the pages as soon as the
thread is done with the handoff. The thread reports each outcome on an inproc socket the worker's
loop polls; only that loop touches the engine. Over the network the PUSH is a CURVE client
(workers.curve): a decode worker that does not hold the cluster's key never gets the KV.

Receiver: the decode worker's PULL. A transfer is assembled only for a request the gateway said to
expect (ExpectTransferRequest); an expectation whose KV has not arrived within its timeout (the one
the gateway predicted for it, else the worker's default) fails, as does any malformed transfer, and
a transfer nobody expects is dropped.
"""

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count

import msgspec
import zmq

from workers import curve
from workers.engine.constraints import TokenConstraint
from workers.engine.kv_handoff import KVHandoff
from workers.transfer.frames import HandoffAssembler, KVTransferError, encode_handoff
from workers.protocol import KVTransferMessage

log = logging.getLogger(__name__)

SEND_TIMEOUT_MS = 2000  # longest a send waits for a decode worker to connect or take a message
_senders = count()
_lead_decoder = msgspec.msgpack.Decoder(KVTransferMessage)


@dataclass(frozen=True, slots=True)
class SendResult:
    request_id: str
    error: str  # "" when every message of the transfer was handed to ZMQ


class TransferSender:
    def __init__(
        self,
        context: zmq.Context,
        *,
        chunk_layers: int = 1,
        send_timeout_ms: int = SEND_TIMEOUT_MS,
        key: curve.CurveKey | None = None,
    ) -> None:
        """`key`: the cluster's CURVE key, for decode endpoints the rule of workers.curve secures."""
        self._context = context
        self._key = key
        self._chunk_layers = chunk_layers
        self._send_timeout_ms = send_timeout_ms
        self._jobs: queue.SimpleQueue[tuple[str, str, KVHandoff] | None] = queue.SimpleQueue()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        address = f"inproc://transfer-results-{next(_senders)}"
        # Bound before the thread connects: inproc needs the bind first.
        self.results = context.socket(zmq.PULL)
        self.results.bind(address)
        self._thread = threading.Thread(target=self._run, args=(address,), name="kv-sender", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, endpoint: str, handoff: KVHandoff) -> None:
        self._jobs.put((request_id, endpoint, handoff))

    def cancel(self, request_id: str) -> None:
        """Stop sending the request's KV at the next message; its result still comes (as an error)."""
        with self._lock:
            self._cancelled.add(request_id)

    def take_results(self) -> list[SendResult]:
        results = []
        while True:
            try:
                request_id, error = msgspec.msgpack.decode(self.results.recv(zmq.NOBLOCK))
            except zmq.Again:
                return results
            with self._lock:
                self._cancelled.discard(request_id)
            results.append(SendResult(request_id, error))

    def close(self) -> list[SendResult]:
        """Finish the sends under way and stop; the results not taken yet."""
        self._jobs.put(None)
        self._thread.join()
        results = self.take_results()
        self.results.close(linger=0)
        return results

    def _run(self, results_address: str) -> None:
        results = self._context.socket(zmq.PUSH)
        results.connect(results_address)
        pushes: dict[str, zmq.Socket] = {}
        try:
            while (job := self._jobs.get()) is not None:
                request_id, endpoint, handoff = job
                error = self._send(pushes, endpoint, handoff)
                results.send(msgspec.msgpack.encode((request_id, error)))
        finally:
            for push in pushes.values():
                push.close(linger=0)
            results.close(linger=1000)

    def _send(self, pushes: dict[str, zmq.Socket], endpoint: str, handoff: KVHandoff) -> str:
        push = pushes.get(endpoint)
        if push is None:
            push = self._context.socket(zmq.PUSH)
            push.setsockopt(zmq.IMMEDIATE, 1)
            push.setsockopt(zmq.SNDTIMEO, self._send_timeout_ms)
            try:
                curve.connect(push, endpoint, self._key)
            except (curve.CurveError, zmq.ZMQError) as error:  # a decode endpoint this worker may not reach
                push.close(linger=0)
                log.warning("KV transfer of %s: %s", handoff.request_id, error)
                return str(error)
            pushes[endpoint] = push
        try:
            for message in encode_handoff(handoff, chunk_layers=self._chunk_layers):
                with self._lock:
                    if handoff.request_id in self._cancelled:
                        return "the request was aborted"
                push.send_multipart(message, copy=False)
            return ""
        except zmq.Again:
            error = f"decode worker {endpoint} took no message for {self._send_timeout_ms} ms"
        except (zmq.ZMQError, ValueError, RuntimeError) as failure:
            error = f"sending KV to {endpoint} failed: {failure}"
        # A transfer cut off mid-way may have left messages queued: a fresh socket drops them, so the
        # decode worker never receives the tail of a transfer without its head.
        pushes.pop(endpoint).close(linger=0)
        log.warning("KV transfer of %s: %s", handoff.request_id, error)
        return error


@dataclass(slots=True)
class Expectation:
    peer: bytes  # the ROUTER identity of the gateway that sent the ExpectTransferRequest
    constraint: TokenConstraint | None  # compiled, not yet advanced over the prefill's tokens
    timeout_s: float
    deadline: float  # time.monotonic()


@dataclass(slots=True)
class Received:
    """What one transfer message settled: a handoff complete for its expectation, or a failure."""

    request_id: str
    expectation: Expectation
    handoff: KVHandoff | None = None
    error: str = ""


@dataclass(slots=True)
class TransferReceiver:
    pull: zmq.Socket
    default_timeout_s: float  # for an expectation that names no timeout of its own
    assembler: HandoffAssembler = field(default_factory=HandoffAssembler)
    expected: dict[str, Expectation] = field(default_factory=dict)

    def expect(self, request_id: str, peer: bytes, constraint: TokenConstraint | None, timeout_s: float = 0.0) -> None:
        """Wait for the request's KV for `timeout_s` from now (0: the default)."""
        timeout_s = timeout_s or self.default_timeout_s
        self.expected[request_id] = Expectation(peer, constraint, timeout_s, time.monotonic() + timeout_s)

    def drop(self, request_id: str) -> Expectation | None:
        self.assembler.discard(request_id)
        return self.expected.pop(request_id, None)

    def receive(self, max_messages: int) -> list[Received]:
        settled = []
        for _ in range(max_messages):
            try:
                frames = self.pull.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            received = self._feed(frames)
            if received is not None:
                settled.append(received)
        return settled

    def expired(self, now: float) -> list[Received]:
        late = [request_id for request_id, expectation in self.expected.items() if expectation.deadline <= now]
        settled = []
        for request_id in late:
            expectation = self.drop(request_id)
            settled.append(Received(request_id, expectation, error=f"no KV arrived within {expectation.timeout_s:g} s"))
        return settled

    def _feed(self, frames: Sequence[zmq.Frame]) -> Received | None:
        # Assemble only what a request waits for, so the KV of aborted requests, or of senders that
        # died mid-way, holds no memory here.
        try:
            request_id = _lead_decoder.decode(frames[0].buffer).request_id
        except msgspec.DecodeError:
            request_id = None
        if request_id is not None and request_id not in self.expected:
            log.warning("dropped a KV transfer message of %s: no request expects it", request_id)
            return None
        try:
            handoff = self.assembler.feed(frames)
        except KVTransferError as error:
            expectation = self.drop(error.request_id) if error.request_id else None
            if expectation is None:
                log.warning("dropped a KV transfer message: %s", error)
                return None
            return Received(error.request_id, expectation, error=str(error))
        if handoff is None:
            return None
        return Received(handoff.request_id, self.expected.pop(handoff.request_id), handoff=handoff)
