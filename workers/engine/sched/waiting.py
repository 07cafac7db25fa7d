"""The engine's waiting requests, in the order the scheduler admits them.

Preempted requests come first, the most recently preempted at the front: they had been admitted
already and go back to running before anything new. The others are ordered by start-time fair
queueing by tenant (fair_share), each request costing its tokens, so one tenant that queues
many long prompts cannot push another tenant's request behind all of them: that request starts at
the virtual time, and the two tenants then share admissions by weight. Requests of one tenant keep
their arrival order; with one tenant (or none) the order is arrival order.

The scheduler walks the queue by position: a request whose store blocks are still being fetched
keeps its place while those behind it are admitted. `len()` counts every waiting request, for the
engine's max_waiting cap.
"""

import bisect
import itertools
from collections import deque
from collections.abc import Iterator

from workers.engine.request import Request
from workers.engine.sched.fair_share import FairShareClock


class WaitingQueue:
    def __init__(self) -> None:
        self._preempted: deque[Request] = deque()
        # (start tag, arrival number, request), sorted: the arrival number breaks ties and keeps
        # requests from ever being compared.
        self._queued: list[tuple[float, int, Request]] = []
        self._clock = FairShareClock()
        self._arrivals = itertools.count()

    def add(self, request: Request) -> None:
        tag = self._clock.start_tag(request.tenant, cost=request.num_tokens, weight=request.tenant_weight)
        bisect.insort(self._queued, (tag, next(self._arrivals), request))

    def push_front(self, request: Request) -> None:
        """A preempted request: admitted before everything else."""
        self._preempted.appendleft(request)

    def pop(self, position: int) -> Request:
        """Take the request at `position` (as indexed) out of the queue to admit it."""
        if position < len(self._preempted):
            request = self._preempted[position]
            del self._preempted[position]
            return request
        tag, _, request = self._queued.pop(position - len(self._preempted))
        self._clock.served(tag)
        return request

    def remove(self, request: Request) -> None:
        """Take out a request that leaves without being admitted (aborted, failed)."""
        if request in self._preempted:
            self._preempted.remove(request)
            return
        self._queued.pop(next(i for i, (_, _, queued) in enumerate(self._queued) if queued is request))

    def __getitem__(self, position: int) -> Request:
        if position < len(self._preempted):
            return self._preempted[position]
        return self._queued[position - len(self._preempted)][2]

    def __len__(self) -> int:
        return len(self._preempted) + len(self._queued)

    def __iter__(self) -> Iterator[Request]:
        yield from self._preempted
        yield from (request for _, _, request in self._queued)

    def __contains__(self, request: object) -> bool:
        return any(queued is request for queued in self)
