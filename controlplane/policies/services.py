"""Writes to the policies: TTL versions (never edited) and EP layouts (validated, activated one per pool).

The periodic EPLB run (ep_rebalance_run): a MoE pool's expert loads over its policy's window become a
proposed EP layout, re-placed from the layout in force so that few experts move; activated at once
(mode auto) or left inactive for an admin to activate (mode propose) through ep_layout_activate."""

import logging
from datetime import datetime, timedelta
from typing import Any

import numpy as np
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from controlplane.common import task_names
from controlplane.common.actors import actor_label, actor_user
from controlplane.common.errors import ConflictError, DomainValidationError
from controlplane.common.validation import full_clean_or_raise
from controlplane.policies.models import EPLayout, EPRebalanceMode, EPRebalancePolicy, TrafficClass, TTLPolicy
from controlplane.policies.selectors import ep_layout_active, expert_loads_logical
from controlplane.policies.validation import ep_layout_errors
from controlplane.topology.models import Pool, ScalingAction
from controlplane.topology.selectors import pool_live_ranks
from controlplane.topology.services import queue_task, scaling_event_record
from workers.eplb import PlacementInputError, layer_balance, rebalance_experts, slots_changed

log = logging.getLogger(__name__)

EPLB_ACTOR = None  # proposals and automatic activations are the system's


@transaction.atomic
def traffic_class_create(*, name: str, description: str = "") -> TrafficClass:
    """A new class; blocks of it get the default class's TTL until it has a TTL policy of its own."""
    traffic_class = TrafficClass(name=name, description=description)
    full_clean_or_raise(traffic_class)
    traffic_class.save()
    return traffic_class


@transaction.atomic
def ttl_policy_set(*, traffic_class: TrafficClass, ttl_seconds: int, actor: Any, reason: str = "") -> TTLPolicy:
    """A new version of the class's TTL, pushed to every live instance once committed."""
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or ttl_seconds <= 0:
        raise DomainValidationError(fields={"ttl_seconds": ["must be a positive number of seconds"]})
    # The class row's lock serializes concurrent edits of one class, so versions never collide.
    locked = TrafficClass.objects.select_for_update().get(pk=traffic_class.pk)
    last = locked.ttl_policies.aggregate(last=Max("version"))["last"] or 0
    policy = TTLPolicy.objects.create(
        traffic_class=locked,
        version=last + 1,
        ttl_seconds=ttl_seconds,
        created_by=actor_user(actor),
        created_by_label=actor_label(actor),
        reason=reason,
    )
    queue_task(task_names.TTL_POLICY_PUSH)
    return policy


def ep_layout_max_ranks(*, pool: Pool) -> int:
    """Ranks a layout may use: those of the pool's live instances (sum of their ep_size); when none
    is live, pool.max_instances (one rank per instance), so a layout can be prepared before start."""
    return pool_live_ranks(pool_id=pool.pk) or pool.max_instances


def ep_layout_check(*, pool: Pool, num_logical_experts: Any, placement: Any) -> None:
    """Raises DomainValidationError with field-level messages when the layout does not fit the pool."""
    errors = ep_layout_errors(
        placement=placement,
        num_logical_experts=num_logical_experts,
        pool_num_experts=pool.num_experts,
        expert_slots_per_rank=pool.expert_slots_per_rank,
        max_ranks=ep_layout_max_ranks(pool=pool),
    )
    if errors:
        raise DomainValidationError(fields=errors)


@transaction.atomic
def ep_layout_create(*, pool: Pool, num_logical_experts: int, placement: list[list[int]], actor: Any) -> EPLayout:
    """A validated, inactive layout with the pool's next version number."""
    locked = Pool.objects.select_for_update().get(pk=pool.pk)
    ep_layout_check(pool=locked, num_logical_experts=num_logical_experts, placement=placement)
    last = locked.ep_layouts.aggregate(last=Max("version"))["last"] or 0
    return EPLayout.objects.create(
        pool=locked,
        version=last + 1,
        num_logical_experts=num_logical_experts,
        placement=placement,
        created_by=actor_user(actor),
        created_by_label=actor_label(actor),
    )


@transaction.atomic
def ep_layout_activate(*, layout: EPLayout, actor: Any, reason: str = "", now: datetime | None = None) -> EPLayout:
    """Makes `layout` its pool's active one (checked again: instances may have changed since it was
    created), deactivates the previous one, records ep_layout_applied, and pushes it once committed."""
    now = now or timezone.now()
    pool = Pool.objects.select_for_update().get(pk=layout.pool_id)
    locked = EPLayout.objects.select_for_update().get(pk=layout.pk)
    if locked.is_active:
        raise ConflictError(f"EP layout v{locked.version} of pool {pool.name} is already active")
    ep_layout_check(pool=pool, num_logical_experts=locked.num_logical_experts, placement=locked.placement)
    previous = EPLayout.objects.filter(pool=pool, is_active=True).first()
    if previous is not None:
        # Before activating the new one: the partial unique constraint allows one active row at any time.
        previous.is_active = False
        previous.save(update_fields=["is_active"])
    locked.is_active = True
    locked.activated_at = now
    locked.save(update_fields=["is_active", "activated_at"])
    # An EPLB proposal says why: its load window, the rule that fired, balance and slots changed.
    why = locked.rationale
    scaling_event_record(
        action=ScalingAction.EP_LAYOUT_APPLIED,
        actor=actor,
        reason=reason,
        pool=pool,
        before={"version": None if previous is None else previous.version, **why.get("before", {})},
        after={
            "version": locked.version,
            "layout_id": locked.pk,
            **why.get("after", {}),
            **({"slots_changed": why["slots_changed"], "why": why} if why else {}),
        },
        now=now,
    )
    queue_task(task_names.EP_LAYOUT_PUSH, locked.pk)
    return locked


@transaction.atomic
def ep_rebalance_policy_set(*, pool: Pool, **fields: Any) -> EPRebalancePolicy:
    """Creates or edits the pool's EP rebalancing policy (mode, interval_s, window_s,
    target_balance, min_window_tokens); fields left out keep their value (or default)."""
    policy = EPRebalancePolicy.objects.select_for_update().filter(pool=pool).first() or EPRebalancePolicy(pool=pool)
    for name, value in fields.items():
        setattr(policy, name, value)
    full_clean_or_raise(policy, exclude=["pool"] if policy.pk else None)
    policy.save()
    return policy


@transaction.atomic
def ep_rebalance_run(*, pool: Pool, now: datetime | None = None) -> EPLayout | None:
    """One run of the pool's EPLB: the proposed layout (activated in mode auto), or None when the
    rule did not fire (mode off, no layout in force, too few tokens, balanced enough already)."""
    now = now or timezone.now()
    policy = EPRebalancePolicy.objects.select_for_update().filter(pool=pool).first()
    if policy is None or policy.mode == EPRebalanceMode.OFF:
        return None
    policy.last_run_at = now
    policy.save(update_fields=["last_run_at", "updated_at"])
    current = ep_layout_active(pool_id=pool.pk)
    if current is None:
        return None
    since = now - timedelta(seconds=policy.window_s)
    loads, minutes = expert_loads_logical(pool=pool, since=since)
    if loads is None or loads.sum() < policy.min_window_tokens:
        return None
    previous = np.asarray(current.placement)
    layers, ranks, slots_per_rank = previous.shape
    before = layer_balance(previous, loads)
    if before.mean() <= policy.target_balance:
        return None
    try:
        placement = rebalance_experts(
            loads, previous, gpus=ranks, slots=ranks * slots_per_rank, target_balance=policy.target_balance
        )
    except PlacementInputError as error:
        log.warning("EPLB for pool %s: %s", pool.name, error)
        return None
    after = layer_balance(placement, loads)
    rationale = {
        "rule": f"max_over_mean {before.mean():.4f} above the policy's target {policy.target_balance}",
        "mode": policy.mode,
        "window": {
            "since": since.isoformat(),
            "until": now.isoformat(),
            "minutes": minutes,
            "tokens": int(loads.sum()),
        },
        "before": {"layout_version": current.version, "max_over_mean": _rounded(before.mean())},
        "after": {"max_over_mean": _rounded(after.mean()), "worst_layer": _rounded(after.max())},
        "slots_changed": _rounded(slots_changed(previous, placement)),
    }
    try:
        layout = ep_layout_create(
            pool=pool, num_logical_experts=current.num_logical_experts, placement=placement.tolist(), actor=EPLB_ACTOR
        )
    except DomainValidationError as error:
        # The pool changed under the layout in force (fewer ranks, another model): the operator's move.
        log.warning("EPLB for pool %s: the proposal does not fit the pool: %s", pool.name, error.fields)
        return None
    layout.rationale = rationale
    layout.save(update_fields=["rationale"])
    if policy.mode == EPRebalanceMode.AUTO:
        layout = ep_layout_activate(
            layout=layout, actor=EPLB_ACTOR, reason=f"EPLB (auto): {rationale['rule']}", now=now
        )
    return layout


def _rounded(value: float) -> float:
    return round(float(value), 5)
