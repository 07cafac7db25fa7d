"""The two ends of KV transfers: a sending worker's sender thread and a decode worker's receiver.

Sockets: the sender keeps one DEALER per decode endpoint, open; the decode worker binds a ROUTER, so
it can answer what it is sent. ZMQ_IMMEDIATE queues nothing for a peer that is not connected, so a
send to a decode worker that is gone blocks, and the send timeout turns that into a failed transfer
instead of messages held forever. Over the network both are CURVE (workers.curve): a decode worker
that does not hold the cluster's key never gets the KV.

Sender: transfers run on a thread of their own, so that copying layers out of pages and pushing them
onto the wire overlaps the engine's next steps. A transfer goes one of two ways (workers.protocol,
"KV transfer"):
- frames: the layer frames are copies made as each layer is read (PagedLayers), and ZMQ holds a
  reference to each until it is sent, so the transfer is done, and the pages free, once the thread
  has handed the last one over;
- a pool offer (workers.transfer.pools): the header alone. The decode worker copies the pages and
  answers "done", or answers "failed", or "frames" when it cannot map the pool (the frames follow).
  The pages stay the sender's until the answer, or until the offer's hold time is over (a decode
  worker that is gone never answers; one that copies later than that discards what it copied).
The thread reports each transfer's outcome on an inproc socket the worker's loop polls; only that
loop touches the engine.

Receiver: a transfer is taken in only for a request the gateway said to expect
(ExpectTransferRequest); an expectation whose KV has not arrived within its timeout (the one the
gateway predicted for it, else the worker's default) fails, as does any malformed transfer. The
gateway sends the expectation before the prefill worker gets the request, but over another
connection than the KV comes on, so nothing orders the two: the KV can arrive first (a connection
still being set up, a loaded host). A message of a request not expected yet is held, for up to
EARLY_HOLD_S and EARLY_MAX_BYTES in all, and taken in when its expectation comes; past either limit,
or of a request aborted here, it is dropped (an offer of one is answered "failed", so its pages go).
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
from workers.engine.kv_handoff import KVHandoff
from workers.protocol.messages import (
    REPLY_DONE,
    REPLY_FAILED,
    REPLY_FRAMES,
    KVPoolOffer,
    KVTransferHeader,
    KVTransferReply,
    OutputConstraintSpec,
)
from workers.transfer.frames import (
    DTYPES,
    HandoffAssembler,
    KVTransferError,
    check_header,
    decode_lead,
    encode_handoff,
    encode_offer,
    handoff_of,
)
from workers.transfer.pools import backend_of

log = logging.getLogger(__name__)

SEND_TIMEOUT_MS = 2000  # longest a send waits for a decode worker to connect or take a message
FRAMES = "zmq"  # the backend of frames through host memory, as metrics and logs name it
CLOSE_GRACE_S = 2.0  # how long closing waits for the answers to offers under way
EARLY_HOLD_S = 5.0  # how long a transfer that arrived before its expectation waits for it
EARLY_MAX_BYTES = 256 << 20  # the most bytes of such transfers held at once
_senders = count()
_reply_encoder = msgspec.msgpack.Encoder()
_reply_decoder = msgspec.msgpack.Decoder(KVTransferReply)


@dataclass(frozen=True, slots=True)
class SendResult:
    request_id: str
    # "" when the KV reached the decode worker: frames handed to ZMQ, pages copied, or a transfer the
    # decode worker refused (it tells the request's owner itself).
    error: str
    backend: str = ""  # how the KV went: FRAMES, or the pool's backend; "" when it did not
    num_bytes: int = 0
    seconds: float = 0.0  # from the transfer's start to its last frame sent, or its pages' "done"


@dataclass(slots=True)
class _Job:
    request_id: str
    endpoint: str
    handoff: KVHandoff
    offer: KVPoolOffer | None
    started: float = field(default_factory=time.monotonic)


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
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        name = next(_senders)
        # Bound before the thread connects: inproc needs the bind first.
        self.results = context.socket(zmq.PULL)
        self.results.bind(f"inproc://transfer-results-{name}")
        self._bell = context.socket(zmq.PUSH)  # wakes the thread for a job; used by the caller's thread only
        self._bell.bind(f"inproc://transfer-jobs-{name}")
        self._thread = threading.Thread(target=self._run, args=(name,), name="kv-sender", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, endpoint: str, handoff: KVHandoff, offer: KVPoolOffer | None = None) -> None:
        """Send the handoff's KV to `endpoint`: its pages as `offer` when given, else as frames."""
        self._jobs.put(_Job(request_id, endpoint, handoff, offer))
        self._bell.send(b"")

    def cancel(self, request_id: str) -> None:
        """Stop sending the request's frames at the next message; its result still comes (as an error).
        An offer is not withdrawn: the decode worker may be copying its pages, whose answer is awaited."""
        with self._lock:
            self._cancelled.add(request_id)

    def take_results(self) -> list[SendResult]:
        results = []
        while True:
            try:
                fields = msgspec.msgpack.decode(self.results.recv(zmq.NOBLOCK))
            except zmq.Again:
                return results
            result = SendResult(*fields)
            with self._lock:
                self._cancelled.discard(result.request_id)
            results.append(result)

    def close(self) -> list[SendResult]:
        """Finish the transfers under way (waiting up to CLOSE_GRACE_S for offers' answers) and stop;
        the results not taken yet."""
        self._jobs.put(None)
        self._bell.send(b"")
        self._thread.join()
        results = self.take_results()
        self.results.close(linger=0)
        self._bell.close(linger=0)
        return results

    def _run(self, name: int) -> None:
        results = self._context.socket(zmq.PUSH)
        results.connect(f"inproc://transfer-results-{name}")
        bell = self._context.socket(zmq.PULL)
        bell.connect(f"inproc://transfer-jobs-{name}")
        state = _SenderState(results, zmq.Poller())
        state.poller.register(bell, zmq.POLLIN)
        closing_at: float | None = None
        try:
            while closing_at is None or (state.awaiting and time.monotonic() < closing_at + CLOSE_GRACE_S):
                ready = dict(state.poller.poll(state.poll_timeout_ms()))
                if bell in ready:
                    while bell.poll(0):
                        bell.recv()
                    while not self._jobs.empty():
                        job = self._jobs.get()
                        if job is None:
                            closing_at = time.monotonic()
                        else:
                            self._start(state, job)
                for dealer in [socket for socket in ready if socket is not bell]:
                    if dealer in state.dealers.values():  # not closed by a failure meanwhile
                        self._take_replies(state, dealer)
                state.expire(time.monotonic())
            for job in state.awaiting.values():
                state.report(job, "the worker stopped before the decode worker answered")
        finally:
            for dealer in state.dealers.values():
                dealer.close(linger=0)
            bell.close(linger=0)
            results.close(linger=1000)

    def _start(self, state: "_SenderState", job: _Job) -> None:
        if self._is_cancelled(job.request_id):
            state.report(job, "the request was aborted")
            return
        dealer = state.dealers.get(job.endpoint)
        if dealer is None:
            try:
                dealer = self._connect(job.endpoint)
            except (curve.CurveError, zmq.ZMQError) as error:  # a decode endpoint this worker may not reach
                log.warning("KV transfer of %s: %s", job.request_id, error)
                state.report(job, str(error))
                return
            state.dealers[job.endpoint] = dealer
            state.poller.register(dealer, zmq.POLLIN)
        if job.offer is None:
            self._send_frames(state, job)
            return
        try:
            dealer.send_multipart(encode_offer(job.handoff, job.offer))
        except zmq.Again:
            self._failed(state, job, f"decode worker {job.endpoint} took no message for {self._send_timeout_ms} ms")
            return
        state.awaiting[job.handoff.request_id] = job  # answered under the id on the wire (a migration's new one)

    def _connect(self, endpoint: str) -> zmq.Socket:
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IMMEDIATE, 1)
        dealer.setsockopt(zmq.SNDTIMEO, self._send_timeout_ms)
        try:
            curve.connect(dealer, endpoint, self._key)
        except BaseException:
            dealer.close(linger=0)
            raise
        return dealer

    def _send_frames(self, state: "_SenderState", job: _Job) -> None:
        dealer = state.dealers[job.endpoint]
        num_bytes = 0
        try:
            for message in encode_handoff(job.handoff, chunk_layers=self._chunk_layers):
                if self._is_cancelled(job.request_id):
                    state.report(job, "the request was aborted")
                    return
                dealer.send_multipart(message, copy=False)
                num_bytes += sum(len(frame) if isinstance(frame, bytes) else frame.nbytes for frame in message[1:])
        except zmq.Again:
            error = f"decode worker {job.endpoint} took no message for {self._send_timeout_ms} ms"
        except (zmq.ZMQError, ValueError, RuntimeError) as failure:
            error = f"sending KV to {job.endpoint} failed: {failure}"
        else:
            state.report(job, "", FRAMES, num_bytes)
            return
        self._failed(state, job, error)

    def _failed(self, state: "_SenderState", job: _Job, error: str) -> None:
        # A transfer cut off mid-way may have left messages queued: a fresh socket drops them, so the
        # decode worker never receives the tail of a transfer without its head.
        dealer = state.dealers.pop(job.endpoint)
        state.poller.unregister(dealer)
        dealer.close(linger=0)
        for wire_id in [wire_id for wire_id, other in state.awaiting.items() if other.endpoint == job.endpoint]:
            state.report(state.awaiting.pop(wire_id), f"the link to {job.endpoint} failed")
        log.warning("KV transfer of %s: %s", job.request_id, error)
        state.report(job, error)

    def _take_replies(self, state: "_SenderState", dealer: zmq.Socket) -> None:
        while True:
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = _reply_decoder.decode(frames[-1])
            except msgspec.DecodeError:
                log.warning("dropped an unreadable answer to a KV offer")
                continue
            job = state.awaiting.pop(reply.request_id, None)
            if job is None:
                continue  # its offer expired: the pages are gone already
            if reply.action == REPLY_DONE:
                state.report(job, "", backend_of(job.offer), _offered_bytes(job.offer))
            elif reply.action == REPLY_FRAMES:
                log.info("KV transfer of %s goes as frames: %s", job.request_id, reply.error)
                self._send_frames(state, job)
                if dealer not in state.dealers.values():
                    return  # the link failed sending them, and was closed
            else:
                # The decode worker refused what it was sent, and told the request's owner so, as it
                # does a refused transfer of frames: for this side the transfer is over.
                log.info("decode worker %s refused the KV of %s: %s", job.endpoint, job.request_id, reply.error)
                state.report(job, "")

    def _is_cancelled(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._cancelled


@dataclass(slots=True)
class _SenderState:
    """The sender thread's own: its sockets and the offers awaiting an answer."""

    results: zmq.Socket
    poller: zmq.Poller
    dealers: dict[str, zmq.Socket] = field(default_factory=dict)
    awaiting: dict[str, _Job] = field(default_factory=dict)

    def report(self, job: _Job, error: str, backend: str = "", num_bytes: int = 0) -> None:
        seconds = time.monotonic() - job.started
        self.results.send(msgspec.msgpack.encode((job.request_id, error, backend, num_bytes, seconds)))

    def poll_timeout_ms(self) -> int | None:
        if not self.awaiting:
            return None
        soonest = min(job.offer.expires_at for job in self.awaiting.values())
        return max(0, int((soonest - time.monotonic()) * 1000) + 1)

    def expire(self, now: float) -> None:
        for wire_id in [wire_id for wire_id, job in self.awaiting.items() if job.offer.expires_at <= now]:
            job = self.awaiting.pop(wire_id)
            self.report(job, f"decode worker {job.endpoint} did not answer the offer of its KV in time")


def _offered_bytes(offer: KVPoolOffer) -> int:
    layers, planes, heads, _, page_size, width = offer.shape
    return layers * planes * heads * page_size * width * DTYPES[offer.dtype].itemsize * len(offer.pages)


@dataclass(slots=True)
class Expectation:
    peer: bytes  # the ROUTER identity of the gateway that sent the ExpectTransferRequest
    constraint: OutputConstraintSpec | None  # compiled by the engine when the KV arrives
    timeout_s: float
    deadline: float  # time.monotonic()


@dataclass(slots=True)
class Received:
    """What one transfer message settled: a handoff complete for its expectation (`handoff`, its
    layers received as frames), an offer of its pages (`offer`, `handoff` without layers), or a
    failure (`error`). `sender` is the sending worker's identity on this ROUTER, for `reply`."""

    request_id: str
    expectation: Expectation
    handoff: KVHandoff | None = None
    error: str = ""
    offer: KVPoolOffer | None = None
    sender: bytes = b""
    started: float = 0.0  # time.monotonic() when the transfer's first message arrived


@dataclass(slots=True)
class _Early:
    """A transfer message that arrived before its request's expectation."""

    sender: bytes
    frames: Sequence[zmq.Frame]
    arrived: float  # time.monotonic()
    is_offer: bool
    num_bytes: int


@dataclass(slots=True)
class TransferReceiver:
    router: zmq.Socket
    default_timeout_s: float  # for an expectation that names no timeout of its own
    # The receiving cache's layout (KVCacheSpecs.layout): a transfer of another is refused at its header.
    kv_layout: str | None = None
    assembler: HandoffAssembler = field(init=False)
    expected: dict[str, Expectation] = field(default_factory=dict)
    _started: dict[str, float] = field(default_factory=dict)  # request id → its frames' first arrival
    early: dict[str, list[_Early]] = field(default_factory=dict)  # request id → its messages held
    early_bytes: int = 0
    _aborted: dict[str, float] = field(default_factory=dict)  # request id → when; kept EARLY_HOLD_S

    def __post_init__(self) -> None:
        self.assembler = HandoffAssembler(kv_layout=self.kv_layout)

    def expect(
        self, request_id: str, peer: bytes, constraint: OutputConstraintSpec | None, timeout_s: float = 0.0
    ) -> list[Received]:
        """Wait for the request's KV for `timeout_s` from now (0: the default); what its messages
        that arrived before settled."""
        timeout_s = timeout_s or self.default_timeout_s
        self.expected[request_id] = Expectation(peer, constraint, timeout_s, time.monotonic() + timeout_s)
        held = self.early.pop(request_id, [])
        if not held:
            return []
        self.early_bytes -= sum(message.num_bytes for message in held)
        self._started[request_id] = held[0].arrived
        settled = (self._feed(message.sender, message.frames) for message in held)
        return [received for received in settled if received is not None]

    def drop(self, request_id: str) -> Expectation | None:
        """Forget the request (aborted): what still comes of its KV is refused, not held."""
        self._aborted[request_id] = time.monotonic()
        self._release_early(request_id, "it was aborted")
        return self._forget(request_id)

    def _forget(self, request_id: str) -> Expectation | None:
        self.assembler.discard(request_id)
        self._started.pop(request_id, None)
        return self.expected.pop(request_id, None)

    def ask_for_frames(self, received: Received, reason: str) -> None:
        """Answer an offer "frames": the request waits for them under its expectation again."""
        self.expected[received.request_id] = received.expectation
        self._started[received.request_id] = received.started
        self.reply(received.sender, received.request_id, REPLY_FRAMES, reason)

    def reply(self, sender: bytes, request_id: str, action: str, error: str = "") -> None:
        # A ROUTER drops messages to peers that are gone rather than blocking.
        self.router.send_multipart([sender, _reply_encoder.encode(KVTransferReply(request_id, action, error))])

    def receive(self, max_messages: int) -> list[Received]:
        settled = []
        for _ in range(max_messages):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            received = self._feed(frames[0].bytes, frames[1:])
            if received is not None:
                settled.append(received)
        return settled

    def expired(self, now: float) -> list[Received]:
        held_too_long = [request_id for request_id, held in self.early.items() if held[0].arrived + EARLY_HOLD_S <= now]
        for request_id in held_too_long:
            self._release_early(request_id, f"no request expected it within {EARLY_HOLD_S:g} s")
        for request_id in [request_id for request_id, at in self._aborted.items() if at + EARLY_HOLD_S <= now]:
            del self._aborted[request_id]
        late = [request_id for request_id, expectation in self.expected.items() if expectation.deadline <= now]
        settled = []
        for request_id in late:
            expectation = self._forget(request_id)
            settled.append(Received(request_id, expectation, error=f"no KV arrived within {expectation.timeout_s:g} s"))
        return settled

    def _feed(self, sender: bytes, frames: Sequence[zmq.Frame]) -> Received | None:
        # Take in only what a request waits for, so the KV of aborted requests, or of senders that
        # died mid-way, holds no memory here.
        try:
            lead = decode_lead(frames[0]) if frames else None
        except KVTransferError as error:
            log.warning("dropped a KV transfer message: %s", error)
            return None
        if lead is None:
            log.warning("dropped an empty KV transfer message")
            return None
        request_id = lead.request_id
        if request_id not in self.expected:
            self._hold_early(request_id, sender, frames, isinstance(lead, KVTransferHeader) and lead.pool is not None)
            return None
        started = self._started.setdefault(request_id, time.monotonic())
        if isinstance(lead, KVTransferHeader) and lead.pool is not None:
            return self._offered(sender, lead, started)
        try:
            handoff = self.assembler.feed_decoded(lead, frames)
        except KVTransferError as error:
            return Received(request_id, self.drop(request_id), error=str(error), sender=sender, started=started)
        if handoff is None:
            return None
        del self._started[request_id]
        return Received(request_id, self.expected.pop(request_id), handoff=handoff, sender=sender, started=started)

    def _hold_early(self, request_id: str, sender: bytes, frames: Sequence[zmq.Frame], is_offer: bool) -> None:
        message = _Early(sender, frames, time.monotonic(), is_offer, sum(len(frame) for frame in frames))
        if request_id in self._aborted:
            self._refuse(request_id, [message], "it was aborted")
        elif self.early_bytes + message.num_bytes > EARLY_MAX_BYTES:
            self._refuse(request_id, [message], f"{EARLY_MAX_BYTES} bytes of transfers are already waiting")
        else:
            self.early.setdefault(request_id, []).append(message)
            self.early_bytes += message.num_bytes

    def _release_early(self, request_id: str, reason: str) -> None:
        held = self.early.pop(request_id, [])
        if held:
            self.early_bytes -= sum(message.num_bytes for message in held)
            self._refuse(request_id, held, reason)

    def _refuse(self, request_id: str, messages: list[_Early], reason: str) -> None:
        log.warning("dropped %d KV transfer messages of %s: %s", len(messages), request_id, reason)
        for message in messages:
            if message.is_offer:
                self.reply(message.sender, request_id, REPLY_FAILED, f"no request expects this transfer: {reason}")

    def _offered(self, sender: bytes, header: KVTransferHeader, started: float) -> Received:
        request_id = header.request_id
        expectation = self._forget(request_id)
        try:
            check_header(header, self.kv_layout)
        except KVTransferError as error:
            self.reply(sender, request_id, REPLY_FAILED, str(error))
            return Received(request_id, expectation, error=f"KV transfer {request_id!r}: {error}")
        return Received(
            request_id, expectation, handoff=handoff_of(header), offer=header.pool, sender=sender, started=started
        )
