from datetime import timedelta
from unittest import mock

import pytest
from django.utils import timezone

from controlplane.common.errors import ConflictError, DomainValidationError
from controlplane.topology import services, tasks
from controlplane.topology.models import InstanceState, Pool, ScalingAction, ScalingEvent
from controlplane.topology.services import pool_create, pool_scale, pool_update_bounds

NOW = timezone.now().replace(microsecond=0)


def _pool_row(pool: Pool) -> dict:
    return Pool.objects.filter(pk=pool.pk).values().get()


def test_create_rejects_min_above_max_with_field_errors(make_pool):
    # given
    existing = make_pool("prefill", kind="prefill")

    # when / then
    with pytest.raises(DomainValidationError) as raised:
        pool_create(cluster=existing.cluster, name="bad", kind="decode", model="m", min_instances=3, max_instances=2)
    assert "max_instances" in raised.value.fields
    assert not Pool.objects.filter(name="bad").exists()


def test_update_bounds_rejects_min_above_max_and_changes_nothing(make_pool):
    # given
    pool = make_pool(min_instances=1, max_instances=4, target_instances=2)
    before = _pool_row(pool)

    # when / then
    with pytest.raises(DomainValidationError) as raised:
        pool_update_bounds(pool=pool, min_instances=5, max_instances=3)
    assert list(raised.value.fields) == ["max_instances"]
    assert _pool_row(pool) == before


def test_update_bounds_refuses_bounds_that_exclude_the_current_target(make_pool):
    pool = make_pool(min_instances=1, max_instances=4, target_instances=3)

    with pytest.raises(DomainValidationError) as raised:
        pool_update_bounds(pool=pool, min_instances=0, max_instances=2)

    assert list(raised.value.fields) == ["target_instances"]
    assert _pool_row(pool)["max_instances"] == 4


def test_update_bounds_and_rate_limits(make_pool):
    pool = make_pool(min_instances=1, max_instances=4, target_instances=2)

    updated = pool_update_bounds(pool=pool, min_instances=2, max_instances=10, scale_window_s=60)

    assert (updated.min_instances, updated.max_instances, updated.scale_window_s) == (2, 10, 60)
    assert updated.target_instances == 2


@pytest.mark.parametrize("target", [0, 5])
def test_scale_outside_the_bounds_is_a_field_error_and_records_nothing(make_pool, target):
    pool = make_pool(min_instances=1, max_instances=4, target_instances=2)

    with pytest.raises(DomainValidationError) as raised:
        pool_scale(pool=pool, target_instances=target, actor=None, now=NOW)

    assert list(raised.value.fields) == ["target_instances"]
    assert _pool_row(pool)["target_instances"] == 2
    assert not ScalingEvent.objects.exists()


def test_scale_up_within_bounds_records_one_event(make_pool, make_user, django_capture_on_commit_callbacks):
    # given
    pool = make_pool(min_instances=1, max_instances=8, target_instances=1)
    operator = make_user("operator")

    # when
    with django_capture_on_commit_callbacks() as callbacks:
        scaled = pool_scale(pool=pool, target_instances=3, actor=operator, reason="load", now=NOW)

    # then
    assert scaled.target_instances == 3
    event = ScalingEvent.objects.get()
    assert (event.action, event.pool, event.actor, event.actor_label) == (
        "pool_scaled",
        pool,
        operator,
        "operator-user",
    )
    assert (event.before, event.after, event.reason, event.created_at) == (
        {"target_instances": 1},
        {"target_instances": 3},
        "load",
        NOW,
    )
    assert callbacks == []


def test_scaling_to_the_current_target_records_nothing(make_pool):
    pool = make_pool(target_instances=2)

    pool_scale(pool=pool, target_instances=2, actor=None, now=NOW)

    assert not ScalingEvent.objects.exists()


def test_scale_up_rate_limit_counts_the_window(make_pool):
    # given: up to 4 added per 300 s; 3 added 200 s ago, 2 more 700 s ago (outside the window)
    pool = make_pool(min_instances=0, max_instances=20, target_instances=0)
    pool_scale(pool=pool, target_instances=2, actor=None, now=NOW - timedelta(seconds=700))
    pool_scale(pool=pool, target_instances=5, actor=None, now=NOW - timedelta(seconds=200))

    # when / then: 3 + 2 > 4 is refused, 3 + 1 is allowed
    with pytest.raises(ConflictError, match="scale-up limit"):
        pool_scale(pool=pool, target_instances=7, actor=None, now=NOW)
    assert _pool_row(pool)["target_instances"] == 5
    pool_scale(pool=pool, target_instances=6, actor=None, now=NOW)
    assert _pool_row(pool)["target_instances"] == 6

    # when / then: once the earlier scale-up leaves the window, 3 more fit
    pool_scale(pool=pool, target_instances=9, actor=None, now=NOW + timedelta(seconds=101))
    assert ScalingEvent.objects.filter(action=ScalingAction.POOL_SCALED).count() == 4


def test_scale_down_rate_limit(make_pool):
    pool = make_pool(min_instances=0, max_instances=20, target_instances=10)
    pool_scale(pool=pool, target_instances=8, actor=None, now=NOW - timedelta(seconds=10))

    with pytest.raises(ConflictError, match="scale-down limit"):
        pool_scale(pool=pool, target_instances=7, actor=None, now=NOW)

    # Scaling up does not count against the scale-down budget.
    pool_scale(pool=pool, target_instances=9, actor=None, now=NOW)
    assert _pool_row(pool)["target_instances"] == 9


def test_scale_down_drains_the_least_loaded_ready_instances(
    make_pool, make_instance, django_capture_on_commit_callbacks
):
    # given: three ready instances with different loads, one already draining
    pool = make_pool(min_instances=0, max_instances=8, target_instances=3, scale_down_max_per_window=4)
    busy = make_instance(pool, num_running=5)
    idle = make_instance(pool, num_running=0, kv_usage=0.1)
    light = make_instance(pool, num_running=1)
    make_instance(pool, state=InstanceState.DRAINING)

    # when: 3 -> 1 leaves two of the three serving instances surplus
    with mock.patch.object(tasks.instance_drain_task, "delay") as delay:
        with django_capture_on_commit_callbacks(execute=True) as callbacks:
            pool_scale(pool=pool, target_instances=1, actor=None, reason="quiet", now=NOW)

    # then
    states = {instance.pk: instance.state for instance in pool.instances.all()}
    assert states[busy.pk] == InstanceState.READY
    assert states[idle.pk] == states[light.pk] == InstanceState.DRAINING
    drain_events = ScalingEvent.objects.filter(action=ScalingAction.INSTANCE_DRAIN_REQUESTED)
    assert sorted(drain_events.values_list("instance_id", flat=True)) == sorted([idle.pk, light.pk])
    assert ScalingEvent.objects.filter(action=ScalingAction.POOL_SCALED).count() == 1
    assert len(callbacks) == 2
    assert sorted(call.args for call in delay.call_args_list) == sorted([(idle.pk,), (light.pk,)])


def test_no_drain_task_is_queued_before_commit(make_pool, make_instance, django_capture_on_commit_callbacks):
    pool = make_pool(target_instances=1)
    make_instance(pool)

    with mock.patch.object(tasks.instance_drain_task, "delay") as delay:
        with django_capture_on_commit_callbacks(execute=False) as callbacks:
            pool_scale(pool=pool, target_instances=0, actor=None, now=NOW)
        delay.assert_not_called()

    assert len(callbacks) == 1


def test_a_failure_after_the_event_rolls_back_the_event_and_the_scaling(make_pool, make_instance):
    # given
    pool = make_pool(target_instances=1)
    instance = make_instance(pool)
    events_before = ScalingEvent.objects.count()

    # when: marking the surplus draining fails after pool_scaled was written
    with mock.patch.object(services.pools, "_drain_surplus", side_effect=RuntimeError("boom")):
        with pytest.raises(RuntimeError):
            pool_scale(pool=pool, target_instances=0, actor=None, now=NOW)

    # then
    assert ScalingEvent.objects.count() == events_before
    assert _pool_row(pool)["target_instances"] == 1
    instance.refresh_from_db()
    assert instance.state == InstanceState.READY
