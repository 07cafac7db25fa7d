"""One-minute rollups: written when the minute ends (one row per minute and collector, however often
it is written), merged across gateways (two collectors writing the same minute: counts and latencies
of both), old rows deleted by the retention, and read back oldest first by rollup_series."""

from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from controlplane.telemetry.collector import TelemetryCollector
from controlplane.telemetry.latency_histogram import histogram
from controlplane.telemetry.models import DecodeLoadRollup, TelemetryRollup
from controlplane.telemetry.selectors import rollup_series, rollup_token_totals
from controlplane.telemetry.services import decode_load_rollup_upsert, rollup_upsert
from controlplane.telemetry.windows import RequestSample
from workers.protocol.messages import HandoffTotals, HistogramCounts, SpecDecodeTotals

pytestmark = pytest.mark.django_db


def at(clock) -> datetime:
    return datetime.fromtimestamp(clock.now, UTC)


def write(minute: datetime, **fields) -> TelemetryRollup:
    values = {
        "requests": 1,
        "prompt_tokens": 100,
        "cached_tokens": 25,
        "generation_tokens": 10,
        "collector": "gateway-a",
        "ttft_histogram": {},
        "itl_histogram": {},
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
    assert (rollup.minute, rollup.collector) == (minute, collector.collector_id)
    assert (rollup.requests, rollup.prompt_tokens, rollup.cached_tokens, rollup.generation_tokens) == (4, 200, 40, 20)
    assert rollup.ttft_histogram == histogram([0.1, 0.2, 0.3, 0.4])
    assert rollup.itl_histogram == histogram([0.01, 0.03] * 4)
    assert rollup.kv_store_bytes == 2048
    [merged] = rollup_series(minutes=60 * 24 * 365 * 100)
    assert (merged["ttft_p50_s"], merged["ttft_p99_s"]) == (pytest.approx(0.2, rel=0.05), pytest.approx(0.4, rel=0.05))
    assert (merged["itl_p50_s"], merged["itl_p99_s"]) == (pytest.approx(0.01, rel=0.05), pytest.approx(0.03, rel=0.05))


def test_two_collectors_writing_the_same_minute_are_merged(clock, heartbeats, make_heartbeat):
    # given two gateways' collectors serving the same minute: 90 fast requests on one, 10 slow on the other
    gateways = [TelemetryCollector(heartbeats, clock=clock), TelemetryCollector(heartbeats, clock=clock)]
    assert gateways[0].collector_id != gateways[1].collector_id
    minute = at(clock)
    heartbeats.workers = [make_heartbeat("w0", kv_block_tokens=64, kv_store_bytes=4096)]
    for _ in range(90):
        gateways[0].record_request(RequestSample(0.05, (0.01,), 100, 80, 2, ("stop",)))
    for _ in range(10):
        gateways[1].record_request(RequestSample(2.0, (0.5, 0.5), 1000, 0, 3, ("stop",)))
    clock.now += 30
    for collector in gateways:
        async_to_sync(collector.tick)()

    # when the minute ends and both write it
    clock.now += 40
    for collector in gateways:
        async_to_sync(collector.tick)()

    # then the minute counts every request of both, and its percentiles are those of all 100
    assert TelemetryRollup.objects.filter(minute=minute).count() == 2
    [merged] = rollup_series(minutes=60 * 24 * 365 * 100)
    assert merged["minute"] == minute
    assert (merged["requests"], merged["prompt_tokens"], merged["cached_tokens"]) == (100, 19_000, 7_200)
    assert merged["generation_tokens"] == 210
    assert merged["cache_hit_rate"] == pytest.approx(7_200 / 19_000)
    assert merged["ttft_p50_s"] == pytest.approx(0.05, rel=0.05)
    assert merged["ttft_p99_s"] == pytest.approx(2.0, rel=0.05)
    assert merged["itl_p50_s"] == pytest.approx(0.01, rel=0.05)
    assert merged["itl_p99_s"] == pytest.approx(0.5, rel=0.05)
    assert merged["kv_store_bytes"] == 4096
    assert rollup_token_totals(since=minute, until=minute + timedelta(minutes=1)) == {minute: (19_000, 7_200)}


def test_a_minute_counts_the_steps_and_handoffs_the_workers_counters_grew_by(clock, heartbeats, make_heartbeat):
    # given a prefill and a decode worker heard before the minute, then 20 s of work in it
    def beats(steps: int, seconds: float, handoffs: int, handoff_seconds: float) -> list:
        step_seconds = HistogramCounts(bounds=(1.0,), counts=(steps, 0), total=seconds)
        received = {"zmq": HandoffTotals(num_transfers=handoffs, num_bytes=handoffs * 100, seconds=handoff_seconds)}
        return [
            make_heartbeat("p0", role="prefill", step_seconds=step_seconds),
            make_heartbeat("d0", role="decode", step_seconds=step_seconds, handoff_received=received),
        ]

    collector = TelemetryCollector(heartbeats, clock=clock)
    minute = at(clock)
    heartbeats.workers = beats(10, 1.0, 5, 0.5)
    async_to_sync(collector.tick)()
    clock.now += 20
    heartbeats.workers = beats(30, 3.0, 9, 0.9)
    async_to_sync(collector.tick)()

    # when the minute ends
    clock.now += 50
    async_to_sync(collector.tick)()

    # then its row holds what the counters grew by: 20 steps on each worker, 4 handoffs received
    rollup = TelemetryRollup.objects.get(minute=minute)
    assert (rollup.engine_steps, rollup.engine_step_seconds) == (40, pytest.approx(4.0))
    assert (rollup.kv_handoffs, rollup.kv_handoff_seconds) == (4, pytest.approx(0.4))
    [merged] = rollup_series(minutes=60 * 24 * 365 * 100)
    assert merged["step_time_mean_s"] == pytest.approx(0.1)
    assert merged["kv_handoff_mean_s"] == pytest.approx(0.1)


def test_a_minute_counts_speculative_decoding_and_the_series_gives_acceptance_length_and_budget(
    clock, heartbeats, make_heartbeat
):
    # given a speculating decode worker heard before the minute, then 20 s of work in it
    def beat(drafts: int, draft_tokens: int, accepted: int, steps: int) -> list:
        spec = SpecDecodeTotals(
            method="ngram",
            num_drafts=drafts,
            num_draft_tokens=draft_tokens,
            num_accepted_tokens=accepted,
            accepted_per_position=(accepted,),
            budget=HistogramCounts(bounds=(16.0,), counts=(steps, 0), total=float(draft_tokens)),
        )
        return [make_heartbeat("d0", role="decode", spec_decode=spec)]

    collector = TelemetryCollector(heartbeats, clock=clock)
    minute = at(clock)
    heartbeats.workers = beat(100, 500, 300, 25)
    async_to_sync(collector.tick)()
    clock.now += 20
    heartbeats.workers = beat(140, 660, 380, 35)
    async_to_sync(collector.tick)()

    # when the minute ends
    clock.now += 50
    async_to_sync(collector.tick)()

    # then its row holds what the counters grew by, and the series the figures the dashboard plots
    rollup = TelemetryRollup.objects.get(minute=minute)
    assert (rollup.spec_drafts, rollup.spec_draft_tokens, rollup.spec_accepted_tokens) == (40, 160, 80)
    assert (rollup.spec_steps, rollup.spec_budget_tokens) == (10, pytest.approx(160.0))
    [merged] = rollup_series(minutes=60 * 24 * 365 * 100)
    assert merged["spec_acceptance_length"] == pytest.approx(3.0)
    assert merged["spec_verified_per_draft"] == pytest.approx(4.0)
    assert merged["spec_budget_per_step"] == pytest.approx(16.0)


def test_gateways_that_heard_the_same_workers_are_not_added_up():
    minute = timezone.now().replace(second=0, microsecond=0)
    write(minute, collector="gateway-a", engine_steps=100, engine_step_seconds=1.0, kv_handoffs=0)
    write(minute, collector="gateway-b", engine_steps=98, engine_step_seconds=2.0, kv_handoffs=4, kv_handoff_seconds=2)

    [merged] = rollup_series(minutes=5)

    # each figure from the row that counted the most of it
    assert merged["step_time_mean_s"] == pytest.approx(0.01)
    assert merged["kv_handoff_mean_s"] == pytest.approx(0.5)


def test_the_slowest_request_of_the_minute_counts_whichever_gateway_served_it():
    # given one slow request among a few, served by another gateway than the fast ones
    minute = timezone.now().replace(second=0, microsecond=0)
    write(minute, collector="gateway-a", requests=3, ttft_histogram=histogram([0.1, 0.1, 0.1]))
    write(minute, collector="gateway-b", requests=1, ttft_histogram=histogram([3.0]), kv_store_bytes=10)

    # when
    [merged] = rollup_series(minutes=5)

    # then the minute's p99 is the slow one (one in four), its p50 a fast one
    assert merged["requests"] == 4
    assert merged["ttft_p99_s"] == pytest.approx(3.0, rel=0.05)
    assert merged["ttft_p50_s"] == pytest.approx(0.1, rel=0.05)
    assert merged["itl_p50_s"] is None
    assert merged["kv_store_bytes"] == 10


def test_a_collector_rewriting_its_minute_replaces_its_row(clock):
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
        "step_time_mean_s",
        "kv_handoff_mean_s",
        "spec_acceptance_length",
        "spec_verified_per_draft",
        "spec_budget_per_step",
    }
