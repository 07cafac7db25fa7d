"""The load loop: every request sent at its offset (see `arrivals`), a session's turn only after the
turn before it finished, at most `max_concurrency` in flight (waiting ones go in the order they became
ready), a progress bar on stderr."""

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import nullcontext

from tqdm import tqdm

from bench.serve.client import RequestResult
from bench.serve.datasets.request import BenchRequest


async def run_load(
    requests: list[BenchRequest],
    offsets: list[float | None],
    send: Callable[[BenchRequest], Awaitable[RequestResult]],
    *,
    max_concurrency: int | None,
    progress: bool,
) -> tuple[list[RequestResult], float]:
    """The results in dataset order, and the run's duration in seconds (start to the last completion)."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else nullcontext()
    finished = [asyncio.Event() for _ in requests]
    predecessors = _session_predecessors(requests)
    bar = tqdm(total=len(requests), file=sys.stderr, disable=not progress, unit="req")
    start = time.perf_counter()

    async def one(index: int) -> RequestResult:
        if offsets[index] is not None:
            await asyncio.sleep(max(0.0, start + offsets[index] - time.perf_counter()))
        if predecessors[index] is not None:
            await finished[predecessors[index]].wait()
        async with slots:
            result = await send(requests[index])
        finished[index].set()
        bar.update(1)
        return result

    try:
        results = await asyncio.gather(*(one(index) for index in range(len(requests))))
    finally:
        bar.close()
    return list(results), time.perf_counter() - start


def _session_predecessors(requests: list[BenchRequest]) -> list[int | None]:
    """For each request, the index of the one before it in its session (None: none)."""
    last_of_session: dict[int, int] = {}
    predecessors = []
    for index, request in enumerate(requests):
        predecessors.append(last_of_session.get(request.session_id) if request.session_id is not None else None)
        if request.session_id is not None:
            last_of_session[request.session_id] = index
    return predecessors
