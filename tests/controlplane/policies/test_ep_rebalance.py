from datetime import UTC, datetime, timedelta
from unittest import mock

import pytest

from controlplane.policies import tasks
from controlplane.policies.models import EPLayout, EPRebalancePolicy
from controlplane.policies.selectors import ep_rebalance_due, expert_loads_logical
from controlplane.policies.services import ep_layout_activate, ep_layout_create, ep_rebalance_run
from controlplane.telemetry.models import ExpertLoadRollup
from controlplane.topology.models import ScalingEvent

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
# Two layers of 4 experts on 2 ranks of 3 slots; experts 0 and 3 have two replicas each.
IN_FORCE = [[[0, 1, 0], [2, 3, 3]], [[0, 1, 0], [2, 3, 3]]]
# Expert 2 takes nearly every token: rank 1 carries almost all of them.
HOT_TWO = [10_000, 1_000, 50_000, 2_000]


def physical(placement: list[list[list[int]]], logical: list[int]) -> list[list[int]]:
    """Per-slot token counts that heartbeats would report: each expert's tokens split over its replicas."""
    rows = []
    for ranks in placement:
        held = [expert for rank in ranks for expert in rank]
        rows.append([logical[expert] // held.count(expert) for expert in held])
    return rows


@pytest.fixture
def moe_pool(make_pool, make_instance):
    pool = make_pool("moe", kind="decode", num_experts=4, expert_slots_per_rank=3, max_instances=4)
    make_instance(pool, ep_size=2)
    return pool


@pytest.fixture
def in_force(moe_pool):
    layout = ep_layout_create(pool=moe_pool, num_logical_experts=4, placement=IN_FORCE, actor=None)
    with mock.patch.object(tasks.ep_layout_push_task, "delay"):
        return ep_layout_activate(layout=layout, actor=None)


def record_minutes(pool, layout, logical, minutes=3):
    for minute in range(minutes):
        ExpertLoadRollup.objects.create(
            pool=pool.name,
            layout_version=layout.version,
            minute=NOW - timedelta(minutes=minute + 1),
            slot_loads=physical(layout.placement, logical),
        )


def policy(pool, mode, **fields):
    return EPRebalancePolicy.objects.create(pool=pool, mode=mode, **{"min_window_tokens": 1000, **fields})


def test_slot_loads_map_to_logical_experts_through_the_layout_they_were_counted_under(moe_pool, in_force):
    record_minutes(moe_pool, in_force, HOT_TWO, minutes=2)
    ExpertLoadRollup.objects.create(  # under no known layout: left out
        pool=moe_pool.name, layout_version=99, minute=NOW - timedelta(minutes=1), slot_loads=[[1] * 6] * 2
    )

    loads, minutes = expert_loads_logical(pool=moe_pool, since=NOW - timedelta(minutes=10))

    assert minutes == 2
    assert loads.tolist() == [[2 * load for load in HOT_TWO]] * 2


def test_auto_activates_a_better_layout_and_records_why(moe_pool, in_force, django_capture_on_commit_callbacks):
    # given
    policy(moe_pool, "auto", target_balance=1.05)
    record_minutes(moe_pool, in_force, HOT_TWO)

    # when
    with mock.patch.object(tasks.ep_layout_push_task, "delay") as push:
        with django_capture_on_commit_callbacks(execute=True):
            proposed = ep_rebalance_run(pool=moe_pool, now=NOW)

    # then
    assert proposed.is_active and proposed.version == 2
    assert [layout.version for layout in EPLayout.objects.filter(is_active=True)] == [2]
    event = ScalingEvent.objects.get(action="ep_layout_applied", after__version=2)
    assert event.before["version"] == 1 and event.before["max_over_mean"] > 1.5
    assert event.after["max_over_mean"] < event.before["max_over_mean"]
    assert 0 < event.after["slots_changed"] <= 1
    assert "above the policy's target 1.05" in event.after["why"]["rule"]
    assert event.after["why"]["window"]["minutes"] == 3
    assert "EPLB (auto)" in event.reason and event.actor_label == "system"
    push.assert_called_once_with(proposed.pk)
    # Every layer of the new layout still gives every expert a slot, on the same ranks and slots.
    for ranks in proposed.placement:
        assert len(ranks) == 2 and all(len(rank) == 3 for rank in ranks)
        assert {expert for rank in ranks for expert in rank} == {0, 1, 2, 3}


def test_propose_leaves_the_layout_for_an_admin(moe_pool, in_force):
    policy(moe_pool, "propose", target_balance=1.05)
    record_minutes(moe_pool, in_force, HOT_TWO)

    proposed = ep_rebalance_run(pool=moe_pool, now=NOW)

    assert not proposed.is_active
    assert proposed.rationale["before"]["layout_version"] == 1
    assert EPLayout.objects.get(is_active=True).pk == in_force.pk
    assert ScalingEvent.objects.filter(action="ep_layout_applied").count() == 1  # in_force's own


@pytest.mark.parametrize(
    ("mode", "fields", "logical"),
    [
        ("off", {}, HOT_TWO),
        ("auto", {"target_balance": 3.0}, HOT_TWO),  # balanced enough for this policy
        ("auto", {"min_window_tokens": 10**9}, HOT_TWO),  # too few tokens to go by
        ("auto", {}, [0, 0, 0, 0]),
    ],
    ids=["mode-off", "balanced-enough", "too-few-tokens", "no-tokens"],
)
def test_runs_whose_rule_does_not_fire_change_no_layout(moe_pool, in_force, mode, fields, logical):
    policy(moe_pool, mode, **fields)
    record_minutes(moe_pool, in_force, logical)
    events = ScalingEvent.objects.count()

    assert ep_rebalance_run(pool=moe_pool, now=NOW) is None

    assert list(EPLayout.objects.values_list("version", "is_active")) == [(1, True)]
    assert ScalingEvent.objects.count() == events


def test_loads_that_do_not_fit_the_layout_are_refused_and_nothing_changes(moe_pool, in_force):
    policy(moe_pool, "auto")
    ExpertLoadRollup.objects.create(
        pool=moe_pool.name, layout_version=1, minute=NOW - timedelta(minutes=1), slot_loads=[[5000] * 4] * 2
    )

    assert ep_rebalance_run(pool=moe_pool, now=NOW) is None

    assert EPLayout.objects.count() == 1


def test_a_proposal_that_no_longer_fits_the_pool_is_dropped(moe_pool, in_force):
    policy(moe_pool, "auto", target_balance=1.05)
    record_minutes(moe_pool, in_force, HOT_TWO)
    moe_pool.instances.update(ep_size=1)  # the layout in force has 2 ranks, the pool now 1

    assert ep_rebalance_run(pool=moe_pool, now=NOW) is None

    assert list(EPLayout.objects.values_list("version", "is_active")) == [(1, True)]


def test_without_a_layout_in_force_nothing_is_proposed(moe_pool):
    policy(moe_pool, "auto")

    assert ep_rebalance_run(pool=moe_pool, now=NOW) is None
    assert not EPLayout.objects.exists()


def test_a_pool_is_due_once_its_interval_passed(moe_pool, make_pool):
    rebalanced = policy(moe_pool, "propose", interval_s=600)
    policy(make_pool("off-pool", num_experts=4, expert_slots_per_rank=3), "off")

    assert ep_rebalance_due(now=NOW) == [moe_pool.pk]
    rebalanced.last_run_at = NOW
    rebalanced.save()
    assert ep_rebalance_due(now=NOW + timedelta(seconds=599)) == []
    assert ep_rebalance_due(now=NOW + timedelta(seconds=600)) == [moe_pool.pk]


def test_the_tick_task_runs_every_due_pool(moe_pool, in_force):
    policy(moe_pool, "auto", target_balance=1.05)
    for minute in range(3):
        ExpertLoadRollup.objects.create(
            pool=moe_pool.name,
            layout_version=1,
            minute=datetime.now(UTC) - timedelta(seconds=30 + 60 * minute),
            slot_loads=physical(IN_FORCE, HOT_TWO),
        )

    with mock.patch.object(tasks.ep_layout_push_task, "delay"):
        tasks.ep_rebalance_tick_task()

    assert EPLayout.objects.get(is_active=True).version == 2
    assert EPRebalancePolicy.objects.get(pool=moe_pool).last_run_at is not None
