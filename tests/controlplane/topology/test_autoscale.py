"""The autoscaler applied to PostgreSQL: ticks on a fake clock read synthetic demand (telemetry
rollups, instance loads), scale through pool_scale and start instances through the node agents'
services; every decision is a ScalingEvent with its why. The workers' registrations are played by
instance_register (the registry's own service)."""

from datetime import UTC, datetime, timedelta

import pytest
from django.test import override_settings

from controlplane.common.errors import DomainValidationError
from controlplane.telemetry.models import TelemetryRollup
from controlplane.telemetry.services import decode_load_rollup_upsert
from controlplane.topology.models import EngineInstance, InstanceState, Node, Pool, ScalingEvent
from controlplane.topology.services import (
    autoscale_tick,
    instance_register,
    instance_start,
    pool_autoscale_pause,
    pool_scale,
)
from workers.autoscale import PlannerConfig

pytestmark = pytest.mark.django_db

START = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
TICK = timedelta(seconds=15)
# Nominal cost model (no SLUICE_COST_MODEL): one prefill worker computes about 590 uncached tokens/s.
PER_WORKER = 590.0


@pytest.fixture
def cluster(make_pool):
    prefill = make_pool("prefill", kind="prefill", min_instances=1, max_instances=6, target_instances=1)
    decode = make_pool("decode", kind="decode", min_instances=1, max_instances=6, target_instances=1)
    Node.objects.create(cluster=prefill.cluster, hostname="node-a")
    Node.objects.create(cluster=prefill.cluster, hostname="node-b")
    return prefill, decode


def register_starting(now: datetime, **load) -> None:
    """Every starting instance's worker registers (as the registry records it), then reports `load`."""
    for instance in EngineInstance.objects.filter(state=InstanceState.STARTING).select_related("pool"):
        instance_register(
            worker_id=instance.worker_id,
            pool_name=instance.pool.name,
            cluster_name=instance.pool.cluster.name,
            role=instance.pool.kind,
            model=instance.pool.model,
            hostname="whatever-the-host-says",
            request_endpoint=f"ipc:///tmp/{instance.worker_id}.req",
            heartbeat_endpoint=f"ipc:///tmp/{instance.worker_id}.hb",
            now=now,
        )
    if load:
        EngineInstance.objects.filter(state=InstanceState.READY).update(**load)


def prompt_minute(minute: datetime, uncached_tokens_per_s: float) -> None:
    """The minute's prompts as two gateways' rollup rows, each with half of them: the autoscaler must
    read the merged minute."""
    for gateway in ("gateway-a", "gateway-b"):
        TelemetryRollup.objects.update_or_create(
            minute=minute,
            collector=gateway,
            defaults={"prompt_tokens": int(uncached_tokens_per_s * 30) + 300, "cached_tokens": 300},
        )


def test_a_ramp_of_prefill_demand_scales_up_within_the_limits_then_down_after_the_cool_down(cluster):
    prefill, _ = cluster
    targets = []
    now = START
    # given prefill demand of 4 workers' worth for 10 minutes, then none
    # (a tick a minute here: the look-back is whole minutes, and fewer ticks keep the test short)
    for step in range(32):
        now = START + timedelta(minutes=step, seconds=5)
        minute = now.replace(second=0) - timedelta(minutes=1)
        prompt_minute(minute, 4 * PER_WORKER if now < START + timedelta(minutes=10) else 0.0)
        # when the autoscaler ticks and the workers it asked for register
        autoscale_tick(now=now)
        register_starting(now)
        targets.append(Pool.objects.get(pk=prefill.pk).target_instances)

    # then the pool went up to 6 (its max), 4 at most per 300 s window, and back to 1 after the demand went
    assert max(targets) == 6 and targets[-1] == 1
    scaled = list(ScalingEvent.objects.filter(pool=prefill, action="pool_scaled").order_by("created_at", "id"))
    changes = [(e.created_at, e.after["target_instances"] - e.before["target_instances"]) for e in scaled]
    for at, _ in changes:
        window = [change for t, change in changes if at - timedelta(seconds=300) < t <= at]
        assert sum(c for c in window if c > 0) <= 4 and -sum(c for c in window if c < 0) <= 2
    assert all(e.actor_label == "system" and e.reason.startswith("autoscaler: ") for e in scaled)
    first = scaled[0].why
    assert first["rule"] == "scale_up" and first["inputs"]["demands"]["uncached_tokens_per_s"]["mean"] > 0
    # the first scale-up was held at 5 by the window, and the first scale-downs by the quota guard
    # (the look-back's peak would have run the instances left above 0.8): each hold recorded once
    held = [e.why for e in ScalingEvent.objects.filter(pool=prefill, action="autoscale_held").order_by("id")]
    assert [why["rule"] for why in held][:2] == ["rate_limited", "quota_guard"]
    assert held[1]["inputs"]["quota_use_after"] > 0.8
    # and every instance the target asked for was requested of a node agent, spread over both nodes
    requested = ScalingEvent.objects.filter(pool=prefill, action="instance_start_requested")
    assert requested.count() == 6
    assert {e.after["node"] for e in requested} == {"node-a", "node-b"}
    assert Node.objects.filter(hostname="whatever-the-host-says").count() == 0  # kept on the agents' nodes


def test_decode_sizes_on_requests_in_flight_and_kv_in_use(cluster):
    _, decode = cluster
    pool_scale(pool=decode, target_instances=4, actor=None, reason="setup", now=START, manual=False)
    autoscale_tick(now=START)
    register_starting(START)
    assert EngineInstance.objects.filter(pool=decode, state="ready").count() == 4

    # given 4 decode workers of 64 seqs each whose KV is 70% full while few requests run
    later = START + timedelta(seconds=PlannerConfig().scale_down_cooldown_s + 1)
    EngineInstance.objects.filter(pool=decode).update(
        num_running=4, max_num_seqs=64, kv_usage=0.7, kv_capacity_tokens=10_000
    )
    autoscale_tick(now=later)

    # then the requests alone would let it shrink to 1, but its KV holds it (0.7: within the band)
    decode.refresh_from_db()
    assert decode.target_instances == 4

    # when the KV empties, the pool shrinks (2 per window) and drains the least-loaded instances
    EngineInstance.objects.filter(pool=decode).update(kv_usage=0.05)
    autoscale_tick(now=later + TICK)
    decode.refresh_from_db()
    assert decode.target_instances == 2
    assert EngineInstance.objects.filter(pool=decode, state="draining").count() == 2
    scaled = ScalingEvent.objects.filter(pool=decode, action="pool_scaled").latest("id")
    assert scaled.why["rule"] == "scale_down"
    assert scaled.why["inputs"]["demands"]["kv_tokens"]["mean"] == pytest.approx(2_000)
    assert scaled.why["inputs"]["demands"]["requests_in_flight"] == {"mean": 16, "peak": 16, "per_worker": 64}

    # and a burst of requests in flight grows it again at once (no cool-down on the way up)
    EngineInstance.objects.filter(pool=decode, state="ready").update(num_running=60)
    autoscale_tick(now=later + 2 * TICK)
    assert Pool.objects.get(pk=decode.pk).target_instances == 4


def test_a_decode_scale_down_is_held_by_the_quota_guard_until_the_burst_leaves_the_look_back(cluster):
    _, decode = cluster
    pool_scale(pool=decode, target_instances=4, actor=None, reason="setup", now=START, manual=False)
    autoscale_tick(now=START)
    # given 4 decode workers of 64 seqs each, 16 requests in flight now, their KV nearly empty
    register_starting(START, num_running=4, max_num_seqs=64, kv_usage=0.05, kv_capacity_tokens=10_000)
    later = START + timedelta(seconds=PlannerConfig().scale_down_cooldown_s + 1)
    # and, a minute before, a burst of 120 requests in flight at once (the gateways' telemetry)
    burst = later.replace(second=0) - timedelta(minutes=1)
    decode_load_rollup_upsert(pool=decode.name, minute=burst, peak_requests_in_flight=120, peak_kv_tokens=4_000)

    # when the autoscaler ticks
    autoscale_tick(now=later)

    # then 16 in flight would let it shrink to 2, but 120 on 2 workers' 128 seqs would pass 0.8
    assert Pool.objects.get(pk=decode.pk).target_instances == 4
    held = ScalingEvent.objects.get(pool=decode, action="autoscale_held")
    assert held.why["rule"] == "quota_guard" and held.why["wanted"] == 1
    assert held.why["inputs"]["demands"]["requests_in_flight"] == {"mean": 16, "peak": 120, "per_worker": 64}
    assert held.why["inputs"]["quota_use_after"] == pytest.approx(120 / 128)

    # when it ticks again while the burst is within the look-back: still held, recorded once
    autoscale_tick(now=later + timedelta(minutes=4))
    assert Pool.objects.get(pk=decode.pk).target_instances == 4
    assert ScalingEvent.objects.filter(pool=decode, action="autoscale_held").count() == 1

    # and once the look-back has passed the burst, the pool shrinks (2 per window)
    autoscale_tick(now=later + timedelta(minutes=5))
    assert Pool.objects.get(pk=decode.pk).target_instances == 2
    scaled = ScalingEvent.objects.filter(pool=decode, action="pool_scaled").latest("id")
    assert scaled.why["rule"] == "scale_down"
    assert scaled.why["inputs"]["demands"]["requests_in_flight"]["peak"] == 16


def test_a_paused_pool_and_a_manual_scale_are_respected(cluster, make_user):
    prefill, decode = cluster
    operator = make_user("operator")
    for minutes in range(1, 6):  # the whole look-back
        prompt_minute(START - timedelta(minutes=minutes), 4 * PER_WORKER)
    # given the prefill pool paused and the decode pool scaled by hand
    pool_autoscale_pause(pool=prefill, paused=True, actor=operator, reason="load test")
    pool_scale(pool=decode, target_instances=3, actor=operator, reason="by hand", now=START)

    # when the autoscaler ticks with demand for more prefill and no decode load at all
    report = autoscale_tick(now=START + TICK)

    # then neither pool's target moved, and the decisions say why
    assert report.decisions[str(prefill)].rule == "paused"
    assert report.decisions[str(decode)].rule == "manual_hold"
    assert Pool.objects.get(pk=prefill.pk).target_instances == 1
    assert Pool.objects.get(pk=decode.pk).target_instances == 3
    events = ScalingEvent.objects.filter(pool=prefill).values_list("action", "actor_label")
    assert ("autoscale_paused", "operator-user") in list(events)

    # once resumed, the prefill pool follows its demand again
    pool_autoscale_pause(pool=prefill, paused=False, actor=operator)
    autoscale_tick(now=START + 2 * TICK)
    assert Pool.objects.get(pk=prefill.pk).target_instances == 5


@override_settings(SLUICE_INSTANCE_START_TIMEOUT_S=60)
def test_a_start_no_agent_takes_fails_with_the_reason_and_the_node_is_passed_over(cluster):
    prefill, _ = cluster
    instance = instance_start(pool=prefill, node_hostname="node-b", actor=None, now=START)

    # when the timeout passes with no agent having started a process for it
    report = autoscale_tick(now=START + timedelta(seconds=61))

    instance.refresh_from_db()
    assert instance.state == InstanceState.FAILED
    assert report.failed_starts == [instance.worker_id]
    failed = ScalingEvent.objects.get(instance=instance, action="instance_failed")
    assert "nothing consumes queue 'node.node-b'" in failed.reason
    # the replacement went to the other node
    replacement = EngineInstance.objects.get(pool=prefill, state=InstanceState.STARTING)
    assert replacement.node.hostname == "node-a"


def test_bad_starts_are_refused_and_change_nothing(cluster):
    prefill, _ = cluster
    before = (EngineInstance.objects.count(), ScalingEvent.objects.count())

    with pytest.raises(DomainValidationError) as unknown:
        instance_start(pool=prefill, node_hostname="ghost", actor=None)
    Pool.objects.filter(pk=prefill.pk).update(max_instances=1)
    register_starting(START)
    instance_start(pool=prefill, node_hostname="node-a", actor=None)  # the one the max allows
    after_one = (EngineInstance.objects.count(), ScalingEvent.objects.count())
    with pytest.raises(DomainValidationError) as full:
        instance_start(pool=prefill, node_hostname="node-a", actor=None)

    assert unknown.value.fields == {"node": ["no node 'ghost' in cluster 'test'"]}
    assert list(full.value.fields) == ["pool"]
    assert after_one == (before[0] + 1, before[1] + 1)
    assert (EngineInstance.objects.count(), ScalingEvent.objects.count()) == after_one


@override_settings(SLUICE_INSTANCE_START_TIMEOUT_S=60)
def test_a_worker_that_failed_lately_without_an_agent_is_given_time_to_come_back(cluster, make_instance):
    _, decode = cluster
    # given the decode pool's one instance, failed a moment ago (serve's supervisor restarts such a worker)
    instance = make_instance(decode, state=InstanceState.FAILED, last_heartbeat_at=START)
    pool_autoscale_pause(pool=decode, paused=True, actor=None)

    # when the autoscaler ticks within the start timeout, then after it
    soon = autoscale_tick(now=START + timedelta(seconds=30))
    later = autoscale_tick(now=START + timedelta(seconds=61))

    # then nothing replaces it at first; once the timeout passed, a new instance is asked for
    def decode_started(report) -> list[str]:
        return [worker for worker in report.started if worker.startswith("decode-")]

    assert decode_started(soon) == []
    assert len(decode_started(later)) == 1 and decode_started(later) != [instance.worker_id]
