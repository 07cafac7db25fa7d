"""The autoscaler on an encode pool, applied to PostgreSQL: the gateways' encode-load rows (patches
asked per minute, one encoder's measured capacity) size it; every change and every hold is a
ScalingEvent with its why; without a measured capacity it is left as it is."""

from datetime import UTC, datetime, timedelta

import pytest

from controlplane.telemetry.services import encode_load_rollup_upsert
from controlplane.topology.models import Node, Pool, ScalingEvent
from controlplane.topology.services import autoscale_tick
from workers.autoscale import PlannerConfig

pytestmark = pytest.mark.django_db

START = datetime(2026, 12, 1, 12, 0, 5, tzinfo=UTC)
CAPACITY = 1000.0  # patches/s one encoder measured


@pytest.fixture
def encode_pool(make_pool):
    pool = make_pool("vision", kind="encode", min_instances=1, max_instances=6, target_instances=2)
    Node.objects.create(cluster=pool.cluster, hostname="node-a")
    return pool


def asked(pool: Pool, now: datetime, patches_per_s: float, *, capacity: float = CAPACITY) -> None:
    """The look-back's five minutes before `now`, each asking `patches_per_s` of the pool."""
    end = now.replace(second=0)
    for minutes in range(1, 6):
        encode_load_rollup_upsert(
            pool=pool.name,
            minute=end - timedelta(minutes=minutes),
            patches_demanded=int(patches_per_s * 60),
            peak_patches_in_flight=0,
            patches_per_second=capacity,
        )


def target(pool: Pool) -> int:
    return Pool.objects.get(pk=pool.pk).target_instances


def test_patches_asked_beyond_the_encoders_capacity_grow_the_pool_and_idleness_shrinks_it(encode_pool):
    # given 2 encoders of 1,000 patches/s asked 3,000 patches/s (1.5 of their capacity)
    asked(encode_pool, START, 3000.0)

    # when the autoscaler ticks
    autoscale_tick(now=START)

    # then the pool grows to ceil(3000 / (1000 * 0.6)) = 5, as one audited decision
    assert target(encode_pool) == 5
    scaled = ScalingEvent.objects.get(pool=encode_pool, action="pool_scaled")
    assert scaled.actor_label == "system" and scaled.why["rule"] == "scale_up"
    assert scaled.why["inputs"]["demands"]["patches_per_s"] == {"mean": 3000.0, "peak": 3000.0, "per_worker": 1000.0}
    # and the node agent was asked for the 5 instances the target lacks (none registered yet)
    assert ScalingEvent.objects.filter(pool=encode_pool, action="instance_start_requested").count() == 5

    # when the images stop and a cool-down has passed, it shrinks toward its minimum, 2 per window
    later = START + timedelta(seconds=PlannerConfig().scale_down_cooldown_s + 60)
    asked(encode_pool, later, 0.0)
    autoscale_tick(now=later)
    assert target(encode_pool) == 3
    assert ScalingEvent.objects.filter(pool=encode_pool, action="pool_scaled").latest("id").why["rule"] == "scale_down"


def test_without_a_measured_capacity_the_pool_is_held(encode_pool):
    # given heavy demand, but no encoder has measured the patches per second it encodes
    asked(encode_pool, START, 50_000.0, capacity=0.0)

    report = autoscale_tick(now=START)

    assert report.decisions[str(encode_pool)].rule == "no_signal"
    assert target(encode_pool) == 2
    assert not ScalingEvent.objects.filter(pool=encode_pool, action="pool_scaled").exists()


def test_a_scale_up_held_by_the_window_s_rate_limit_is_recorded_once(encode_pool):
    # given demand for 6 encoders' worth while the window allows 1 more
    Pool.objects.filter(pk=encode_pool.pk).update(scale_up_max_per_window=1)
    asked(encode_pool, START, 6000.0)
    autoscale_tick(now=START)
    assert target(encode_pool) == 3

    # when it ticks twice more within the window
    autoscale_tick(now=START + timedelta(seconds=15))
    autoscale_tick(now=START + timedelta(seconds=30))

    # then the target stays, and the hold is one event with its rule
    assert target(encode_pool) == 3
    held = ScalingEvent.objects.get(pool=encode_pool, action="autoscale_held")
    assert held.why["rule"] == "rate_limited" and held.why["wanted"] == 6
