"""A draining decode worker's migration of its requests: once the drain's grace period is over, each
unfinished request is suspended between two decode steps (its pages pinned) and offered to the
peer streaming its outputs, a last output with finish_reason "migrate". The peer (the gateway)
picks another decode worker, tells it to expect the request under a new id, and answers with a
MigrateRequest naming that worker's transfer endpoint; the KV and decoding state then go there over
the transfer path (Transfers.start_migration). A request that is recomputing or waiting is offered
once it is back between two decode steps. An offer nobody answers within OFFER_TIMEOUT_S fails
"transfer_failed", as a send that fails does: its peer then resumes it elsewhere by recompute.
When no other decode worker has room, the peer declines the offer (DeclineMigrationRequest): the
request decodes on here from its pinned pages, nothing lost or recomputed, and is offered again
after REOFFER_AFTER_S, so the drain completes as soon as room appears or the request ends.
"""

import logging
import time
from collections.abc import Callable

from workers.engine.engine import LLMEngine
from workers.protocol.messages import (
    DRAINING,
    DeclineMigrationRequest,
    GenerateError,
    GenerateOutput,
    MigrateRequest,
    WorkerOutbound,
)
from workers.worker.control import WorkerControl
from workers.worker.transfers import Transfers

log = logging.getLogger(__name__)

OFFER_TIMEOUT_S = 10.0
# A declined request is offered again after this long: often enough to leave soon after room appears
# elsewhere, seldom enough that asking costs its stream nothing noticeable.
REOFFER_AFTER_S = 1.0
MIGRATE = "migrate"  # GenerateOutput.finish_reason of an offer


class Migration:
    def __init__(
        self,
        *,
        engine: LLMEngine,
        control: WorkerControl,
        transfers: Transfers,
        owners: dict[str, bytes],
        send: Callable[[bytes, WorkerOutbound], None],
    ) -> None:
        self.engine = engine
        self.control = control
        self.transfers = transfers
        self.owners = owners
        self.send = send
        self.offered: dict[str, tuple[bytes, float]] = {}  # request id → (owner, time.monotonic() of the offer)
        self.declined: dict[str, float] = {}  # request id → time.monotonic() when it may be offered again

    @property
    def num_offered(self) -> int:
        return len(self.offered)

    @property
    def is_due(self) -> bool:
        migrate_at = self.control.migrate_at
        return self.control.state == DRAINING and migrate_at is not None and time.monotonic() >= migrate_at

    def offer_due(self) -> None:
        """Offer every request that can move now, once the grace period is over; fail stale offers."""
        now = time.monotonic()
        self.declined = {r: at for r, at in self.declined.items() if at > now and r in self.owners}
        if self.is_due:
            for request_id in [r for r in self.owners if r in self.engine.requests and r not in self.declined]:
                delta = self.engine.suspend_for_migration(request_id)
                if delta is None:
                    continue
                owner = self.owners.pop(request_id)
                self.offered[request_id] = (owner, now)
                self.send(
                    owner,
                    GenerateOutput(
                        request_id,
                        [],
                        delta.text or "",
                        finish_reason=MIGRATE,
                        num_prompt_tokens=delta.num_prompt_tokens,
                        num_cached_tokens=delta.num_cached_tokens,
                    ),
                )
        for request_id, (owner, offered_at) in list(self.offered.items()):
            if now - offered_at > OFFER_TIMEOUT_S:
                self.forget(request_id)
                self.transfers.num_migrations_failed += 1
                message = f"no migration target was named within {OFFER_TIMEOUT_S:g} s"
                self.send(owner, GenerateError(request_id, "transfer_failed", message))
        self.control.check_drained()

    def _take_offer(self, peer: bytes, request_id: str) -> bytes | None:
        """The owner of an offered request, withdrawn from the offers; None (the peer told) if none."""
        offer = self.offered.pop(request_id, None)
        if offer is None:
            message = f"request {request_id!r} is not offered for migration here"
            self.send(peer, GenerateError(request_id, "invalid_request", message))
            return None
        return offer[0]

    def on_migrate(self, peer: bytes, request: MigrateRequest) -> None:
        owner = self._take_offer(peer, request.request_id)
        if owner is None:
            return
        self.transfers.start_migration(request.request_id, request.new_request_id, request.decode_endpoint, owner)

    def on_decline(self, peer: bytes, request: DeclineMigrationRequest) -> None:
        owner = self._take_offer(peer, request.request_id)
        if owner is None:
            return
        self.engine.resume_suspended(request.request_id)
        self.owners[request.request_id] = owner
        self.declined[request.request_id] = time.monotonic() + REOFFER_AFTER_S
        self.transfers.num_migrations_declined += 1
        log.info("migration of %s declined: no decode worker has room; decoding it on here", request.request_id)

    def forget(self, request_id: str) -> bool:
        """Drop an offer (its request aborted, or the worker stopping), freeing its pages."""
        if self.offered.pop(request_id, None) is None:
            return False
        self.engine.release_transfer(request_id)
        return True

    def peers(self) -> dict[str, bytes]:
        return {request_id: owner for request_id, (owner, _) in self.offered.items()}
