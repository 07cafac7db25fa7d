"""Encode pools' load from the encoders' heartbeats: per pool and minute, the image patches asked of
its encoders (finished plus the growth of those held), the most held at once and one encoder's
measured capacity, written when the minute ends; a second gateway's row keeps the higher figures; the
autoscaler's selector reads the look-back's minutes as patches per second."""

from datetime import UTC, datetime, timedelta

import pytest
from asgiref.sync import async_to_sync

from controlplane.telemetry.collector import TelemetryCollector
from controlplane.telemetry.encode_loads import EncodeLoads, EncodeMinute, patches_demanded
from controlplane.telemetry.models import EncodeLoadRollup
from controlplane.telemetry.selectors import encode_load
from controlplane.telemetry.services import encode_load_rollup_upsert

START = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def encoder(make_heartbeat, worker_id: str, *, encoded: int, in_flight: int, capacity: float = 0.0, **fields):
    return make_heartbeat(
        worker_id,
        role="encode",
        pool=fields.pop("pool", "vision"),
        num_patches_encoded=encoded,
        patches_in_flight=in_flight,
        patches_per_second=capacity,
        **fields,
    )


def test_patches_asked_are_those_finished_plus_the_growth_of_those_held(make_heartbeat):
    before = encoder(make_heartbeat, "e0", encoded=1000, in_flight=200, started_at=1.0)

    # 300 finished and 100 more held: 400 came; 300 finished and 100 fewer held: 200 came
    assert patches_demanded(before, encoder(make_heartbeat, "e0", encoded=1300, in_flight=300, started_at=1.0)) == 400
    assert patches_demanded(before, encoder(make_heartbeat, "e0", encoded=1300, in_flight=100, started_at=1.0)) == 200
    # a restarted encoder counts everything since its start
    restarted = encoder(make_heartbeat, "e0", encoded=50, in_flight=10, started_at=2.0)
    assert patches_demanded(before, restarted) == 60


def test_a_minute_sums_the_pool_s_encoders_and_leaves_other_roles_and_pools_apart(make_heartbeat):
    loads = EncodeLoads()
    loads.add(
        [
            encoder(make_heartbeat, "e0", encoded=5000, in_flight=100),  # first heard: its past is not counted
            encoder(make_heartbeat, "e1", encoded=0, in_flight=0, capacity=3000.0),
            make_heartbeat("p0", role="prefill", pool="prefill", num_running=4),
            encoder(make_heartbeat, "x", encoded=0, in_flight=0, pool=""),  # in no pool
        ]
    )
    loads.add(
        [
            encoder(make_heartbeat, "e0", encoded=5600, in_flight=400, capacity=1000.0),
            encoder(make_heartbeat, "e1", encoded=200, in_flight=50, capacity=3000.0),
        ]
    )

    # (600 + 300) + (200 + 50) came; 450 held at the second tick; capacity the mean of the two measured
    assert loads.end_minute() == {"vision": EncodeMinute(1150, 450, 2000.0)}
    assert loads.minute == {}


@pytest.mark.django_db
def test_the_collector_writes_each_minute_s_encode_load(clock, heartbeats, make_heartbeat):
    collector = TelemetryCollector(heartbeats, clock=clock, window_s=60)
    minute = datetime.fromtimestamp(clock.now, UTC)
    # given an encoder that measured 2,000 patches/s, finishing 600 patches and holding more each tick
    for encoded, in_flight in ((0, 0), (600, 300), (1200, 900)):
        heartbeats.workers = [encoder(make_heartbeat, "e0", encoded=encoded, in_flight=in_flight, capacity=2000.0)]
        clock.now += 15
        async_to_sync(collector.tick)()

    # when the minute ends
    heartbeats.workers = [encoder(make_heartbeat, "e0", encoded=1800, in_flight=600, capacity=2000.0)]
    clock.now += 20
    async_to_sync(collector.tick)()

    # then its row holds the patches asked at the minute's later ticks (600 + 300, then 600 + 600), the
    # most held at once and the encoder's capacity
    row = EncodeLoadRollup.objects.get()
    assert (row.pool, row.minute, row.patches_demanded, row.peak_patches_in_flight, row.patches_per_second) == (
        "vision",
        minute,
        2100,
        900,
        2000.0,
    )


@pytest.mark.django_db
def test_a_minute_written_twice_keeps_the_higher_figures_and_the_selector_gives_patches_per_second():
    encode_load_rollup_upsert(
        pool="vision", minute=START, patches_demanded=6000, peak_patches_in_flight=100, patches_per_second=0.0
    )
    encode_load_rollup_upsert(
        pool="vision", minute=START, patches_demanded=5400, peak_patches_in_flight=300, patches_per_second=900.0
    )
    encode_load_rollup_upsert(
        pool="vision",
        minute=START + timedelta(minutes=2),
        patches_demanded=12000,
        peak_patches_in_flight=0,
        patches_per_second=1000.0,
    )
    encode_load_rollup_upsert(
        pool="other", minute=START, patches_demanded=99, peak_patches_in_flight=99, patches_per_second=99.0
    )

    row = EncodeLoadRollup.objects.get(pool="vision", minute=START)
    assert (row.patches_demanded, row.peak_patches_in_flight, row.patches_per_second) == (6000, 300, 900.0)
    # three minutes asked: the one without a row counts as none; the latest measured capacity is used
    load = encode_load(pool="vision", since=START, until=START + timedelta(minutes=3))
    assert (load.patches_per_s, load.patches_per_s_per_encoder) == ([100.0, 0.0, 200.0], 1000.0)
    # no row in the time asked: no minutes at all (no collector heard the pool's encoders)
    later = START + timedelta(minutes=10)
    assert encode_load(pool="vision", since=later, until=later + timedelta(minutes=3)).patches_per_s == []
