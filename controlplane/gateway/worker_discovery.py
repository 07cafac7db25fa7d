"""The gateway follows the topology: workers that registered after it started (the autoscaler's, an
operator's, through the node agents) are added to its EngineClient, which routes to them once their
heartbeats arrive. Workers that go away need nothing here: their heartbeats stop and the client stops
routing to them. On when SLUICE_WORKER_DISCOVERY_INTERVAL_S > 0 (`serve` turns it on)."""

import asyncio
import logging

from asgiref.sync import sync_to_async

from controlplane.common.connections import close_stale_connections
from controlplane.topology.models import EngineInstance, InstanceState
from workers.client.engine_client import EngineClient
from workers.curve import CurveError

log = logging.getLogger(__name__)

Endpoints = tuple[str, str]  # (request, heartbeat)


def new_ready_workers(known: set[Endpoints]) -> list[Endpoints]:
    """Ready instances' endpoints not in `known`, oldest first."""
    close_stale_connections()
    rows = (
        EngineInstance.objects.filter(state=InstanceState.READY)
        .exclude(request_endpoint="")
        .order_by("id")
        .values_list("request_endpoint", "heartbeat_endpoint")
    )
    return [pair for pair in rows if pair not in known]


async def follow_registered_workers(client: EngineClient, known: set[Endpoints], interval_s: float) -> None:
    """Every `interval_s`, adds the ready workers the client does not know yet (`known` is updated)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            found = await sync_to_async(new_ready_workers)(set(known))
        except Exception:
            log.exception("reading the registered workers failed")
            continue
        for request_endpoint, heartbeat_endpoint in found:
            known.add((request_endpoint, heartbeat_endpoint))
            try:
                client.add_worker(request_endpoint, heartbeat_endpoint)
            except CurveError as error:  # said once: the endpoint stays known
                log.error("not following worker at %s: %s", request_endpoint, error)
                continue
            log.info("following worker at %s", request_endpoint)
