"""The disaggregation side of a worker: a prefill worker sends each finished prefill's KV to the
decode worker the gateway named, on its sender thread, and releases the pages once sent; a decode
worker takes in the KV it was told to expect and continues those requests. Both ends are in
workers.transfer_link; this module ties them to the engine and to the requests' owners.

A decode worker compiles an expected request's constraint when told to expect it, so that one that
does not compile is refused before the prefill is wasted on it; when the KV arrives, a constraint
that fails on the tokens the prefill worker sampled fails that request ("invalid_constraint"), not
its transfer: another attempt would fail the same way.
"""

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Collection
from typing import NamedTuple

import zmq

from workers.engine.constraints import ConstraintError, TokenConstraint
from workers.engine.engine import LLMEngine
from workers.engine.errors import EngineOverloadedError, InvalidRequestError
from workers.engine.kv_handoff import KVHandoff
from workers.protocol import (
    ExpectTransferRequest,
    GenerateError,
    GenerateOutput,
    HandoffTotals,
    OutputConstraintSpec,
    WorkerOutbound,
)
from workers.transfer_link import Received, SendResult, TransferReceiver, TransferSender
from workers.worker.control import WorkerControl

log = logging.getLogger(__name__)

Send = Callable[[bytes, WorkerOutbound], None]


class Transfers:
    """`owners` (request id → ROUTER identity of the peer streaming its outputs) is the worker's,
    shared: a request continued here gets its owner there. `receiver` exists on a decode worker,
    `sender` on a prefill worker."""

    def __init__(
        self,
        *,
        worker_id: str,
        role: str,
        engine: LLMEngine,
        control: WorkerControl,
        owners: dict[str, bytes],
        send: Send,
        compile_constraint: Callable[[OutputConstraintSpec], TokenConstraint],
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
        self.compile_constraint = compile_constraint
        self.receiver = receiver
        self.sender = sender
        self.decode_endpoints: dict[str, str] = {}  # request id → where its KV goes after prefill
        self.sending: dict[str, bytes] = {}  # request id → owner, while its KV is being sent
        self.continued = continued
        self.migrated = migrated
        self.migrating: set[str] = set()  # of `sending`, the requests a draining decode worker hands on
        self.num_migrated_out = 0
        self.num_migrations_failed = 0
        self.num_migrations_declined = 0  # offers the peer declined (workers.worker.migration)
        self.num_migrated_in = 0
        self.handoff_counts = ZMQHandoffCounts()

    @property
    def expected(self) -> list[str]:
        """Request ids whose KV this worker is waiting for."""
        return list(self.receiver.expected) if self.receiver is not None else []

    def expected_peers(self) -> dict[str, bytes]:
        """Request id → the peer that expects its outputs, for the transfers this worker waits for."""
        expected = self.receiver.expected if self.receiver is not None else {}
        return {request_id: expectation.peer for request_id, expectation in expected.items()}

    @property
    def num_in_flight(self) -> int:
        return len(self.sending) + (len(self.receiver.expected) if self.receiver is not None else 0)

    def poll(self, ready: dict[zmq.Socket, int], max_messages: int) -> None:
        """Take in arrived and expired transfers, and the sender's finished sends."""
        if self.receiver is not None:
            if self.receiver.pull in ready:
                read_at = time.monotonic()
                for received in self.receiver.receive(max_messages):
                    self.handoff_counts.settled(received, read_at)
                    self._continue(received)
                self.handoff_counts.reading(self.receiver.assembler.partial, read_at)
            for received in self.receiver.expired(time.monotonic()):
                self._continue(received)
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
        elif request_id in self.owners or request_id in self.receiver.expected:
            message = f"request id {request_id!r} is already in use"
            self.send(peer, GenerateError(request_id, "invalid_request", message))
        else:
            try:
                constraint = self.compile_constraint(request.constraint) if request.constraint is not None else None
            except InvalidRequestError as error:
                self.send(peer, GenerateError(request_id, "invalid_constraint", str(error)))
                return
            self.receiver.expect(request_id, peer, constraint, request.timeout_s)

    def send_after_prefill(self, request_id: str, decode_endpoint: str) -> None:
        """Remember where a prefill-only request's KV goes once its first token is out."""
        self.decode_endpoints[request_id] = decode_endpoint

    def start_send(self, request_id: str, owner: bytes) -> None:
        """The request finished its prefill ("transfer"): send its KV on the sender thread."""
        endpoint = self.decode_endpoints.pop(request_id)
        self.sending[request_id] = owner
        handoff = self.engine.export_kv(request_id)
        self.handoff_counts.sending(request_id, handoff)
        self.sender.submit(request_id, endpoint, handoff)

    def start_migration(self, request_id: str, new_request_id: str, endpoint: str, owner: bytes) -> None:
        """Send a request suspended for migration (LLMEngine.suspend_for_migration), KV and decoding
        state, to the decode worker at `endpoint`, which expects it as `new_request_id`."""
        handoff = dataclasses.replace(self.engine.export_kv(request_id), request_id=new_request_id, migrated=True)
        self.sending[request_id] = owner
        self.migrating.add(request_id)
        self.handoff_counts.sending(request_id, handoff)
        self.sender.submit(request_id, endpoint, handoff)

    def forget(self, request_id: str) -> None:
        """The request ended before its KV was due anywhere."""
        self.decode_endpoints.pop(request_id, None)

    def abort(self, request_id: str) -> bool:
        """Stop a transfer under way: a send stops at its next message (its owner, who has its last
        output, gets no transfer_failed for it); an expected transfer's owner gets a last output with
        finish_reason "abort". False when the request has no transfer."""
        if request_id in self.sending:
            self.sending[request_id] = b""
            self.sender.cancel(request_id)
            return True
        expectation = self.receiver.drop(request_id) if self.receiver is not None else None
        if expectation is None:
            return False
        self.send(expectation.peer, GenerateOutput(request_id, [], "", finish_reason="abort"))
        return True

    def finish_sends(self, results: list[SendResult]) -> None:
        """The sender thread is done with these handoffs: their pages can go."""
        for result in results:
            self.handoff_counts.sent(result.request_id, ok=not result.error)
            self.engine.release_transfer(result.request_id)
            owner = self.sending.pop(result.request_id, None)
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

    def handoff_totals(self) -> "HandoffTotalsBySide":
        """The KV handoffs this worker sent and received since it started, by transfer backend (the
        heartbeats' counters): a side the worker has no end of is empty."""
        counts = self.handoff_counts
        return HandoffTotalsBySide(
            sent={counts.BACKEND: counts.sent_totals} if self.sender is not None else {},
            received={counts.BACKEND: counts.received_totals} if self.receiver is not None else {},
        )

    def close(self) -> None:
        """Finish the sends under way (at shutdown)."""
        if self.sender is not None:
            self.finish_sends(self.sender.close())

    def _continue(self, received: Received) -> None:
        """A transfer this worker expected completed or failed: admit the request, or tell its owner."""
        peer, request_id = received.expectation.peer, received.request_id
        error = received.error
        if received.handoff is not None:
            try:
                self.engine.add_prefilled_request(received.handoff, constraint=received.expectation.constraint)
            except (InvalidRequestError, EngineOverloadedError) as refusal:
                error = str(refusal)
            except ConstraintError as failure:
                self.send(peer, GenerateError(request_id, "invalid_constraint", str(failure)))
                return
            except Exception:
                # The engine changed nothing (add_prefilled_request): this request fails, the worker goes on.
                log.exception("continuing request %s failed", request_id)
                self.send(peer, GenerateError(request_id, "internal", "the worker failed to continue this request"))
                return
            else:
                self.owners[request_id] = peer
                self.num_migrated_in += received.handoff.migrated
                self.continued(request_id)
                return
        log.warning("KV transfer of %s failed: %s", request_id, error)
        self.send(peer, GenerateError(request_id, "transfer_failed", error))
        self.control.check_drained()


class HandoffTotalsBySide(NamedTuple):
    sent: dict[str, HandoffTotals]
    received: dict[str, HandoffTotals]


# --- Counting today's ZMQ handoffs for handoff_totals(). A rewrite of the transfer path replaces this
# with its own counting behind the same handoff_totals(). ---


class ZMQHandoffCounts:
    """A send counts once the sender thread has handed its last message to ZMQ, timed from its submit
    to the worker's loop taking that result; a receive once its handoff is assembled, timed from the
    read of its first message (to the start of the receive call that read it). Totals are replaced,
    never changed, so the heartbeat thread reads each side whole."""

    BACKEND = "zmq"

    def __init__(self) -> None:
        self.sent_totals = HandoffTotals(num_transfers=0, num_bytes=0, seconds=0.0)
        self.received_totals = HandoffTotals(num_transfers=0, num_bytes=0, seconds=0.0)
        self.sends: dict[str, tuple[float, int]] = {}  # request id → (time.monotonic() of submit, bytes)
        self.first_read: dict[str, float] = {}  # request id → time.monotonic() of its first message

    def sending(self, request_id: str, handoff: KVHandoff) -> None:
        self.sends[request_id] = (time.monotonic(), handoff_bytes(handoff))

    def sent(self, request_id: str, *, ok: bool) -> None:
        submitted_at, num_bytes = self.sends.pop(request_id, (0.0, 0))
        if ok and submitted_at:
            self.sent_totals = _plus(self.sent_totals, num_bytes, time.monotonic() - submitted_at)

    def settled(self, received: Received, read_at: float) -> None:
        first_read = self.first_read.pop(received.request_id, read_at)
        if received.handoff is not None:
            seconds = time.monotonic() - first_read
            self.received_totals = _plus(self.received_totals, handoff_bytes(received.handoff), seconds)

    def reading(self, partial: Collection[str], read_at: float) -> None:
        """After a receive call: the transfers begun and not yet assembled (those dropped since go)."""
        self.first_read = {request_id: self.first_read.get(request_id, read_at) for request_id in partial}


def handoff_bytes(handoff: KVHandoff) -> int:
    return len(handoff.layers) * math.prod(handoff.layer_shape) * handoff.kv_dtype.itemsize


def _plus(totals: HandoffTotals, num_bytes: int, seconds: float) -> HandoffTotals:
    return HandoffTotals(totals.num_transfers + 1, totals.num_bytes + num_bytes, totals.seconds + seconds)
