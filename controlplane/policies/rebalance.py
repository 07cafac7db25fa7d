"""The periodic EPLB job: a MoE pool's expert loads over its policy's window become a proposed EP
layout, re-placed from the layout in force so that few experts move; activated at once (mode auto)
or left inactive for an admin to activate (mode propose) through ep_layout_activate."""

import logging
from datetime import datetime, timedelta

import numpy as np
from django.db import transaction
from django.utils import timezone

from controlplane.common.errors import DomainValidationError
from controlplane.policies.models import EPLayout, EPRebalanceMode, EPRebalancePolicy
from controlplane.policies.selectors import ep_layout_active
from controlplane.policies.services import ep_layout_activate, ep_layout_create
from controlplane.telemetry.selectors import expert_load_rollups
from controlplane.topology.models import Pool
from workers.eplb import PlacementInputError, layer_balance, rebalance_experts, slots_changed

log = logging.getLogger(__name__)

EPLB_ACTOR = None  # proposals and automatic activations are the system's


def expert_loads_logical(*, pool: Pool, since: datetime) -> tuple[np.ndarray | None, int]:
    """Tokens per logical expert [layer][expert] routed in the pool since `since`, and how many
    minutes went into it. Each minute's physical slot loads map to experts through the layout
    version they were counted under; minutes under no layout, or a layout of another shape, are left
    out (their slots cannot be attributed)."""
    layouts = {layout.version: layout for layout in EPLayout.objects.filter(pool=pool)}
    total, minutes = None, 0
    for rollup in expert_load_rollups(pool=pool.name, since=since):
        layout = layouts.get(rollup.layout_version)
        if layout is None:
            continue
        placement = np.asarray(layout.placement)
        loads = np.asarray(rollup.slot_loads)
        layers = placement.shape[0]
        if placement.ndim != 3 or loads.shape != (layers, placement[0].size):
            log.warning("expert loads of %s under layout v%d do not fit it", pool.name, layout.version)
            continue
        logical = np.zeros((layers, layout.num_logical_experts), dtype=np.int64)
        np.add.at(logical, (np.arange(layers)[:, None], placement.reshape(layers, -1)), loads)
        if total is not None and total.shape != logical.shape:
            log.warning("expert loads of %s under layout v%d have another shape", pool.name, layout.version)
            continue
        total = logical if total is None else total + logical
        minutes += 1
    return total, minutes


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


def ep_rebalance_due(*, now: datetime | None = None) -> list[int]:
    """Ids of the pools whose EPLB should run now: mode on and the interval passed since its last run."""
    now = now or timezone.now()
    due = []
    for policy in EPRebalancePolicy.objects.exclude(mode=EPRebalanceMode.OFF):
        if policy.last_run_at is None or now >= policy.last_run_at + timedelta(seconds=policy.interval_s):
            due.append(policy.pool_id)
    return due


def _rounded(value: float) -> float:
    return round(float(value), 5)
