import asyncio

import numpy as np
import pytest

from bench.serve.arrivals import send_offsets
from bench.serve.client import RequestResult
from bench.serve.datasets.request import BenchRequest
from bench.serve.load import run_load


def request(session=None, arrival=None):
    return BenchRequest(prompt_ids=np.array([1, 2]), output_len=1, session_id=session, arrival_s=arrival)


def test_poisson_offsets_start_at_zero_and_grow_at_the_rate():
    offsets = send_offsets([request() for _ in range(2000)], request_rate=50.0, time_scale=1.0, seed=0)

    assert offsets[0] == 0.0
    assert all(later >= earlier for earlier, later in zip(offsets, offsets[1:]))
    assert offsets[-1] / 1999 == pytest.approx(1 / 50, rel=0.1)
    assert offsets == send_offsets([request() for _ in range(2000)], request_rate=50.0, time_scale=1.0, seed=0)


def test_trace_times_are_scaled_unless_a_rate_replaces_them():
    trace = [request(arrival=0.0), request(arrival=1.5), request(arrival=4.0)]

    assert send_offsets(trace, request_rate=None, time_scale=0.5, seed=0) == [0.0, 0.75, 2.0]
    assert send_offsets(trace, request_rate=float("inf"), time_scale=0.5, seed=0) == [0.0, 0.0, 0.0]
    assert send_offsets([request(), request()], request_rate=None, time_scale=1.0, seed=0) == [0.0, 0.0]


def test_only_the_first_turn_of_a_session_has_an_offset():
    requests = [request(session=0), request(session=1), request(session=0), request(session=1), request()]

    offsets = send_offsets(requests, request_rate=10.0, time_scale=1.0, seed=0)

    assert [offset is None for offset in offsets] == [False, False, True, True, False]


def run(requests, max_concurrency):
    """Runs the loop with a send that records when each request starts and ends (by index)."""
    log = []
    index_of = {id(r): i for i, r in enumerate(requests)}
    in_flight = 0
    most_in_flight = 0

    async def send(bench_request):
        nonlocal in_flight, most_in_flight
        index = index_of[id(bench_request)]
        in_flight += 1
        most_in_flight = max(most_in_flight, in_flight)
        log.append(("start", index))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        log.append(("end", index))
        in_flight -= 1
        return RequestResult(prompt_tokens=index, expected_output_tokens=1, output_tokens=1)

    offsets = send_offsets(requests, request_rate=None, time_scale=1.0, seed=0)
    results, duration_s = asyncio.run(
        run_load(requests, offsets, send, max_concurrency=max_concurrency, progress=False)
    )
    return log, most_in_flight, results, duration_s


def test_a_sessions_turn_starts_only_after_its_previous_turn_ended():
    # Two sessions of three turns, listed turn by turn, as the multiturn dataset lists them.
    requests = [request(session=session) for _ in range(3) for session in (0, 1)]

    log, most_in_flight, results, _ = run(requests, max_concurrency=None)

    for earlier, later in [(0, 2), (2, 4), (1, 3), (3, 5)]:
        assert log.index(("end", earlier)) < log.index(("start", later))
    assert most_in_flight == 2  # the two sessions ran side by side
    assert len(results) == 6


def test_concurrency_is_capped_and_every_result_comes_back_in_dataset_order():
    requests = [request() for _ in range(7)]

    log, most_in_flight, results, duration_s = run(requests, max_concurrency=3)

    assert most_in_flight == 3
    assert sorted(index for event, index in log if event == "end") == list(range(7))
    assert [result.prompt_tokens for result in results] == list(range(7))  # the index each send saw
    assert duration_s >= 0
