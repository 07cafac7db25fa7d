"""The gateway's telemetry collector: an asyncio task in the gateway process.

It hears of each finished API call from the gateway (`record_finished_request`), reads the workers'
heartbeats from the gateway's EngineClient, and every tick (~1 s) publishes a snapshot of the last
minute to this process and to the Channels group "telemetry". When a minute ends it writes that
minute's rollup; once an hour it deletes rollups past the retention. Database work runs in a thread
(sync_to_async), never on the event loop.

It lives in the gateway because that is where requests are measured and heartbeats already arrive.
Several gateways each collect their own share: their live snapshots differ, and each writes its own
rollup row of a minute under its collector id, which the selectors merge (counts and latency
histograms add up), so the dashboard's minutes count every gateway's requests.
Decode load peaks (decode_loads) and encode pools' load (encode_loads) come from the heartbeats,
which every gateway hears alike, so their rows keep the highest any gateway saw. So do the engine
steps and KV handoffs a rollup row counts (worker_counters): every gateway's row of a minute holds
about the same, and the selectors take the largest instead of adding them up.
"""

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings

from controlplane.common.connections import close_stale_connections
from controlplane.telemetry import live
from controlplane.telemetry.decode_loads import DecodeLoadPeaks, DecodePeak
from controlplane.telemetry.encode_loads import EncodeLoads, EncodeMinute
from controlplane.telemetry.expert_loads import ExpertLoadWindow
from controlplane.telemetry.metrics import observe_request
from controlplane.telemetry.models import KVStoreGC
from controlplane.telemetry.selectors import kv_store_gcs_reporting
from controlplane.telemetry.services import (
    decode_load_rollup_upsert,
    encode_load_rollup_upsert,
    expert_load_rollup_upsert,
    rollup_upsert,
    rollups_delete_before,
)
from controlplane.telemetry.snapshot import build_snapshot, kv_store
from controlplane.telemetry.windows import MinuteTotals, RequestSample, RequestWindow, minute_start
from controlplane.telemetry.worker_counters import WorkerCounterWindow
from workers.eplb.expert_loads import SlotLoads
from workers.protocol.messages import WorkerHeartbeat

log = logging.getLogger(__name__)

GROUP = "telemetry"
TICK_S = 1.0
PRUNE_EVERY_S = 3600.0

Heartbeats = Callable[[], Awaitable[list[WorkerHeartbeat]]]
ExpertLoads = Callable[[], Awaitable[dict[tuple[str, int], SlotLoads]]]
StoreGCs = Callable[[], Awaitable[list[KVStoreGC]]]


async def _none() -> dict[tuple[str, int], SlotLoads]:
    return {}


async def reporting_store_gcs() -> list[KVStoreGC]:
    """The KV store GC processes reporting now, from the database."""
    return await sync_to_async(_in_tidy_connection)(kv_store_gcs_reporting)


class TelemetryCollector:
    def __init__(
        self,
        heartbeats: Heartbeats,
        *,
        expert_loads: ExpertLoads | None = None,
        store_gcs: StoreGCs = reporting_store_gcs,
        clock: Callable[[], float] = time.time,
        window_s: float = live.WINDOW_S,
        retention: timedelta | None = None,
        collector_id: str | None = None,
    ) -> None:
        """`clock` gives epoch seconds: minutes are wall-clock minutes. `collector_id` names this
        collector's rollup rows (default: host, process and a random part, unique to this process)."""
        self.collector_id = collector_id or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._heartbeats = heartbeats
        # The gateway's engine client sums expert loads from the heartbeats it reads; a collector fed
        # other heartbeats (a test's) has none unless given a source.
        self._expert_loads = expert_loads or _none
        self._store_gcs = store_gcs
        self._store_gc_reports: list[KVStoreGC] = []
        self._clock = clock
        self._retention = retention or timedelta(days=settings.SLUICE_TELEMETRY_RETENTION_DAYS)
        now = clock()
        self._started_at = now
        self._window = RequestWindow(window_s)
        self._minute = MinuteTotals(minute_start(now))
        self._finished: list[MinuteTotals] = []  # minutes ended and not yet written
        self._expert_window = ExpertLoadWindow(window_s)
        # Expert loads of ended minutes not yet written: (minute start, {(pool, layout version): loads}).
        self._expert_finished: list[tuple[float, dict[tuple[str, int], SlotLoads]]] = []
        self._decode_peaks = DecodeLoadPeaks()
        self._counters = WorkerCounterWindow(window_s)
        self._decode_finished: list[tuple[float, dict[str, DecodePeak]]] = []  # (minute start, {pool: peak})
        self._encode_loads = EncodeLoads()
        self._encode_finished: list[tuple[float, dict[str, EncodeMinute]]] = []  # (minute start, {pool: load})
        self._prune_at = now

    def record_request(self, sample: RequestSample) -> None:
        now = self._clock()
        self._roll(now)
        self._window.add(now, sample)
        self._minute.add(sample)

    async def tick(self) -> dict:
        """One round: snapshot, broadcast, write the minutes that ended, prune when due; returns the snapshot."""
        workers = await self._heartbeats()
        expert_loads = await self._expert_loads()
        try:
            self._store_gc_reports = await self._store_gcs()
        except Exception:
            log.warning("reading the KV store GCs' reports failed; showing the last ones read", exc_info=True)
        store_gcs = self._store_gc_reports
        now = self._clock()
        self._roll(now)
        self._expert_window.add(now, expert_loads)
        self._decode_peaks.add(workers)
        self._encode_loads.add(workers)
        self._minute.add_counts(self._counters.add(now, workers))
        store = kv_store(workers, store_gcs)
        if store is not None:
            self._minute.kv_store_bytes = store["bytes"]
        snapshot = build_snapshot(
            at=datetime.fromtimestamp(now, UTC),
            window_s=self._window.span_s,
            workers=workers,
            totals=self._window.totals(now),
            elapsed_s=now - self._started_at,
            expert_load=self._expert_window.by_pool(now),
            store_gcs=store_gcs,
            counters=self._counters.by_worker(now),
        )
        live.publish(snapshot)
        await self._broadcast(snapshot)
        await self._write_finished()
        if now >= self._prune_at:
            self._prune_at = now + PRUNE_EVERY_S
            await self._prune(now)
        return snapshot

    async def run(self, interval_s: float = TICK_S) -> None:
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("telemetry tick failed")
            await asyncio.sleep(interval_s)

    def _roll(self, now: float) -> None:
        start = minute_start(now)
        if start > self._minute.start:
            self._finished.append(self._minute)
            ended = self._expert_window.end_minute()
            if ended:
                self._expert_finished.append((self._minute.start, ended))
            decode_peaks = self._decode_peaks.end_minute()
            if decode_peaks:
                self._decode_finished.append((self._minute.start, decode_peaks))
            encode_loads = self._encode_loads.end_minute()
            if encode_loads:
                self._encode_finished.append((self._minute.start, encode_loads))
            self._minute = MinuteTotals(start, kv_store_bytes=self._minute.kv_store_bytes)

    async def _broadcast(self, snapshot: dict) -> None:
        try:
            await get_channel_layer().group_send(GROUP, {"type": "telemetry.update", "snapshot": snapshot})
        except Exception:
            log.warning("broadcasting telemetry failed", exc_info=True)

    async def _write_finished(self) -> None:
        expert_finished, self._expert_finished = self._expert_finished, []
        for start, by_layout in expert_finished:
            minute = datetime.fromtimestamp(start, UTC)
            for (pool, version), loads in by_layout.items():
                try:
                    await sync_to_async(_in_tidy_connection)(
                        expert_load_rollup_upsert, pool=pool, layout_version=version, minute=minute, slot_loads=loads
                    )
                except Exception:
                    log.exception("writing the expert loads of pool %s at %s failed", pool, minute)
        decode_finished, self._decode_finished = self._decode_finished, []
        for start, by_pool in decode_finished:
            minute = datetime.fromtimestamp(start, UTC)
            for pool, peak in by_pool.items():
                try:
                    await sync_to_async(_in_tidy_connection)(
                        decode_load_rollup_upsert,
                        pool=pool,
                        minute=minute,
                        peak_requests_in_flight=peak.requests_in_flight,
                        peak_kv_tokens=peak.kv_tokens,
                    )
                except Exception:
                    log.exception("writing the decode load of pool %s at %s failed", pool, minute)
        encode_finished, self._encode_finished = self._encode_finished, []
        for start, by_pool in encode_finished:
            minute = datetime.fromtimestamp(start, UTC)
            for pool, load in by_pool.items():
                try:
                    await sync_to_async(_in_tidy_connection)(
                        encode_load_rollup_upsert,
                        pool=pool,
                        minute=minute,
                        patches_demanded=load.patches_demanded,
                        peak_patches_in_flight=load.peak_patches_in_flight,
                        patches_per_second=load.patches_per_second,
                    )
                except Exception:
                    log.exception("writing the encode load of pool %s at %s failed", pool, minute)
        finished, self._finished = self._finished, []
        for minute in finished:
            fields = minute.rollup_fields(self.collector_id)
            try:
                await sync_to_async(_in_tidy_connection)(rollup_upsert, **fields)
            except Exception:
                log.exception("writing the telemetry rollup of %s failed", fields["minute"])

    async def _prune(self, now: float) -> None:
        cutoff = datetime.fromtimestamp(now, UTC) - self._retention
        try:
            await sync_to_async(_in_tidy_connection)(rollups_delete_before, cutoff=cutoff)
        except Exception:
            log.exception("deleting old telemetry rollups failed")


def _in_tidy_connection(work: Callable[..., Any], **kwargs: Any) -> Any:
    """Runs database work the way a request would: the collector is no request, so nothing else
    drops its thread's connection once it is broken or past CONN_MAX_AGE. A connection inside a
    transaction is someone else's (a test's) and is left alone."""
    close_stale_connections()
    try:
        return work(**kwargs)
    finally:
        close_stale_connections()


# The collector runs on the loop that started it, like the gateway's EngineClient (engine.py): a
# server has one loop; tests and async_to_sync get one per loop.
_current: tuple[asyncio.AbstractEventLoop, TelemetryCollector, asyncio.Task] | None = None


async def telemetry_collector(heartbeats: Heartbeats, *, expert_loads: ExpertLoads) -> TelemetryCollector:
    """This loop's collector, started on first use (the gateway's lifespan starts it, with its engine
    client's heartbeats and expert loads as the sources)."""
    global _current
    loop = asyncio.get_running_loop()
    if _current is None or _current[0] is not loop or _current[2].done():
        collector = TelemetryCollector(heartbeats, expert_loads=expert_loads)
        _current = (loop, collector, loop.create_task(collector.run(), name="telemetry-collector"))
    return _current[1]


async def close_telemetry_collector() -> None:
    global _current
    if _current is None or _current[0] is not asyncio.get_running_loop():
        return
    task, _current = _current[2], None
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    live.forget()


def record_finished_request(sample: RequestSample) -> None:
    """Counts a finished API call in /metrics and, when this loop runs a collector, in its windows."""
    observe_request(sample)
    if _current is not None and _current[0] is asyncio.get_running_loop():
        _current[1].record_request(sample)
