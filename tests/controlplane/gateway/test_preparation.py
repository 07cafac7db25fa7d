"""Where bodies are prepared: fair queues between tenants, and prepare processes (the real SmolLM2
tokenizer) that answer count_tokens, refuse what is invalid, and hold each job to a CPU budget."""

import contextlib
import json
import threading

import pytest

from controlplane.gateway.catalog import load_catalog
from controlplane.gateway.errors import GatewayError
from controlplane.gateway.fair_work import FairWorkers
from controlplane.gateway.prepare_jobs import PrepareJob
from controlplane.gateway.prepare_pool import PrepareProcess
from recipe.api import RequestLimits, count_tokens
from tests.controlplane.gateway.helpers import PATHS, SMOLLM2, assert_error, key_headers, valid_body
from tests.waiting import wait_until

WORDS = "the quick brown fox jumps over a lazy dog while counting sheep; "


def text_of(size: int) -> str:
    return (WORDS * (size // len(WORDS) + 1))[:size]


class Recorder:
    """A runner that records the jobs it runs; the first one waits until the test lets it finish."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.first_started = threading.Event()
        self.release_first = threading.Event()

    def __call__(self, job: str) -> str:
        if not self.ran:
            self.first_started.set()
            self.release_first.wait(timeout=10)
        self.ran.append(job)
        return job


def test_a_tenants_backlog_delays_another_tenants_job_by_one_of_its_own():
    # given: one thread, busy with a's first job, and a's backlog of five more
    recorder = Recorder()
    workers = FairWorkers(1, lambda: contextlib.nullcontext(recorder), name="test")
    futures = [workers.submit(f"a{i}", tenant="a", weight=1, cost=100) for i in range(6)]
    recorder.first_started.wait(timeout=10)

    # when: b queues two jobs behind them
    futures += [workers.submit(f"b{i}", tenant="b", weight=1, cost=100) for i in range(2)]
    recorder.release_first.set()
    for future in futures:
        future.result(timeout=10)
    workers.close()

    # then
    assert recorder.ran == ["a0", "b0", "a1", "b1", "a2", "a3", "a4", "a5"]


def test_a_cancelled_job_is_skipped():
    recorder = Recorder()
    workers = FairWorkers(1, lambda: contextlib.nullcontext(recorder), name="test")
    workers.submit("running", tenant="a", weight=1, cost=1)
    recorder.first_started.wait(timeout=10)
    cancelled = workers.submit("cancelled", tenant="a", weight=1, cost=1)
    kept = workers.submit("kept", tenant="a", weight=1, cost=1)

    cancelled.cancel()
    recorder.release_first.set()
    kept.result(timeout=10)
    workers.close()

    assert recorder.ran == ["running", "kept"]


def test_closing_cancels_what_waits_and_lets_the_running_job_finish():
    recorder = Recorder()
    workers = FairWorkers(1, lambda: contextlib.nullcontext(recorder), name="test")
    running = workers.submit("running", tenant="a", weight=1, cost=1)
    recorder.first_started.wait(timeout=10)
    waiting = workers.submit("waiting", tenant="b", weight=1, cost=1)

    closing = threading.Thread(target=workers.close)
    closing.start()
    wait_until(waiting.cancelled, timeout_s=10, interval_s=0.01)
    recorder.release_first.set()
    closing.join(timeout=10)

    assert running.result(timeout=0) == "running" and recorder.ran == ["running"]


def body_bytes(body: dict) -> bytes:
    return json.dumps(body).encode()


@pytest.mark.slow
def test_a_prepare_process_answers_refuses_and_holds_each_job_to_its_cpu_budget():
    # given: a process whose jobs may each use one second of CPU
    count_job = PrepareJob(
        "count_tokens",
        "messages.count_tokens",
        body_bytes(valid_body("messages.count_tokens", messages=[{"role": "user", "content": text_of(100_000)}])),
        RequestLimits(),
    )
    over_context = PrepareJob(
        "generation",
        "chat.completions",
        body_bytes(valid_body("chat.completions", messages=[{"role": "user", "content": text_of(100_000)}])),
        RequestLimits(),
    )
    huge = PrepareJob(
        "count_tokens",
        "messages.count_tokens",
        body_bytes(valid_body("messages.count_tokens", messages=[{"role": "user", "content": text_of(3_900_000)}])),
        RequestLimits(),
    )
    process = PrepareProcess(cpu_budget_s=1)

    with process as run:
        # when / then: a count is the recipe's own...
        expected = count_tokens(
            {"model": SMOLLM2, "messages": [{"role": "user", "content": text_of(100_000)}]}, load_catalog().models
        )
        assert run(count_job) == expected
        # ...a body over the context window is refused as the gateway would refuse it...
        with pytest.raises(GatewayError) as refused:
            run(over_context)
        assert refused.value.kind == "invalid_request" and "context" in refused.value.message
        # ...a job past its budget is a 413 (the kernel ended the process mid-tokenizing)...
        with pytest.raises(GatewayError) as too_costly:
            run(huge)
        assert too_costly.value.kind == "request_too_large" and "CPU budget of 1 s" in too_costly.value.message
        # ...and the next job gets a new process
        assert run(count_job) == expected


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["chat.completions", "messages"])
def test_a_large_body_is_prepared_in_a_prepare_process_and_refused_in_its_protocols_shape(
    api, make_api_key, settings, protocol
):
    # given: bodies past the inline size, so they go to a prepare process first
    settings.SLUICE_PREPARE_INLINE_MAX_BYTES = 1024
    key = make_api_key()
    over_context = valid_body(protocol, messages=[{"role": "user", "content": text_of(60_000)}])
    not_json = b'{"model": "' + b"x" * 5000

    # when
    responses = [
        api.post(protocol, over_context, headers=key_headers(key)),
        api.request("POST", PATHS[protocol], content=not_json, headers=key_headers(key)),
    ]
    counted = api.post(
        "messages.count_tokens",
        valid_body("messages.count_tokens", messages=over_context["messages"]),
        headers=key_headers(key),
    )

    # then
    assert "context" in assert_error(responses[0], protocol, 400, "invalid_request_error")["message"]
    assert "not valid JSON" in assert_error(responses[1], protocol, 400, "invalid_request_error")["message"]
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 8192
