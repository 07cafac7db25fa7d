"""Fault tolerance on the real stack and model (`serve` with one prefill and two decode workers
sharing the embedded default's KV store, small blocks), through the OpenAI SDK: a decode worker
killed mid-stream has its requests resumed on the other from the store, and a DRF drain with a
short grace migrates a decode worker's streams, KV and all, to the other. What needs no real model
(every kind of sampling, corrupt checkpoints, declined and refused migrations, a prefill worker's
death) is in the tiny-model process tests (tests/workers/worker/test_migration_failover.py,
test_failover_fallbacks.py); here a few streams of each kind cross store blocks on the real stack."""

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import MODEL, manage, start_stack, stop_stack

pytestmark = pytest.mark.slow

BLOCK = 16  # tokens per store block: a resumed request recomputes at most this many
# Faults come after 2 blocks of a stream (kill) or a few tokens (drain); the rest crosses another block.
MAX_TOKENS = 48
OPERATOR, PASSWORD = "failover-operator", "failover-operator-pw"
CREATE_OPERATOR = (
    "from django.contrib.auth.models import Group, User; "
    f"user = User.objects.create_user({OPERATOR!r}, password={PASSWORD!r}); "
    "user.groups.add(Group.objects.get(name='operator'))"
)
TIMEOUT_S = 900.0  # generous: a hang fails the test rather than the suite, and a busy CPU decodes slowly


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("failover")
    database = f"sqlite:///{tmp / 'failover.sqlite3'}"
    process, stack = start_stack(tmp, database, "failover", "--decode=2", f"--kv-block-tokens={BLOCK}")
    manage(stack.env, "shell", "-c", CREATE_OPERATOR)
    try:
        yield process, stack
    finally:
        stop_stack(process)


def sampling(kind: str, index: int) -> dict:
    if kind == "greedy":
        return {"temperature": 0.0}
    return {"temperature": 0.8, "top_p": 0.95, **({"seed": 1000 + index} if kind == "seeded" else {})}


STREAMS = [("greedy", i) for i in range(4)] + [("seeded", i) for i in range(4, 6)] + [("sampled", 6)]


def stream(stack, kind: str, index: int, progress: list[int]) -> str:
    """One streamed chat completion's text; `progress[index]` counts its chunks as they come."""
    chunks = stack.openai(timeout=TIMEOUT_S).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Tell me a story about the number {index}."}],
        max_tokens=MAX_TOKENS,
        stream=True,
        extra_body={"ignore_eos": True},
        **sampling(kind, index),
    )
    text = []
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
            progress[index] += 1
        if chunk.choices and chunk.choices[0].finish_reason:
            assert chunk.choices[0].finish_reason == "length"
    return "".join(text)


def run_streams(stack, streams, during=None, after_chunks: int = 0) -> dict[int, str]:
    """Every stream's text; `during()` runs once every stream has `after_chunks` chunks."""
    progress = [0] * len(STREAMS)
    with ThreadPoolExecutor(len(streams)) as pool:
        futures = {index: pool.submit(stream, stack, kind, index, progress) for kind, index in streams}
        if during is not None:
            deadline = time.monotonic() + TIMEOUT_S
            while min(progress[index] for _, index in streams) < after_chunks:
                assert time.monotonic() < deadline, progress
                assert not any(f.done() for f in futures.values()), "a stream ended before the fault"
                time.sleep(0.02)
            during()
        return {index: future.result(timeout=TIMEOUT_S) for index, future in futures.items()}


def metrics(stack) -> dict[tuple[str, str], float]:
    text = httpx.get(f"{stack.base_url}/metrics", timeout=30).text
    return {
        (sample.name, sample.labels.get("worker", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels.get("outcome") or sample.labels["outcome"] == "moved"
    }


def busiest_decode_worker(stack) -> str:
    running = metrics(stack)
    return max(("decode-0", "decode-1"), key=lambda name: running.get(("vllm:num_requests_running", name), -1))


def worker_pid(serve: int, worker_id: str) -> int:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if f"--worker-id={worker_id}".encode() in argv and os.getsid(int(entry.name)) == serve:
                return int(entry.name)
        except (OSError, ProcessLookupError):
            continue
    raise LookupError(f"no process of worker {worker_id}")


def wait_for_ready_decode_workers(stack, count: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    auth = (OPERATOR, PASSWORD)
    while True:
        instances = httpx.get(f"{stack.base_url}/api/v1/instances/?state=ready", auth=auth, timeout=30).json()
        ready = [i for i in instances["results"] if i["worker_id"].startswith("decode-")]
        if len(ready) >= count and all(
            metrics(stack).get(("vllm:num_requests_running", i["worker_id"])) is not None for i in ready
        ):
            return
        assert time.monotonic() < deadline, instances
        time.sleep(0.5)


@pytest.fixture(scope="module")
def reference(cluster) -> dict[int, str]:
    """The greedy and seeded streams' texts, uninterrupted."""
    _, stack = cluster
    return run_streams(stack, [s for s in STREAMS if s[0] != "sampled"])


def test_killing_a_decode_worker_mid_stream_resumes_its_streams_on_the_other_from_the_store(cluster, reference):
    process, stack = cluster
    victim = []

    def kill():
        victim.append(busiest_decode_worker(stack))
        os.kill(worker_pid(process.pid, victim[0]), signal.SIGKILL)

    texts = run_streams(stack, STREAMS, during=kill, after_chunks=2 * BLOCK)

    assert len(texts) == len(STREAMS) and all(texts.values())
    for index, expected in reference.items():
        assert texts[index] == expected, index
    survivor = "decode-1" if victim[0] == "decode-0" else "decode-0"
    after = metrics(stack)
    assert after[("sluice:failovers_total", survivor)] >= 1
    assert 0 < after[("sluice:failover_max_recomputed_tokens", survivor)] <= BLOCK


def test_a_drf_drain_with_a_short_grace_migrates_every_stream_to_the_other_decode_worker(cluster, reference):
    _, stack = cluster
    wait_for_ready_decode_workers(stack, 2)  # the killed worker was restarted
    auth = (OPERATOR, PASSWORD)
    instances = httpx.get(f"{stack.base_url}/api/v1/instances/", auth=auth, timeout=30).json()["results"]
    by_worker = {i["worker_id"]: i["id"] for i in instances}
    before = metrics(stack)
    drained = []

    def drain():
        drained.append(busiest_decode_worker(stack))
        response = httpx.post(
            f"{stack.base_url}/api/v1/instances/{by_worker[drained[0]]}/drain/",
            json={"grace_s": 1, "reason": "maintenance"},
            auth=auth,
            timeout=30,
        )
        assert response.status_code == 200, response.text

    greedy = [s for s in STREAMS if s[0] == "greedy"]
    texts = run_streams(stack, greedy, during=drain, after_chunks=4)

    for _, index in greedy:
        assert texts[index] == reference[index], index
    other = "decode-1" if drained[0] == "decode-0" else "decode-0"
    deadline = time.monotonic() + 60
    while True:
        events = httpx.get(
            f"{stack.base_url}/api/v1/scaling-events/?instance={by_worker[drained[0]]}", auth=auth, timeout=30
        ).json()["results"]
        actions = [e["action"] for e in reversed(events)]
        if "instance_stopped" in actions or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    wanted = ["instance_registered", "instance_drain_requested", "instance_migrated", "instance_stopped"]
    assert [a for a in actions if a in wanted][-4:] == wanted
    migrated = next(e for e in events if e["action"] == "instance_migrated")["after"]
    assert migrated["num_migrated"] >= 1 and migrated["num_migrations_failed"] == 0
    after = metrics(stack)
    # The target took them in with their KV: no resume, nothing recomputed.
    moved_in = after[("sluice:migrated_in_total", other)] - before.get(("sluice:migrated_in_total", other), 0)
    assert moved_in == migrated["num_migrated"]
    assert after[("sluice:failovers_total", other)] == before.get(("sluice:failovers_total", other), 0)
    assert after[("sluice:failover_recomputed_tokens_total", other)] == before.get(
        ("sluice:failover_recomputed_tokens_total", other), 0
    )
