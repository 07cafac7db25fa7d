"""Decode load peaks from heartbeats: per pool, the most requests in flight and KV tokens in use its
decode and mixed workers held together at one tick of a minute, written when the minute ends; a
second gateway's row of the same minute keeps the higher figures."""

from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import async_to_sync

from controlplane.telemetry.collector import TelemetryCollector
from controlplane.telemetry.decode_loads import DecodePeak, decode_loads
from controlplane.telemetry.models import DecodeLoadRollup
from controlplane.telemetry.selectors import decode_load_peak
from controlplane.telemetry.services import decode_load_rollup_upsert

pytestmark = pytest.mark.django_db


def test_a_pool_s_load_is_the_sum_of_its_decode_and_mixed_workers(make_heartbeat):
    workers = [
        make_heartbeat(
            "d0", role="decode", pool="dec", num_running=3, num_waiting=1, kv_usage=0.5, kv_capacity_tokens=100
        ),
        make_heartbeat("d1", role="decode", pool="dec", num_running=2, kv_usage=0.25, kv_capacity_tokens=400),
        make_heartbeat("m0", role="mixed", pool="mix", num_running=7),
        make_heartbeat("p0", role="prefill", pool="pre", num_running=9),
        make_heartbeat("x", role="decode", num_running=5),  # in no pool
    ]

    assert decode_loads(workers) == {"dec": DecodePeak(6, 150), "mix": DecodePeak(7, 0)}


def test_the_collector_writes_each_minute_s_peak_per_pool(clock, heartbeats, make_heartbeat):
    collector = TelemetryCollector(heartbeats, clock=clock, window_s=60)
    minute = datetime.fromtimestamp(clock.now, UTC)

    def load(running: int, kv_usage: float) -> None:
        heartbeats.workers = [
            make_heartbeat(
                f"d{i}", role="decode", pool="dec", num_running=running, kv_usage=kv_usage, kv_capacity_tokens=1000
            )
            for i in range(2)
        ]

    # given a burst of requests at one tick, and more KV (but fewer requests) at a later one
    for running, kv_usage in ((2, 0.1), (30, 0.2), (5, 0.6)):
        load(running, kv_usage)
        clock.now += 15
        async_to_sync(collector.tick)()
    assert not DecodeLoadRollup.objects.exists()  # the minute is still running

    # when the minute ends
    load(1, 0.0)
    clock.now += 20
    async_to_sync(collector.tick)()

    # then its row holds each figure's peak over the minute's ticks, not one tick's pair
    row = DecodeLoadRollup.objects.get()
    assert (row.pool, row.minute, row.peak_requests_in_flight, row.peak_kv_tokens) == ("dec", minute, 60, 1200)


def test_a_minute_written_twice_keeps_the_higher_figures_and_the_peak_spans_the_minutes_asked():
    start = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    decode_load_rollup_upsert(pool="dec", minute=start, peak_requests_in_flight=10, peak_kv_tokens=500)
    decode_load_rollup_upsert(pool="dec", minute=start, peak_requests_in_flight=4, peak_kv_tokens=900)
    decode_load_rollup_upsert(
        pool="dec", minute=start + timedelta(minutes=1), peak_requests_in_flight=7, peak_kv_tokens=0
    )
    decode_load_rollup_upsert(pool="other", minute=start, peak_requests_in_flight=99, peak_kv_tokens=99)

    row = DecodeLoadRollup.objects.get(pool="dec", minute=start)
    assert (row.peak_requests_in_flight, row.peak_kv_tokens) == (10, 900)
    assert decode_load_peak(pool="dec", since=start, until=start + timedelta(minutes=2)) == DecodePeak(10, 900)
    later = start + timedelta(minutes=1)
    assert decode_load_peak(pool="dec", since=later, until=later + timedelta(minutes=1)) == DecodePeak(7, 0)
    assert decode_load_peak(pool="dec", since=start, until=start) is None
