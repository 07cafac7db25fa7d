"""The gateway's in-process fixtures (the real ASGI application over httpx, a fake engine), and
builders for the collector's inputs."""

from collections.abc import Callable

import pytest

from tests.controlplane.gateway.conftest import api, fake_engine, fresh_rate_limits, no_workers  # noqa: F401
from workers.protocol.messages import WorkerHeartbeat


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeHeartbeats:
    """The collector's heartbeat source: whatever `workers` holds when it is read."""

    def __init__(self) -> None:
        self.workers: list[WorkerHeartbeat] = []

    async def __call__(self) -> list[WorkerHeartbeat]:
        return list(self.workers)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1_800_000_000.0)  # on a minute boundary


@pytest.fixture
def heartbeats() -> FakeHeartbeats:
    return FakeHeartbeats()


@pytest.fixture
def make_heartbeat() -> Callable[..., WorkerHeartbeat]:
    def make(worker_id: str = "w0", **fields) -> WorkerHeartbeat:
        values = {
            "role": "mixed",
            "model": "tiny",
            "request_endpoint": f"ipc:///tmp/{worker_id}.req",
            "max_model_len": 256,
            "num_running": 0,
            "num_waiting": 0,
            "kv_usage": 0.0,
            "num_free_pages": 10,
            "num_prompt_tokens": 0,
            "num_cached_prompt_tokens": 0,
            "num_preemptions": 0,
            "sent_at": 0.0,
            **fields,
        }
        return WorkerHeartbeat(worker_id=worker_id, **values)

    return make
