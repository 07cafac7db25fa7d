"""Hostile-input fuzzing of the inference API: hypothesis draws requests for the six endpoints (valid
ones, valid ones with one field made hostile, arbitrary JSON, broken framings; good and bad headers)
and sends them to a running stack, which must answer each without a 5xx, with the protocol's error
shape on every 4xx, and still serve a normal request at the end.

    python -m bench.fuzz_api --examples 2000 --base-url http://127.0.0.1:8000 --api-key sk-...

Prints one JSON object: requests sent, statuses, the problems found (grouped, with an example each),
the workers /healthz listed before and after, and whether a normal request succeeded afterwards.
tests/e2e/test_fuzz_api.py runs the same strategies with a fixed budget in `make test`.

Valid generations stay cheap: every body that could be served asks for at most a few tokens. One case
in eight is raw bytes on a socket of its own (framings that no HTTP client library would send).
`bodies` draws the request bodies, `cases` the requests, `checks` sends them and judges the answers.
"""

from collections import Counter
from dataclasses import dataclass, field

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.fuzz_api.bodies import MODEL
from bench.fuzz_api.cases import FuzzCase, RawCase, fuzz_cases, raw_cases
from bench.fuzz_api.checks import REQUEST_TIMEOUT_S, exchange

__all__ = ["REQUEST_TIMEOUT_S", "FuzzReport", "fuzz", "still_serving", "workers"]


@dataclass
class FuzzReport:
    sent: int = 0
    statuses: Counter = field(default_factory=Counter)
    problems: dict[str, dict] = field(default_factory=dict)  # kind -> {"count", "example", "response"}

    def record(self, case: "FuzzCase | RawCase", status: int, found: list[str], reply: str) -> None:
        self.sent += 1
        self.statuses[status] += 1
        for kind in found:
            entry = self.problems.setdefault(kind, {"count": 0, "example": case.describe(), "response": reply})
            entry["count"] += 1


def fuzz(
    client: httpx.Client, api_key: str, *, examples: int, derandomize: bool, report: FuzzReport, fail_fast: bool
) -> None:
    """Sends `examples` drawn cases (one in eight raw framings); with fail_fast the first problem raises
    (and hypothesis shrinks it), else every problem is recorded in `report`."""

    @given(case=st.one_of(*[fuzz_cases(api_key)] * 7, raw_cases(api_key)))
    @settings(
        max_examples=examples,
        derandomize=derandomize,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: FuzzCase | RawCase) -> None:
        status, found, reply = exchange(client, case)
        report.record(case, status, found, reply)
        assert not (fail_fast and found), (found, case.describe(), reply)

    run()


def still_serving(client: httpx.Client, api_key: str) -> bool:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    response = client.post("/v1/chat/completions", json=request, headers={"authorization": f"Bearer {api_key}"})
    return response.status_code == 200 and response.json()["choices"][0]["finish_reason"] in ("stop", "length")


def workers(client: httpx.Client) -> list[tuple[str, str]]:
    """(worker id, state) of each worker /healthz lists."""
    return [(worker["worker_id"], worker["state"]) for worker in client.get("/healthz").json()["workers"]]
