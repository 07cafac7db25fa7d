"""Where the other workers' SWA state endpoints are: the holder index names holders by worker id only,
and a worker learns the endpoint of each from the requests routed to it (GenerateRequest.swa_holders:
the live holders of the request's hit, as the entrypoint knows them from their heartbeats). The
entrypoint is the one part that always follows every worker; a worker follows none.

The latest endpoint heard for a worker id wins (a restarted worker may bind a new port). A worker
that died stays known until forgotten past MAX_PEERS, but the index no longer names it as a holder
once its death is seen (workers.client.dead_holders), so it is not asked.
"""

import threading
from collections import OrderedDict
from collections.abc import Iterable

from workers.protocol.messages import SwaHolder

MAX_PEERS = 1024


class SwaPeers:
    """Thread-safe: the worker's loop learns while the engine's fetches look up."""

    def __init__(self, max_peers: int = MAX_PEERS) -> None:
        self.max_peers = max_peers
        self._lock = threading.Lock()
        self._endpoints: OrderedDict[str, str] = OrderedDict()  # worker id → endpoint, least recent first

    def learn(self, holders: Iterable[SwaHolder]) -> None:
        with self._lock:
            for holder in holders:
                self._endpoints[holder.worker_id] = holder.endpoint
                self._endpoints.move_to_end(holder.worker_id)
            while len(self._endpoints) > self.max_peers:
                self._endpoints.popitem(last=False)

    def endpoint(self, worker_id: str) -> str | None:
        with self._lock:
            return self._endpoints.get(worker_id)
