"""A few threads doing work that many tenants queue, taken by the tenants' fair shares
(workers.engine.sched.fair_share), so that one tenant's backlog delays another tenant's job by at
most the jobs already running and about one of its own.

Each thread runs jobs through a runner of its own, opened when the thread starts and closed when the
workers close: a plain call for work done in this process, a child process for work done in one
(prepare_pool). Jobs are submitted from the event loop and their futures awaited there
(asyncio.wrap_future); a job whose future is cancelled before it starts is skipped.
"""

import bisect
import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any

from workers.engine.sched.fair_share import FairShareClock

Runner = Callable[[Any], Any]


class FairWorkers:
    def __init__(self, size: int, open_runner: Callable[[], AbstractContextManager[Runner]], *, name: str) -> None:
        self._open_runner = open_runner
        self._ready = threading.Condition()
        self._clock = FairShareClock()
        self._arrivals = itertools.count()
        self._queued: list[tuple[float, int, Future, Any]] = []
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(size)]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Any, *, tenant: str, weight: int, cost: float) -> Future:
        future: Future = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the workers are closed")
            tag = self._clock.start_tag(tenant, cost=cost, weight=weight)
            bisect.insort(self._queued, (tag, next(self._arrivals), future, job))
            self._ready.notify()
        return future

    def close(self) -> None:
        """Cancel what has not started, let each thread finish its job and close its runner."""
        with self._ready:
            self._closed = True
            for _, _, future, _ in self._queued:
                future.cancel()
            self._queued.clear()
            self._ready.notify_all()
        for thread in self._threads:
            thread.join()

    def _take(self) -> tuple[Future, Any] | None:
        with self._ready:
            while True:
                while not self._queued and not self._closed:
                    self._ready.wait()
                if self._closed:
                    return None
                tag, _, future, job = self._queued.pop(0)
                self._clock.served(tag)
                if future.set_running_or_notify_cancel():
                    return future, job

    def _work(self) -> None:
        with self._open_runner() as run:
            while (taken := self._take()) is not None:
                future, job = taken
                try:
                    result = run(job)
                except BaseException as error:
                    future.set_exception(error)
                else:
                    future.set_result(result)
