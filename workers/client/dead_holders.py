"""A worker this client finds dead no longer holds SWA state: its "held by" registrations go from the
holder index (workers.kvstore.holders.HolderIndex.drop_worker) at once, rather than each costing
another worker's fetch a timeout until the registration is capped away.

Dead is what makes the client stop routing to it: no heartbeat within the timeout, or it reported that
it failed as a whole. Each life of a worker (its id and start time) is dropped once; a new life drops
an earlier one's registrations itself as it starts (workers.worker.swa_holder). Every gateway that
sees the death drops them: dropping is idempotent.
"""

import asyncio
import logging

from workers.kvstore.holders import HolderIndex
from workers.protocol.messages import WorkerHeartbeat

log = logging.getLogger(__name__)

MAX_REMEMBERED = 1024  # lives already dropped, kept to drop each once


class DeadHolders:
    def __init__(self, holders: HolderIndex) -> None:
        self.holders = holders
        self._dropped: dict[tuple[str, float], None] = {}  # (worker id, started_at), oldest first
        self._pending: set[asyncio.Task[None]] = set()

    def found_dead(self, heartbeat: WorkerHeartbeat | None) -> None:
        """The worker whose last heartbeat this is went dead (call from the event loop, as often as
        it stays dead)."""
        if heartbeat is None or heartbeat.swa_layers is None or not heartbeat.swa_layers.state_endpoint:
            return  # it never held SWA state
        life = (heartbeat.worker_id, heartbeat.started_at)
        if life in self._dropped:
            return
        self._dropped[life] = None
        if len(self._dropped) > MAX_REMEMBERED:
            del self._dropped[next(iter(self._dropped))]
        task = asyncio.create_task(self._drop(heartbeat.worker_id), name=f"drop-swa-holder {heartbeat.worker_id}")
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def wait(self) -> None:
        """Until the drops under way are done."""
        await asyncio.gather(*self._pending, return_exceptions=True)

    async def _drop(self, worker_id: str) -> None:
        try:
            # The index may be a network round trip (Redis): not on the event loop.
            dropped = await asyncio.to_thread(self.holders.drop_worker, worker_id)
        except Exception as error:
            log.warning("dropping dead worker %s's SWA holder registrations failed: %s", worker_id, error)
        else:
            log.info("worker %s is dead: dropped its %d SWA holder registrations", worker_id, dropped)
