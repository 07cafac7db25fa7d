"""The autoscaler applied: each tick plans every pool (workers.autoscale) from the registry's and the
telemetry's figures, scales it through pool_scale, starts the instances a target lacks through the node
agents, and fails starts that no agent took up. Operators pause and resume it per pool."""

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from controlplane.common.errors import ConflictError
from controlplane.telemetry.selectors import decode_load_peak, encode_load, rollup_token_totals
from controlplane.topology import selectors
from controlplane.topology.models import InstanceState, Node, Pool, PoolKind, ScalingAction
from controlplane.topology.services.agents import instance_start, instances_fail_unstarted
from controlplane.topology.services.events import scaling_event_record
from controlplane.topology.services.pools import pool_scale
from workers.autoscale import (
    Decision,
    PlannerConfig,
    PoolInputs,
    Rule,
    WorkerLoad,
    decode_demands,
    encode_demands,
    plan,
    prefill_demands,
    prefill_tokens_per_s,
)
from workers.client.routing.router import CHUNK_LIMIT, STEP_BUDGET_S, cost_model_from_environment

# Held decisions worth an event: the demand asks for a change that a limit refused.
HELD_RULES = frozenset({Rule.RATE_LIMITED, Rule.QUOTA_GUARD, Rule.COOLDOWN})
AUTOSCALE_ACTIONS = [ScalingAction.POOL_SCALED, ScalingAction.AUTOSCALE_HELD]
PREFILL_KINDS = (PoolKind.PREFILL, PoolKind.MIXED)
DECODE_KINDS = (PoolKind.DECODE, PoolKind.MIXED)


@dataclass(frozen=True, slots=True)
class TickReport:
    decisions: dict[str, Decision]  # by pool name
    started: list[str]  # worker ids asked of node agents
    failed_starts: list[str]


def autoscale_tick(*, now: datetime | None = None, config: PlannerConfig = PlannerConfig()) -> TickReport:
    """One round over every pool: fail stale starts, plan and scale, start what each target lacks."""
    now = now or timezone.now()
    failed = instances_fail_unstarted(
        older_than=now - timedelta(seconds=settings.SLUICE_INSTANCE_START_TIMEOUT_S), now=now
    )
    rates = uncached_tokens_per_s(now=now)
    per_worker = prefill_tokens_per_s(cost_model_from_environment(), budget_s=STEP_BUDGET_S, limit=CHUNK_LIMIT)
    prefill_pools = Pool.objects.filter(kind__in=PREFILL_KINDS).count() or 1
    decisions, started = {}, []
    for pool in Pool.objects.select_related("cluster").order_by("id"):
        # The gateway's telemetry is not per pool: prefill pools share its demand evenly.
        shares = [rate / prefill_pools for rate in rates]
        decisions[str(pool)] = pool_autoscale(
            pool=pool, now=now, config=config, prefill_rates=shares, prefill_per_worker=per_worker
        )
        started += [instance.worker_id for instance in pool_reconcile(pool=pool, now=now)]
    return TickReport(decisions=decisions, started=started, failed_starts=[i.worker_id for i in failed])


@transaction.atomic
def pool_autoscale(
    *,
    pool: Pool,
    now: datetime,
    config: PlannerConfig,
    prefill_rates: list[float],
    prefill_per_worker: float,
) -> Decision:
    """Plans one pool and applies the decision: a pool_scaled event (with its why) when the target
    changes, an autoscale_held event when a limit held a wanted change (once per rule in a row)."""
    locked = Pool.objects.select_for_update().get(pk=pool.pk)
    inputs = pool_inputs(
        pool=locked, now=now, config=config, prefill_rates=prefill_rates, prefill_per_worker=prefill_per_worker
    )
    decision = plan(inputs, config)
    if decision.changes:
        try:
            pool_scale(
                pool=locked,
                target_instances=decision.target_instances,
                actor=None,
                reason=f"autoscaler: {decision.rule}",
                now=now,
                manual=False,
                why=decision.why(),
            )
        except ConflictError:  # an operator's scale landed between planning and now: next tick
            pass
    elif decision.rule in HELD_RULES:
        last = selectors.pool_last_event(pool_id=locked.pk, actions=AUTOSCALE_ACTIONS)
        if last is None or last.why.get("rule") != decision.rule:
            scaling_event_record(
                action=ScalingAction.AUTOSCALE_HELD,
                actor=None,
                reason=f"autoscaler: {decision.rule} (wanted {decision.wanted})",
                pool=locked,
                after={"target_instances": locked.target_instances},
                why=decision.why(),
                now=now,
            )
    return decision


def pool_inputs(
    *, pool: Pool, now: datetime, config: PlannerConfig, prefill_rates: list[float], prefill_per_worker: float
) -> PoolInputs:
    window_start = now - timedelta(seconds=pool.scale_window_s)
    added, removed = selectors.pool_scaled_in_window(pool_id=pool.pk, since=window_start)
    last_change = selectors.pool_last_event(pool_id=pool.pk, actions=[ScalingAction.POOL_SCALED])
    live = list(selectors.instances_live(pool_id=pool.pk))
    demands = {}
    if pool.kind in PREFILL_KINDS:
        demands |= prefill_demands(uncached_tokens_per_s=prefill_rates, tokens_per_s_per_worker=prefill_per_worker)
    if pool.kind in DECODE_KINDS:
        loads = [
            WorkerLoad(i.num_running, i.num_waiting, i.kv_usage, i.max_num_seqs, i.kv_capacity_tokens)
            for i in live
            if i.state != InstanceState.STARTING
        ]
        demands |= decode_demands(loads, config, **decode_peaks(pool=pool, now=now))
    if pool.kind == PoolKind.ENCODE:
        load = encode_load(pool=pool.name, **_lookback(now))
        demands |= encode_demands(
            patches_per_s=load.patches_per_s, patches_per_s_per_encoder=load.patches_per_s_per_encoder
        )
    return PoolInputs(
        kind=pool.kind,
        min_instances=pool.min_instances,
        max_instances=pool.max_instances,
        target_instances=pool.target_instances,
        live_instances=len(live),
        scale_up_max_per_window=pool.scale_up_max_per_window,
        scale_down_max_per_window=pool.scale_down_max_per_window,
        added_in_window=added,
        removed_in_window=removed,
        paused=pool.autoscale_paused,
        seconds_since_manual_scale=_seconds_since(pool.last_manual_scale_at, now),
        seconds_since_last_change=_seconds_since(last_change.created_at if last_change else None, now),
        demands=demands,
    )


def decode_peaks(*, pool: Pool, now: datetime) -> dict[str, int]:
    """The most requests in flight and KV tokens in use the pool's decode workers held at once in each
    whole minute of the look-back (the gateways' telemetry), as decode_demands' keyword arguments."""
    peak = decode_load_peak(pool=pool.name, **_lookback(now))
    if peak is None:
        return {}
    return {"peak_requests_in_flight": peak.requests_in_flight, "peak_kv_tokens": peak.kv_tokens}


def _lookback(now: datetime) -> dict[str, datetime]:
    """The look-back's whole minutes before `now`'s, as a selector's `since` and `until`."""
    end = now.replace(second=0, microsecond=0)
    return {"since": end - timedelta(minutes=settings.SLUICE_AUTOSCALE_LOOKBACK_MINUTES), "until": end}


def uncached_tokens_per_s(*, now: datetime) -> list[float]:
    """Uncached prompt tokens per second of each whole minute of the look-back, oldest first (a minute
    without a rollup counts as none: no gateway served anything)."""
    minutes = settings.SLUICE_AUTOSCALE_LOOKBACK_MINUTES
    end = now.replace(second=0, microsecond=0)
    start = end - timedelta(minutes=minutes)
    uncached = {
        minute: max(prompt - cached, 0)
        for minute, (prompt, cached) in rollup_token_totals(since=start, until=end).items()
    }
    return [uncached.get(start + timedelta(minutes=i), 0) / 60.0 for i in range(minutes)]


@transaction.atomic
def pool_reconcile(*, pool: Pool, now: datetime | None = None) -> list:
    """Starts as many instances as the pool's target lacks, each on the cluster's node with the fewest
    live instances, nodes without an agent passed over. Paused pools too: pausing stops the autoscaler
    from moving the target, not the pool from following it. A worker that failed lately without an
    agent (one `serve`'s supervisor restarts) counts as coming back until the start timeout passes."""
    now = now or timezone.now()
    locked = Pool.objects.select_for_update().get(pk=pool.pk)
    recovering_since = now - timedelta(seconds=settings.SLUICE_INSTANCE_START_TIMEOUT_S)
    missing = (
        locked.target_instances
        - selectors.pool_serving_count(pool_id=locked.pk)
        - selectors.pool_recovering_count(pool_id=locked.pk, since=recovering_since)
    )
    started = []
    for _ in range(max(missing, 0)):
        node = _placement(locked)
        if node is None:
            break
        started.append(
            instance_start(pool=locked, node_hostname=node.hostname, actor=None, reason="pool below target", now=now)
        )
    return started


def _placement(pool: Pool) -> Node | None:
    return (
        Node.objects.filter(cluster_id=pool.cluster_id)
        .annotate(live=Count("instances", filter=Q(instances__state__in=[InstanceState.STARTING, InstanceState.READY])))
        .exclude(pk__in=selectors.nodes_without_agent(cluster_id=pool.cluster_id))
        .order_by("live", "hostname")
        .first()
    )


@transaction.atomic
def pool_autoscale_pause(*, pool: Pool, paused: bool, actor: Any, reason: str = "") -> Pool:
    """Pauses (or resumes) the autoscaler on one pool; audited. Setting the current state is a no-op."""
    locked = Pool.objects.select_for_update().get(pk=pool.pk)
    if locked.autoscale_paused == paused:
        return locked
    scaling_event_record(
        action=ScalingAction.AUTOSCALE_PAUSED if paused else ScalingAction.AUTOSCALE_RESUMED,
        actor=actor,
        reason=reason,
        pool=locked,
        before={"autoscale_paused": locked.autoscale_paused},
        after={"autoscale_paused": paused},
    )
    locked.autoscale_paused = paused
    locked.save(update_fields=["autoscale_paused", "updated_at"])
    return locked


def _seconds_since(moment: datetime | None, now: datetime) -> float | None:
    return None if moment is None else (now - moment).total_seconds()
