"""The gateway process's one EngineClient, made on first use inside the running event loop (the
lifespan's startup), with the cluster's CURVE key: a bad key file, or a worker on the network without
one, fails the start."""

import asyncio

from django.conf import settings

from controlplane.common.data_plane import data_plane_key
from controlplane.gateway.worker_discovery import follow_registered_workers
from workers.client.engine_client import EngineClient
from workers.eplb.expert_loads import SlotLoads
from workers.kvstore.holders import HolderIndex
from workers.kvstore.index import BlockIndex
from workers.kvstore.store import open_holders, open_index
from workers.protocol.messages import WorkerHeartbeat

# A new client knows no worker as healthy until their first heartbeats (every ~0.1 s) arrive; the
# first request waits this long for one rather than being refused at once.
FIRST_HEARTBEAT_WAIT_S = 1.0

# The client is bound to the loop that made it (its sockets and tasks live there). A server has one
# loop; code that runs several loops one after another (tests, async_to_sync) gets one per loop.
_current: tuple[asyncio.AbstractEventLoop, asyncio.Task[EngineClient]] | None = None
_discovery: asyncio.Task | None = None  # the current client's, when SLUICE_WORKER_DISCOVERY_INTERVAL_S > 0


def _store_index() -> BlockIndex | None:
    """The global KV store's index when the workers share one (Redis): routing reads hit lengths from it."""
    url = settings.SLUICE_KV_STORE_INDEX
    return open_index(url) if url and url != "memory" else None


def _holders() -> HolderIndex | None:
    """The SWA holder index beside the shared store index: routing reads who holds a sliding-window
    model's state from it, and drops the registrations of workers it finds dead."""
    url = settings.SLUICE_KV_STORE_INDEX
    return open_holders(url) if url and url != "memory" else None


async def _started_client() -> EngineClient:
    client = EngineClient(
        store_index=_store_index(),
        holders=_holders(),
        key=data_plane_key(),
        max_image_pixels=settings.SLUICE_REQUEST_LIMITS.max_image_pixels,
    )
    try:
        for request_endpoint, heartbeat_endpoint in settings.SLUICE_WORKER_ENDPOINTS:
            client.add_worker(request_endpoint, heartbeat_endpoint)
        await client.start()
    except BaseException:
        # A start that fails (a worker on the network without a key) leaves no sockets or context open.
        await client.close()
        raise
    if settings.SLUICE_WORKER_DISCOVERY_INTERVAL_S > 0:
        global _discovery
        known = set(settings.SLUICE_WORKER_ENDPOINTS)
        _discovery = asyncio.create_task(
            follow_registered_workers(client, known, settings.SLUICE_WORKER_DISCOVERY_INTERVAL_S),
            name="worker-discovery",
        )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + FIRST_HEARTBEAT_WAIT_S
    while settings.SLUICE_WORKER_ENDPOINTS and not client.healthy_workers() and loop.time() < deadline:
        await asyncio.sleep(0.02)
    return client


def _usable(task: asyncio.Task) -> bool:
    return not task.done() or (not task.cancelled() and task.exception() is None)


async def engine_client() -> EngineClient:
    global _current
    loop = asyncio.get_running_loop()
    # No await between the check and the assignment, so concurrent first requests share one client.
    if _current is None or _current[0] is not loop or not _usable(_current[1]):
        _current = (loop, loop.create_task(_started_client()))
    # Shielded: a request cancelled while the client starts must not cancel the start for the others.
    return await asyncio.shield(_current[1])


async def close_engine_client() -> None:
    global _current
    if _current is None or _current[0] is not asyncio.get_running_loop():
        return
    task, _current = _current[1], None
    global _discovery
    if _discovery is not None:
        _discovery.cancel()
        await asyncio.gather(_discovery, return_exceptions=True)
        _discovery = None
    if _usable(task):
        await (await task).close()


async def gateway_heartbeats() -> list[WorkerHeartbeat]:
    """The latest heartbeat of each worker the engine client holds healthy (the telemetry's source)."""
    return (await engine_client()).healthy_workers()


async def gateway_expert_loads() -> dict[tuple[str, int], SlotLoads]:
    """The expert loads the engine client summed from heartbeats since the last call."""
    return (await engine_client()).expert_loads.take()
