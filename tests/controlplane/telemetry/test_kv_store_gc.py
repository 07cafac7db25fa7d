"""The KV store GC process's reports in the control plane: recorded run after run, read while it runs
(a stopped one drops out), pruned with the rollups, and shown in the live snapshot's store panel
beside the workers' heartbeats."""

from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from controlplane.telemetry.collector import TelemetryCollector
from controlplane.telemetry.models import KVStoreGC
from controlplane.telemetry.selectors import kv_store_gcs_reporting
from controlplane.telemetry.services import kv_store_gc_record, rollups_delete_before
from controlplane.telemetry.snapshot import kv_store
from workers.kvstore.gc_process import StoreGCReport

pytestmark = pytest.mark.django_db


def report(at: datetime, **fields) -> StoreGCReport:
    values = {
        "gc_id": "kv-gc-host-1",
        "hostname": "host",
        "store": "/var/kvstore",
        "index_kind": "memory",
        "eviction_policy": "best",
        "capacity_bytes": 1000,
        "low_watermark": 0.8,
        "high_watermark": 0.95,
        "interval_s": 10.0,
        "started_at": at.timestamp() - 60,
        "reported_at": at.timestamp(),
        "num_blocks": 3,
        "num_bytes": 300,
        "evicted_expired": 1,
        "evicted_capacity": 2,
        "bytes_freed": 400,
        "checkpoints_removed": 5,
        **fields,
    }
    return StoreGCReport(**values)


def test_each_run_rewrites_the_gcs_row_and_only_running_gcs_are_read():
    now = timezone.now()
    kv_store_gc_record(report=report(now - timedelta(seconds=20), num_blocks=1))
    kv_store_gc_record(report=report(now, num_blocks=3))  # the same GC's next run
    kv_store_gc_record(report=report(now - timedelta(minutes=5), gc_id="kv-gc-stopped"))

    [running] = kv_store_gcs_reporting(now=now)

    assert (running.gc_id, running.num_blocks, running.checkpoints_removed) == ("kv-gc-host-1", 3, 5)
    assert abs((running.reported_at - now).total_seconds()) < 1e-3
    assert KVStoreGC.objects.count() == 2


def test_the_retention_prunes_gcs_silent_since_its_cutoff():
    now = timezone.now()
    kv_store_gc_record(report=report(now - timedelta(days=20), gc_id="gone"))
    kv_store_gc_record(report=report(now))

    rollups_delete_before(cutoff=now - timedelta(days=14))

    assert list(KVStoreGC.objects.values_list("gc_id", flat=True)) == ["kv-gc-host-1"]


def test_the_store_panel_takes_limits_from_the_gc_process_and_usage_from_the_workers(make_heartbeat):
    gc = KVStoreGC(capacity_bytes=1000, low_watermark=0.8, high_watermark=0.95, num_bytes=300, num_blocks=3)
    worker = make_heartbeat("d0", kv_block_tokens=64, kv_store_bytes=350, kv_store_blocks=4, sent_at=5.0)
    worker_gc = make_heartbeat("w1", kv_block_tokens=64, kv_store_capacity_bytes=2000, kv_store_low_watermark=0.5)

    assert kv_store([worker], [gc]) == {
        "bytes": 350,
        "blocks": 4,
        "capacity_bytes": 1000,
        "low_watermark": 0.8,
        "high_watermark": 0.95,
    }
    assert kv_store([], [gc])["bytes"] == 300  # no worker has a store: the GC's own count
    assert kv_store([worker_gc], [gc])["capacity_bytes"] == 2000  # a worker runs a GC: its own figures
    assert kv_store([worker], [])["capacity_bytes"] is None
    assert kv_store([], []) is None


def test_the_collectors_snapshot_shows_the_gc_process(clock, heartbeats, make_heartbeat):
    gc = KVStoreGC(capacity_bytes=1000, low_watermark=0.8, high_watermark=0.95, num_bytes=300, num_blocks=3)

    async def store_gcs() -> list[KVStoreGC]:
        return [gc]

    heartbeats.workers = [make_heartbeat("d0", kv_block_tokens=64, kv_store_bytes=350, kv_store_blocks=4)]
    snapshot = async_to_sync(TelemetryCollector(heartbeats, store_gcs=store_gcs, clock=clock).tick)()

    assert snapshot["kv_store"]["capacity_bytes"] == 1000
    assert snapshot["kv_store"]["bytes"] == 350
    assert datetime.fromisoformat(snapshot["at"]) == datetime.fromtimestamp(clock.now, UTC)
