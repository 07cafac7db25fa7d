"""Calling the gateway in-process: the real ASGI application (Channels router, body cap, Django)
through httpx's ASGI transport, on one event loop per call. Gateway modules are imported inside the
fixtures, so that a test module can skip itself while recipe.api does not exist yet."""

import asyncio
from collections.abc import Callable

import httpx
import pytest
from asgiref.sync import async_to_sync
from django.core import signals
from django.db import close_old_connections

from tests.controlplane.gateway.helpers import PATHS, FakeEngine

REQUEST_TIMEOUT_S = 20  # a hung request fails its test instead of the whole run


class Api:
    def request(self, method: str, path: str, **kwargs) -> httpx.Response:
        return async_to_sync(self._request)(method, path, **kwargs)

    def post(self, protocol: str, body: dict | None = None, **kwargs) -> httpx.Response:
        return self.request("POST", PATHS[protocol], json=body, **kwargs)

    async def _request(self, method: str, path: str, **kwargs) -> httpx.Response:
        from controlplane.asgi import application
        from controlplane.gateway.engine import close_engine_client

        transport = httpx.ASGITransport(app=application)
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT_S):
                async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
                    return await client.request(method, path, **kwargs)
        finally:
            await close_engine_client()


@pytest.fixture
def api(db) -> Api:
    # As Django's own test client does: the request signals would otherwise close the connection
    # that holds the test's transaction.
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield Api()
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


@pytest.fixture(scope="session")
def smollm2_worker(smollm2_files, tmp_path_factory) -> tuple[str, str]:
    """(request endpoint, heartbeat endpoint) of a SmolLM2 worker process, shared by the live tests."""
    from tests.controlplane.gateway.live import worker_process

    with worker_process(tmp_path_factory.mktemp("worker")) as endpoints:
        yield endpoints


@pytest.fixture(autouse=True)
def fresh_rate_limits(monkeypatch) -> None:
    from controlplane.gateway import rate_limit

    monkeypatch.setattr(rate_limit, "limiter", rate_limit.RateLimiter())


@pytest.fixture
def no_workers(settings) -> None:
    settings.SLUICE_WORKER_ENDPOINTS = []


@pytest.fixture
def fake_engine(monkeypatch) -> Callable[..., FakeEngine]:
    """Installs a FakeEngine where the views get their engine client."""

    def install(script) -> FakeEngine:
        engine = FakeEngine(script)

        async def engine_client() -> FakeEngine:
            return engine

        monkeypatch.setattr("controlplane.gateway.views.engine_client", engine_client)
        return engine

    return install
