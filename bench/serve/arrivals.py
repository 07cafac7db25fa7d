"""When each request may be sent, in seconds from the start of the run.

A session's later turns get None: they go when the turn before finishes (see `load`). The others are
sent at once (`request_rate` inf), as a Poisson process of `request_rate` requests per second, or, with
no rate given, at the dataset's own times (a trace's timestamps) multiplied by `time_scale`.
"""

import math

import numpy as np

from bench.serve.datasets.request import BenchRequest


def send_offsets(
    requests: list[BenchRequest], *, request_rate: float | None, time_scale: float, seed: int
) -> list[float | None]:
    leads = _leads_their_session(requests)
    if request_rate is None and any(request.arrival_s is not None for request in requests):
        return [request.arrival_s * time_scale if lead else None for request, lead in zip(requests, leads)]
    if request_rate is None or math.isinf(request_rate):
        return [0.0 if lead else None for lead in leads]
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=sum(leads))
    # The first request goes at once; each next one after a gap drawn for it.
    times = iter(np.concatenate([[0.0], np.cumsum(gaps[1:])]).tolist())
    return [next(times) if lead else None for lead in leads]


def _leads_their_session(requests: list[BenchRequest]) -> list[bool]:
    """True for a request with no session, or the first of its session."""
    started: set[int] = set()
    leads = []
    for request in requests:
        leads.append(request.session_id is None or request.session_id not in started)
        if request.session_id is not None:
            started.add(request.session_id)
    return leads
