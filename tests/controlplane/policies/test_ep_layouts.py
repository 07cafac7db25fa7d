from unittest import mock

import pytest
from django.db import IntegrityError, transaction

from controlplane.common.errors import ConflictError, DomainValidationError
from controlplane.policies import tasks
from controlplane.policies.models import EPLayout
from controlplane.policies.services import ep_layout_activate, ep_layout_create
from controlplane.topology.models import ScalingEvent

# Two layers of 4 experts over 2 ranks of 3 slots, placement[layer][rank][slot]: two replicas each.
GOOD = [[[0, 1, 0], [2, 3, 3]], [[3, 2, 1], [0, 0, 1]]]
OTHER = [[[3, 2, 1], [0, 1, 2]], [[0, 1, 2], [3, 3, 3]]]


@pytest.fixture
def moe_pool(make_pool, make_instance):
    pool = make_pool("moe", kind="decode", num_experts=4, expert_slots_per_rank=3, max_instances=4)
    make_instance(pool, ep_size=2)
    return pool


def test_create_gives_the_next_version_inactive(moe_pool):
    first = ep_layout_create(pool=moe_pool, num_logical_experts=4, placement=GOOD, actor=None)
    second = ep_layout_create(pool=moe_pool, num_logical_experts=4, placement=OTHER, actor=None)

    assert (first.version, second.version) == (1, 2)
    assert not first.is_active and not second.is_active


@pytest.mark.parametrize(
    ("num_logical_experts", "placement", "field", "message"),
    [
        (4, [[[0, 1], [2, 2]]], "placement", "layer 0: experts [3] have no slot"),
        (4, [[[0, 1], [2, 3]], [[0, 1], [2, 2]]], "placement", "layer 1: experts [3] have no slot"),
        (4, [[[0], [1]]], "placement", "4 experts do not fit in 2 slots"),
        (4, [[[0, 1, 4], [2, 3, 0]]], "placement", "expert ids [4] are outside 0..3"),
        (4, [[[0, -1], [1, 2]]], "placement", "expert ids [-1] are outside 0..3"),
        (4, [[[0], [1], [2, 3]]], "placement", "every rank must hold the same number of slots"),
        (4, [[[0, 1], [2, 3]], [[0, 1], [2, 3], [0, 1]]], "placement", "every layer must have the same number"),
        (4, [[[0], [1], [2], [3]]], "placement", "4 ranks, but the pool has 2"),
        (4, [[[0, 1, 2, 3], [0, 1, 2, 3]]], "placement", "ranks hold 4 experts, more than the pool's 3 slots per rank"),
        (5, [[[0, 1, 2], [3, 4, 0]]], "num_logical_experts", "must be 4"),
        (4, [], "placement", "non-empty list of layers"),
        (4, [[]], "placement", "non-empty list of layers"),
        (4, [[0, 1], [2, 3]], "placement", "placement[layer][rank][slot]"),
        (4, [[[0, "1"], [2, 3]]], "placement", "non-empty list"),
        (4, "0,1,2,3", "placement", "non-empty list"),
    ],
)
def test_invalid_layouts_are_field_errors_and_change_nothing(moe_pool, num_logical_experts, placement, field, message):
    with pytest.raises(DomainValidationError) as raised:
        ep_layout_create(pool=moe_pool, num_logical_experts=num_logical_experts, placement=placement, actor=None)

    assert list(raised.value.fields) == [field]
    assert any(message in text for text in raised.value.fields[field]), raised.value.fields
    assert not EPLayout.objects.exists()


def test_with_no_live_instance_max_instances_bounds_the_ranks(make_pool):
    pool = make_pool("idle-moe", num_experts=2, expert_slots_per_rank=1, max_instances=2)

    ep_layout_create(pool=pool, num_logical_experts=2, placement=[[[0], [1]]], actor=None)
    with pytest.raises(DomainValidationError, match="3 ranks, but the pool has 2"):
        ep_layout_create(pool=pool, num_logical_experts=2, placement=[[[0], [1], [0]]], actor=None)


def test_activate_replaces_the_active_layout_and_pushes_it(moe_pool, django_capture_on_commit_callbacks):
    # given
    first = ep_layout_create(pool=moe_pool, num_logical_experts=4, placement=GOOD, actor=None)
    second = ep_layout_create(pool=moe_pool, num_logical_experts=4, placement=OTHER, actor=None)
    ep_layout_activate(layout=first, actor=None)

    # when
    with mock.patch.object(tasks.ep_layout_push_task, "delay") as delay:
        with django_capture_on_commit_callbacks(execute=True):
            ep_layout_activate(layout=second, actor=None, reason="rebalance")

    # then
    assert list(EPLayout.objects.filter(is_active=True)) == [second]
    event = ScalingEvent.objects.filter(action="ep_layout_applied").first()
    assert (event.pool, event.before, event.after["version"], event.reason) == (
        moe_pool,
        {"version": 1},
        2,
        "rebalance",
    )
    delay.assert_called_once_with(second.pk)
    with pytest.raises(ConflictError):
        ep_layout_activate(layout=second, actor=None)


def test_activate_checks_again_against_the_current_instances(moe_pool, make_instance):
    layout = ep_layout_create(pool=moe_pool, num_logical_experts=4, placement=GOOD, actor=None)
    moe_pool.instances.update(ep_size=1)

    with pytest.raises(DomainValidationError, match="2 ranks, but the pool has 1"):
        ep_layout_activate(layout=layout, actor=None)

    layout.refresh_from_db()
    assert not layout.is_active
    assert not ScalingEvent.objects.filter(action="ep_layout_applied").exists()


def test_the_database_allows_one_active_layout_per_pool(moe_pool):
    first = ep_layout_create(pool=moe_pool, num_logical_experts=4, placement=GOOD, actor=None)
    second = ep_layout_create(pool=moe_pool, num_logical_experts=4, placement=GOOD, actor=None)
    EPLayout.objects.filter(pk=first.pk).update(is_active=True)

    with pytest.raises(IntegrityError), transaction.atomic():
        EPLayout.objects.filter(pk=second.pk).update(is_active=True)
