"""bench.fuzz_api against the real stack (gateway, prefill and decode workers, the real SmolLM2) with a
fixed, derandomized budget: no 5xx, the protocol's error shape on every 4xx, no worker exits, and a
normal request is served afterwards. `python -m bench.fuzz_api` runs a longer budget."""

import subprocess

import httpx
import psycopg
import pytest

from bench.fuzz_api import REQUEST_TIMEOUT_S, FuzzReport, fuzz, still_serving, workers
from tests.e2e.conftest import manage

pytestmark = pytest.mark.slow
# About a minute on a 2-core machine: most requests are refused in milliseconds, the valid ones ask
# for at most a few tokens.
EXAMPLES = 200
FUZZ_TENANT = "fuzz"


@pytest.fixture(scope="module")
def fuzz_key(stack) -> str:
    """A key of its own tenant, whose rate limit the fuzzer's burst does not reach (a 429 would stop
    the requests from reaching what they test)."""
    raw_key = manage(stack.env, "create_api_key", "--tenant", FUZZ_TENANT).strip().splitlines()[-1]
    with psycopg.connect(stack.env["DATABASE_URL"], autocommit=True) as connection:
        connection.execute("UPDATE tenants_tenant SET rate_limit_rpm = 1000000 WHERE name = %s", (FUZZ_TENANT,))
    return raw_key


def worker_pids(stack) -> set[int]:
    """The pids of the stack's engine workers: the run_worker children of its `serve` process."""
    port = stack.base_url.rsplit(":", 1)[1]
    listing = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True)
    processes = [line.split(None, 2) for line in listing.stdout.splitlines()]
    serve = {int(pid) for pid, _, args in processes if " serve " in args and f"--port={port}" in args}
    return {int(pid) for pid, ppid, args in processes if int(ppid) in serve and "run_worker" in args}


def test_hostile_requests_get_protocol_shaped_answers_and_break_nothing(stack, fuzz_key):
    # given
    pids = worker_pids(stack)
    assert len(pids) == 2, pids
    report = FuzzReport()

    with httpx.Client(base_url=stack.base_url, timeout=REQUEST_TIMEOUT_S) as client:
        listed = workers(client)

        # when: the first problem fails the run, shrunk to a minimal request by hypothesis
        fuzz(client, fuzz_key, examples=EXAMPLES, derandomize=True, report=report, fail_fast=True)

        # then
        assert still_serving(client, fuzz_key)
        assert workers(client) == listed
    assert worker_pids(stack) == pids
    assert report.sent == EXAMPLES and not report.problems
    assert {200, 400, 401, 404} <= set(report.statuses), report.statuses
