"""One-minute rollups: written when the minute ends (one row per minute, however often it is
written), old rows deleted by the retention, and read back oldest first by rollup_series."""

from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from controlplane.telemetry.collector import TelemetryCollector
from controlplane.telemetry.models import DecodeLoadRollup, TelemetryRollup
from controlplane.telemetry.selectors import rollup_series
from controlplane.telemetry.services import decode_load_rollup_upsert, rollup_upsert
from controlplane.telemetry.windows import RequestSample

pytestmark = pytest.mark.django_db


def at(clock) -> datetime:
    return datetime.fromtimestamp(clock.now, UTC)


def write(minute: datetime, **fields) -> TelemetryRollup:
    values = {
        "requests": 1,
        "prompt_tokens": 100,
        "cached_tokens": 25,
        "generation_tokens": 10,
        "ttft_p50_s": None,
        "ttft_p99_s": None,
        "itl_p50_s": None,
        "itl_p99_s": None,
        "kv_store_bytes": None,
        **fields,
    }
    return rollup_upsert(minute=minute, **values)


def test_a_finished_minute_is_written_once(clock, heartbeats, make_heartbeat):
    collector = TelemetryCollector(heartbeats, clock=clock)
    minute = at(clock)
    heartbeats.workers = [make_heartbeat("w0", kv_block_tokens=64, kv_store_bytes=2048)]
    for ttft in (0.1, 0.2, 0.3, 0.4):
        collector.record_request(RequestSample(ttft, (0.01, 0.03), 50, 10, 5, ("stop",)))
    clock.now += 30
    async_to_sync(collector.tick)()
    assert not TelemetryRollup.objects.exists()  # the minute is still running

    clock.now += 40  # into the next minute
    async_to_sync(collector.tick)()
    clock.now += 1
    async_to_sync(collector.tick)()

    rollup = TelemetryRollup.objects.get()
    assert rollup.minute == minute
    assert (rollup.requests, rollup.prompt_tokens, rollup.cached_tokens, rollup.generation_tokens) == (4, 200, 40, 20)
    assert (rollup.ttft_p50_s, rollup.ttft_p99_s) == (0.2, 0.4)
    assert (rollup.itl_p50_s, rollup.itl_p99_s) == (0.01, 0.03)
    assert rollup.kv_store_bytes == 2048


def test_rewriting_a_minute_replaces_its_row(clock):
    minute = at(clock)
    write(minute, requests=1)
    write(minute, requests=7)

    assert list(TelemetryRollup.objects.values_list("requests", flat=True)) == [7]


def test_the_collector_deletes_rollups_past_the_retention(clock, heartbeats):
    now = at(clock)
    write(now - timedelta(days=15))
    kept = write(now - timedelta(days=13))
    for days in (15, 13):
        decode_load_rollup_upsert(
            pool="dec", minute=now - timedelta(days=days), peak_requests_in_flight=days, peak_kv_tokens=0
        )

    async_to_sync(TelemetryCollector(heartbeats, clock=clock, retention=timedelta(days=14)).tick)()

    assert list(TelemetryRollup.objects.all()) == [kept]
    assert list(DecodeLoadRollup.objects.values_list("peak_requests_in_flight", flat=True)) == [13]


def test_the_default_retention_comes_from_the_settings(clock, heartbeats, settings):
    settings.SLUICE_TELEMETRY_RETENTION_DAYS = 2
    now = at(clock)
    write(now - timedelta(days=3))
    kept = write(now - timedelta(days=1))

    async_to_sync(TelemetryCollector(heartbeats, clock=clock).tick)()

    assert list(TelemetryRollup.objects.all()) == [kept]


def test_rollup_series_lists_the_last_minutes_oldest_first_with_hit_rates():
    this_minute = timezone.now().replace(second=0, microsecond=0)
    write(this_minute - timedelta(minutes=90))  # outside the hour asked for
    write(this_minute, prompt_tokens=0, cached_tokens=0)
    write(this_minute - timedelta(minutes=2), prompt_tokens=200, cached_tokens=150)

    series = rollup_series(minutes=60)

    assert [row["minute"] for row in series] == [this_minute - timedelta(minutes=2), this_minute]
    assert [row["cache_hit_rate"] for row in series] == [0.75, None]
    assert set(series[0]) == {
        "minute",
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "generation_tokens",
        "ttft_p50_s",
        "ttft_p99_s",
        "itl_p50_s",
        "itl_p99_s",
        "kv_store_bytes",
        "cache_hit_rate",
    }
