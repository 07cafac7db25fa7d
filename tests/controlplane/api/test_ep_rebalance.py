"""The EPLB's proposals through the API: admins set a pool's rebalancing policy and approve a
proposed layout with the activation endpoint; operators and auditors can do neither."""

from datetime import UTC, datetime, timedelta
from unittest import mock

import pytest

from controlplane.policies import tasks
from controlplane.policies.models import EPLayout, EPRebalancePolicy
from controlplane.policies.services import ep_layout_activate, ep_layout_create, ep_rebalance_run
from controlplane.telemetry.models import ExpertLoadRollup
from controlplane.topology.models import ScalingEvent
from tests.controlplane.api.helpers import assert_error

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
IN_FORCE = [[[0, 1, 0], [2, 3, 3]]]
# Tokens per physical slot of IN_FORCE: expert 2 (rank 1) takes nearly all.
SLOT_LOADS = [[5_000, 1_000, 5_000, 50_000, 1_000, 1_000]]


@pytest.fixture
def moe_pool(make_pool):
    """2 ranks while no instance is live (max_instances)."""
    return make_pool("moe", num_experts=4, expert_slots_per_rank=3, max_instances=2)


@pytest.fixture
def proposal(moe_pool):
    layout = ep_layout_create(pool=moe_pool, num_logical_experts=4, placement=IN_FORCE, actor=None)
    with mock.patch.object(tasks.ep_layout_push_task, "delay"):
        ep_layout_activate(layout=layout, actor=None)
    EPRebalancePolicy.objects.create(pool=moe_pool, mode="propose", target_balance=1.05, min_window_tokens=1)
    ExpertLoadRollup.objects.create(
        pool="moe", layout_version=1, minute=NOW - timedelta(minutes=1), slot_loads=SLOT_LOADS
    )
    return ep_rebalance_run(pool=moe_pool, now=NOW)


def test_an_admin_approves_a_proposal_and_the_event_says_why(client_as, proposal, django_capture_on_commit_callbacks):
    listed = client_as("auditor").get(f"/api/v1/ep-layouts/{proposal.pk}/")
    assert listed.status_code == 200 and listed.json()["rationale"]["before"]["layout_version"] == 1

    with mock.patch.object(tasks.ep_layout_push_task, "delay") as push:
        with django_capture_on_commit_callbacks(execute=True):
            approved = client_as("admin").post(f"/api/v1/ep-layouts/{proposal.pk}/activate/", {"reason": "approved"})

    assert approved.status_code == 200, approved.content
    assert approved.json()["is_active"]
    event = ScalingEvent.objects.get(action="ep_layout_applied", after__version=proposal.version)
    assert event.reason == "approved"
    assert event.after["max_over_mean"] < event.before["max_over_mean"]
    assert event.after["why"]["rule"].startswith("max_over_mean")
    push.assert_called_once_with(proposal.pk)


@pytest.mark.parametrize("who", ["operator", "auditor"])
def test_only_admins_approve_proposals(client_as, proposal, who):
    events = ScalingEvent.objects.count()

    assert_error(client_as(who).post(f"/api/v1/ep-layouts/{proposal.pk}/activate/", {}), 403, "permission_denied")

    assert EPLayout.objects.get(is_active=True).version == 1
    assert ScalingEvent.objects.count() == events


def test_admins_set_a_pools_policy_and_others_cannot(client_as, moe_pool):
    body = {"pool": moe_pool.id, "mode": "auto", "interval_s": 300}

    assert_error(client_as("operator").post("/api/v1/ep-rebalance-policies/", body), 403, "permission_denied")
    assert not EPRebalancePolicy.objects.exists()
    admin = client_as("admin")
    created = admin.post("/api/v1/ep-rebalance-policies/", body)
    assert created.status_code == 201, created.content
    edited = admin.patch(f"/api/v1/ep-rebalance-policies/{created.json()['id']}/", {"mode": "propose"})

    assert edited.status_code == 200, edited.content
    policy = EPRebalancePolicy.objects.get()
    assert (policy.mode, policy.interval_s, policy.window_s) == ("propose", 300, 600)
    assert client_as("auditor").get("/api/v1/ep-rebalance-policies/").json()["results"][0]["mode"] == "propose"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"mode": "sometimes"}, "mode"),
        ({"mode": "auto", "target_balance": 0.5}, "target_balance"),
        ({"mode": "auto", "interval_s": 0}, "interval_s"),
    ],
)
def test_a_bad_policy_is_refused_and_nothing_is_written(client_as, moe_pool, body, field):
    error = assert_error(
        client_as("admin").post("/api/v1/ep-rebalance-policies/", {"pool": moe_pool.id, **body}),
        400,
        "validation_error",
    )

    assert field in error["fields"], error
    assert not EPRebalancePolicy.objects.exists()
