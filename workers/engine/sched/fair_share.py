"""Start-time fair queueing by tenant (SFQ, Goyal, Vin and Cheng 1996): the order in which many
tenants' queued work is served, so that each tenant with work queued gets a share in proportion to
its weight, whatever the others queue.

Each item gets a start tag when it is queued: the later of the virtual time and the finish tag of
its tenant's previous item; its own finish tag is its start plus its cost over its tenant's weight.
Items are served in start-tag order (ties in arrival order), and serving one moves the virtual time
up to its start tag. A tenant that queues a thousand items stretches only its own tags: another
tenant's next item starts at the virtual time, so it waits behind at most one item of each tenant
whose items share that tag, and from then on the two alternate by cost and weight. A tenant's own
tags only grow, so its items are served in the order it queued them.

Used by the engine's waiting queue (cost: prompt tokens) and the gateway's preparation queue (cost:
body bytes). No locks: each user serializes its own calls.
"""

# Tenants whose finish tag the virtual time has passed would start at the virtual time anyway, so
# they are forgotten once this many are remembered (and the number doubles while none can be).
FORGET_IDLE_AFTER = 1024


class FairShareClock:
    def __init__(self) -> None:
        self.virtual_time = 0.0
        self._finish_tags: dict[str, float] = {}
        self._forget_after = FORGET_IDLE_AFTER

    def start_tag(self, tenant: str, *, cost: float, weight: float) -> float:
        """The tag of an item queued now; charges its cost to its tenant."""
        start = max(self.virtual_time, self._finish_tags.get(tenant, 0.0))
        self._finish_tags[tenant] = start + max(cost, 1.0) / weight
        if len(self._finish_tags) > self._forget_after:
            self._forget_idle()
        return start

    def served(self, start_tag: float) -> None:
        """An item with this tag was taken from the queue."""
        self.virtual_time = max(self.virtual_time, start_tag)

    def _forget_idle(self) -> None:
        self._finish_tags = {tenant: tag for tenant, tag in self._finish_tags.items() if tag > self.virtual_time}
        self._forget_after = max(FORGET_IDLE_AFTER, 2 * len(self._finish_tags))
