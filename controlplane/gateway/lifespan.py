"""ASGI lifespan (uvicorn sends it; Django has none): do the slow first-use work before the first
request (the catalog, the prepare processes), start the telemetry collector, warn loudly when the
gateway is open, and stop the collector, disconnect from the workers and stop the prepare processes
on shutdown."""

import asyncio
import logging

from asgiref.sync import sync_to_async
from django.db import connections

from controlplane.gateway.auth import warn_open_mode
from controlplane.gateway.catalog import served_catalog
from controlplane.gateway.engine import close_engine_client, engine_client, gateway_expert_loads, gateway_heartbeats
from controlplane.gateway.preparation import close_preparation, start_preparation
from controlplane.telemetry.collector import close_telemetry_collector, telemetry_collector
from controlplane.tenants.selectors import api_keys_exist
from workers.curve import CurveError

log = logging.getLogger(__name__)


def _gateway_is_open() -> bool:
    try:
        return not api_keys_exist()
    finally:
        # Not a request, so nothing else would close this thread's connection.
        connections.close_all()


async def _start() -> None:
    await served_catalog()
    await engine_client()
    start_preparation()
    await telemetry_collector(gateway_heartbeats, expert_loads=gateway_expert_loads)
    if await sync_to_async(_gateway_is_open)():
        warn_open_mode()


async def lifespan(scope: dict, receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            try:
                await _start()
            except CurveError as error:  # one line that says what to do; no traceback to read through
                log.error("gateway startup failed: %s", error)
                await send({"type": "lifespan.startup.failed", "message": str(error)})
                return
            except Exception as error:
                log.exception("gateway startup failed")
                await send({"type": "lifespan.startup.failed", "message": str(error)})
                return
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await close_telemetry_collector()
            await close_engine_client()
            await asyncio.to_thread(close_preparation)
            await send({"type": "lifespan.shutdown.complete"})
            return
