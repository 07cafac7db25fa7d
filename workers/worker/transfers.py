"""The disaggregation side of a worker: a prefill worker sends each finished prefill's KV to the
decode worker the gateway named, on its sender thread, and releases the pages once the KV is there;
a decode worker takes in the KV it was told to expect and continues those requests. Both ends are in
workers.transfer.link; this module ties them to the engine and to the requests' owners.

How the KV goes (workers.transfer): with `kv_transfer` "auto" a worker offers its pages (its KV
cache is a pool another worker of its host can map) and the decode worker copies them page to page,
on a side stream on a GPU, while its engine steps on: the request joins the running batch when the
copy is done, and the answer "done" lets the prefill worker release its pages. A decode worker that
cannot map the pool asks for frames instead; an offer that does not describe what it maps, or pages
that do not fit, is refused ("failed") and the request fails its transfer (the gateway reruns it).

A decode worker compiles an expected request's constraint when told to expect it, so that one that
does not compile is refused before the prefill is wasted on it; when the KV arrives, a constraint
that fails on the tokens the prefill worker sampled fails that request ("invalid_constraint"), not
its transfer: another attempt would fail the same way.
"""

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import zmq

from workers.engine.connectors.handoff import continuing
from workers.engine.engine import LLMEngine
from workers.engine.structured.constraint import ConstraintError
from workers.protocol.errors import EngineOverloadedError, InvalidConstraintError, InvalidRequestError
from workers.protocol.messages import (
    REPLY_DONE,
    REPLY_FAILED,
    ExpectTransferRequest,
    GenerateError,
    GenerateOutput,
    HandoffTotals,
    WorkerOutbound,
)
from workers.transfer.link import FRAMES, Received, SendResult, TransferReceiver, TransferSender
from workers.transfer.page_copy import PageCopy, PageCopyError
from workers.transfer.pools import PoolError, PoolExport, PoolMaps, backend_of
from workers.worker.control import WorkerControl

log = logging.getLogger(__name__)

# How long a worker keeps the pages it offers pinned for the decode worker to copy them: far longer
# than a copy takes (milliseconds) and than a decode worker's loop takes to get to it (one step).
OFFER_HOLD_S = 30.0

Send = Callable[[bytes, WorkerOutbound], None]


@dataclass(slots=True)
class _Copy:
    """A pool offer whose pages are being copied into pages reserved for the request."""

    received: Received
    copy: PageCopy
    aborted: bool = False  # its owner gave up: the pages go back once the copy is done


class Transfers:
    """`owners` (request id → ROUTER identity of the peer streaming its outputs) is the worker's,
    shared: a request continued here gets its owner there. `receiver` exists on a decode worker,
    `sender` on a prefill worker (and on a decode worker, for migrations). A worker with a sender
    exports its own KV cache for others to map (`pool`), None when it offers no pages (no sender,
    `kv_transfer` "zmq", or a cache that cannot be shared)."""

    def __init__(
        self,
        *,
        worker_id: str,
        role: str,
        engine: LLMEngine,
        control: WorkerControl,
        owners: dict[str, bytes],
        send: Send,
        receiver: TransferReceiver | None,
        sender: TransferSender | None,
        continued: Callable[[str], None] = lambda request_id: None,
        migrated: Callable[[str], None] = lambda request_id: None,
    ) -> None:
        """`continued(request_id)` is called for each request taken in from a transfer, `migrated`
        for each request this worker handed to another decode worker."""
        self.worker_id = worker_id
        self.role = role
        self.engine = engine
        self.control = control
        self.owners = owners
        self.send = send
        self.receiver = receiver
        self.sender = sender
        self.maps_pools = engine.info.kv_transfer == "auto"
        # A sender whose peers may map its KV cache offers its pages instead of sending frames.
        self.pool = PoolExport.of(engine.kv_cache, worker_id) if sender is not None and self.maps_pools else None
        self.pool_maps = PoolMaps()
        # Copies of offered pages run on a stream of their own, beside the engine's steps.
        self.copy_stream = _side_stream(engine) if receiver is not None else None
        self.copies: dict[str, _Copy] = {}  # request id → its pages being copied from a pool
        self.decode_endpoints: dict[str, str] = {}  # request id → where its KV goes after prefill
        self.sending: dict[str, bytes] = {}  # request id → owner, while its KV is being sent
        self.continued = continued
        self.migrated = migrated
        self.migrating: set[str] = set()  # of `sending`, the requests a draining decode worker hands on
        self.num_migrated_out = 0
        self.num_migrations_failed = 0
        self.num_migrations_declined = 0  # offers the peer declined (workers.worker.migration)
        self.num_migrated_in = 0
        self.sent: dict[str, HandoffTotals] = {}  # by backend
        self.received: dict[str, HandoffTotals] = {}

    @property
    def expected(self) -> list[str]:
        """Request ids whose KV this worker is waiting for."""
        return [*self.receiver.expected, *self.copies] if self.receiver is not None else []

    def expected_peers(self) -> dict[str, bytes]:
        """Request id → the peer that expects its outputs, for the transfers this worker waits for."""
        expected = self.receiver.expected if self.receiver is not None else {}
        peers = {request_id: expectation.peer for request_id, expectation in expected.items()}
        peers.update({request_id: c.received.expectation.peer for request_id, c in self.copies.items()})
        return peers

    @property
    def num_in_flight(self) -> int:
        return len(self.sending) + len(self.expected)

    @property
    def copying(self) -> bool:
        """Whether pages are being copied in: the worker's loop then checks on them without waiting."""
        return bool(self.copies)

    def handoff_totals(self) -> "HandoffTotalsBySide":
        """The KV handoffs this worker sent and received since it started, by transfer backend (the
        heartbeats' counters)."""
        return HandoffTotalsBySide(sent=dict(self.sent), received=dict(self.received))

    def poll(self, ready: dict[zmq.Socket, int], max_messages: int) -> None:
        """Take in arrived and expired transfers and finished copies, and the sender's finished sends."""
        if self.receiver is not None:
            if self.receiver.router in ready:
                for received in self.receiver.receive(max_messages):
                    self._take(received)
            for received in self.receiver.expired(time.monotonic()):
                self._take(received)
            self._finish_copies()
        if self.sender is not None and self.sender.results in ready:
            self.finish_sends(self.sender.take_results())

    def on_expect_transfer(self, peer: bytes, request: ExpectTransferRequest) -> None:
        request_id = request.request_id
        if self.receiver is None:
            message = f"worker {self.worker_id} is a {self.role} worker: it takes no KV transfers"
            self.send(peer, GenerateError(request_id, "invalid_request", message))
        elif not self.control.accepting:
            message = f"worker {self.worker_id} is {self.control.state} and takes no new requests"
            self.send(peer, GenerateError(request_id, "draining", message))
        elif request_id in self.owners or request_id in self.receiver.expected or request_id in self.copies:
            message = f"request id {request_id!r} is already in use"
            self.send(peer, GenerateError(request_id, "invalid_request", message))
        else:
            try:
                if request.constraint is not None:
                    # Compiled now only to refuse one that does not compile before the prefill is spent
                    # on it; the engine compiles it again when the KV arrives.
                    self.engine.compile_constraint(request_id, request.constraint)
            except InvalidConstraintError as error:
                self.send(peer, GenerateError(request_id, "invalid_constraint", str(error)))
                return
            for received in self.receiver.expect(request_id, peer, request.constraint, request.timeout_s):
                self._take(received)

    def send_after_prefill(self, request_id: str, decode_endpoint: str) -> None:
        """Remember where a prefill-only request's KV goes once its first token is out."""
        self.decode_endpoints[request_id] = decode_endpoint

    def start_send(self, request_id: str, owner: bytes) -> None:
        """The request finished its prefill ("transfer"): send its KV on the sender thread."""
        endpoint = self.decode_endpoints.pop(request_id)
        self.sending[request_id] = owner
        self._submit(request_id, endpoint, self.engine.export_kv(request_id))

    def start_migration(self, request_id: str, new_request_id: str, endpoint: str, owner: bytes) -> None:
        """Send a request suspended for migration (LLMEngine.suspend_for_migration), KV and decoding
        state, to the decode worker at `endpoint`, which expects it as `new_request_id`."""
        handoff = dataclasses.replace(self.engine.export_kv(request_id), request_id=new_request_id, migrated=True)
        self.sending[request_id] = owner
        self.migrating.add(request_id)
        self._submit(request_id, endpoint, handoff)

    def _submit(self, request_id: str, endpoint: str, handoff) -> None:
        offer = self.pool.offer(list(handoff.pages), OFFER_HOLD_S) if self.pool is not None else None
        self.sender.submit(request_id, endpoint, handoff, offer)

    def forget(self, request_id: str) -> None:
        """The request ended before its KV was due anywhere."""
        self.decode_endpoints.pop(request_id, None)

    def abort(self, request_id: str) -> bool:
        """Stop a transfer under way: a send stops at its next message (its owner, who has its last
        output, gets no transfer_failed for it); an expected transfer's owner gets a last output with
        finish_reason "abort" (pages being copied in go back once the copy is done). False when the
        request has no transfer."""
        if request_id in self.sending:
            self.sending[request_id] = b""
            self.sender.cancel(request_id)
            return True
        copying = self.copies.get(request_id)
        if copying is not None and not copying.aborted:
            copying.aborted = True
            self.send(copying.received.expectation.peer, GenerateOutput(request_id, [], "", finish_reason="abort"))
            return True
        expectation = self.receiver.drop(request_id) if self.receiver is not None else None
        if expectation is None:
            return False
        self.send(expectation.peer, GenerateOutput(request_id, [], "", finish_reason="abort"))
        return True

    def finish_sends(self, results: list[SendResult]) -> None:
        """The sender thread is done with these handoffs: their pages can go."""
        for result in results:
            self.engine.release_transfer(result.request_id)
            owner = self.sending.pop(result.request_id, None)
            if result.backend:
                _count(self.sent, result.backend, result.num_bytes, result.seconds)
            if result.request_id in self.migrating:
                self.migrating.discard(result.request_id)
                if result.error:
                    self.num_migrations_failed += 1
                else:
                    self.num_migrated_out += 1
                    self.migrated(result.request_id)
            if result.error and owner is not None:
                self.send(owner, GenerateError(result.request_id, "transfer_failed", result.error))
        self.control.check_drained()

    def close(self) -> None:
        """Finish the sends under way (at shutdown); pages being copied in go back."""
        for request_id in list(self.copies):
            self.engine.cancel_prefilled(request_id)
        self.copies.clear()
        if self.sender is not None:
            self.finish_sends(self.sender.close())

    def _take(self, received: Received) -> None:
        if received.offer is not None:
            self._take_offer(received)
        else:
            self._continue(received)

    def _take_offer(self, received: Received) -> None:
        """Map the offered pool and start copying the request's pages into pages reserved for it;
        or ask for frames, when this worker cannot map the pool; or refuse."""
        offer, handoff = received.offer, received.handoff
        why_not = "this worker takes KV as frames (kv_transfer zmq)" if not self.maps_pools else ""
        why_not = why_not or self.pool_maps.usable(offer)
        page_size = self.engine.kv_cache.page_size
        if not why_not and offer.shape[4] != page_size:
            why_not = f"its pages hold {offer.shape[4]} tokens, this worker's {page_size}"
        if why_not:
            self.receiver.ask_for_frames(received, why_not)
            return
        expected_pages = -(-handoff.num_computed_tokens // page_size)
        if len(offer.pages) != expected_pages:
            self._refuse(received, f"{len(offer.pages)} pages offered for {handoff.num_computed_tokens} tokens")
            return
        try:
            pool = self.pool_maps.open(offer, self.engine.info.kv_layout)
        except PoolError as error:
            self._refuse(received, str(error))
            return
        try:
            self.engine.disaggregation.receive(handoff, copied_in=True)
            self.engine.add_request(continuing(handoff, received.expectation.constraint))
            reservation = self.engine.reservation(received.request_id)
        except Exception as error:
            self._refuse_admission(received, error)
            return
        first = reservation.start // page_size
        try:
            copy = PageCopy.start(
                pool,
                offer.pages[first:],
                self.engine.kv_cache.pages,
                reservation.pages[first : len(offer.pages)],
                self.copy_stream,
            )
        except PageCopyError as error:
            self.engine.cancel_prefilled(received.request_id)
            self._refuse(received, str(error))
            return
        self.copies[received.request_id] = _Copy(received, copy)

    def _finish_copies(self) -> None:
        for request_id in [request_id for request_id, c in self.copies.items() if c.copy.done()]:
            copying = self.copies.pop(request_id)
            received = copying.received
            late = time.monotonic() > received.offer.expires_at
            if copying.aborted or late:
                self.engine.cancel_prefilled(request_id)
                # Late: the sender released its pages at the offer's end, and may have reused them.
                self.receiver.reply(received.sender, request_id, REPLY_DONE if not late else REPLY_FAILED)
                if late and not copying.aborted:
                    self._fail(received, "the KV was copied after its offer ended")
                continue
            self.engine.admit_prefilled(request_id)
            self.receiver.reply(received.sender, request_id, REPLY_DONE)
            _count(
                self.received, backend_of(received.offer), copying.copy.num_bytes, time.monotonic() - received.started
            )
            self._admitted(received)
        self.control.check_drained()

    def _refuse(self, received: Received, error: str) -> None:
        self.receiver.reply(received.sender, received.request_id, REPLY_FAILED, error)
        self._fail(received, f"KV transfer {received.request_id!r}: {error}")

    def _refuse_admission(self, received: Received, error: Exception) -> None:
        """The engine would not take the request: as for KV arriving as frames (see _continue)."""
        self.receiver.reply(received.sender, received.request_id, REPLY_FAILED, str(error))
        self._reject(received, error)

    def _continue(self, received: Received) -> None:
        """A transfer this worker expected completed or failed: admit the request, or tell its owner."""
        if received.handoff is None:
            self._fail(received, received.error)
            return
        try:
            self.engine.disaggregation.receive(received.handoff)
            self.engine.add_request(continuing(received.handoff, received.expectation.constraint))
        except Exception as error:
            self._reject(received, error)
            return
        layers = received.handoff.layers
        _count(self.received, FRAMES, sum(layer.nbytes for layer in layers), time.monotonic() - received.started)
        self._admitted(received)

    def _reject(self, received: Received, error: Exception) -> None:
        """The engine refused a request whose KV arrived; it changed nothing."""
        peer, request_id = received.expectation.peer, received.request_id
        if isinstance(error, ConstraintError | InvalidConstraintError):
            self.send(peer, GenerateError(request_id, "invalid_constraint", str(error)))
        elif isinstance(error, InvalidRequestError | EngineOverloadedError):
            self._fail(received, str(error))
        else:
            log.error("continuing request %s failed", request_id, exc_info=error)
            self.send(peer, GenerateError(request_id, "internal", "the worker failed to continue this request"))

    def _admitted(self, received: Received) -> None:
        self.owners[received.request_id] = received.expectation.peer
        self.num_migrated_in += received.handoff.migrated
        self.continued(received.request_id)

    def _fail(self, received: Received, error: str) -> None:
        log.warning("KV transfer of %s failed: %s", received.request_id, error)
        self.send(received.expectation.peer, GenerateError(received.request_id, "transfer_failed", error))
        self.control.check_drained()


class HandoffTotalsBySide(NamedTuple):
    sent: dict[str, HandoffTotals]
    received: dict[str, HandoffTotals]


def _side_stream(engine: LLMEngine) -> "torch.cuda.Stream | None":
    device = engine.kv_cache.device
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def _count(totals: dict[str, HandoffTotals], backend: str, num_bytes: int, seconds: float) -> None:
    previous = totals.get(backend, HandoffTotals(num_transfers=0, num_bytes=0, seconds=0.0))
    totals[backend] = HandoffTotals(
        num_transfers=previous.num_transfers + 1,
        num_bytes=previous.num_bytes + num_bytes,
        seconds=previous.seconds + seconds,
    )
