"""Writes to the topology: pools and their bounds, scaling, instance lifecycle, and the audit trail.

Every state change of a pool or an instance writes its ScalingEvent in the same transaction, and the
control message it implies is queued with transaction.on_commit, so a rolled-back change sends nothing.
"""

from datetime import datetime, timedelta
from functools import partial
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from controlplane.common.actors import actor_label, actor_user
from controlplane.common.errors import ConflictError, DomainValidationError
from controlplane.common.validation import full_clean_or_raise
from controlplane.topology import selectors, tasks
from controlplane.topology.models import (
    ALLOWED_TRANSITIONS,
    LIVE_STATES,
    Cluster,
    EngineInstance,
    InstanceState,
    Node,
    Pool,
    ScalingAction,
    ScalingEvent,
)

LOCAL_CLUSTER = "local"
# Heartbeats arrive every ~100 ms; the database needs the load a few times a minute, not ten times a second.
HEARTBEAT_WRITE_INTERVAL = timedelta(seconds=1)


def queue_task(task: Any, *args: Any) -> None:
    """Queues a Celery task once the current transaction commits.

    robust: a broker that is down (or an eager task that fails) is logged instead of failing the
    caller after its change was already committed.
    """
    transaction.on_commit(partial(task.delay, *args), robust=True)


@transaction.atomic
def scaling_event_record(
    *,
    action: str,
    actor: Any,
    reason: str = "",
    pool: Pool | None = None,
    instance: EngineInstance | None = None,
    before: dict | None = None,
    after: dict | None = None,
    now: datetime | None = None,
) -> ScalingEvent:
    return ScalingEvent.objects.create(
        created_at=now or timezone.now(),
        actor=actor_user(actor),
        actor_label=actor_label(actor),
        action=action,
        pool=pool if pool is not None else (instance.pool if instance is not None else None),
        instance=instance,
        reason=reason,
        before=before or {},
        after=after or {},
    )


@transaction.atomic
def cluster_create(*, name: str) -> Cluster:
    cluster = Cluster(name=name)
    full_clean_or_raise(cluster)
    cluster.save()
    return cluster


@transaction.atomic
def node_create(*, cluster: Cluster, hostname: str, accelerator_kind: str = "cpu", num_accelerators: int = 0) -> Node:
    node = Node(
        cluster=cluster, hostname=hostname, accelerator_kind=accelerator_kind, num_accelerators=num_accelerators
    )
    full_clean_or_raise(node)
    node.save()
    return node


@transaction.atomic
def pool_create(
    *,
    cluster: Cluster,
    name: str,
    kind: str,
    model: str,
    min_instances: int = 0,
    max_instances: int = 1,
    target_instances: int | None = None,
    num_experts: int = 0,
    expert_slots_per_rank: int = 0,
    scale_up_max_per_window: int = 4,
    scale_down_max_per_window: int = 2,
    scale_window_s: int = 300,
) -> Pool:
    """A new pool; its target defaults to min_instances (instances are added by scaling it)."""
    pool = Pool(
        cluster=cluster,
        name=name,
        kind=kind,
        model=model,
        min_instances=min_instances,
        max_instances=max_instances,
        target_instances=min_instances if target_instances is None else target_instances,
        num_experts=num_experts,
        expert_slots_per_rank=expert_slots_per_rank,
        scale_up_max_per_window=scale_up_max_per_window,
        scale_down_max_per_window=scale_down_max_per_window,
        scale_window_s=scale_window_s,
    )
    full_clean_or_raise(pool)
    pool.save()
    return pool


@transaction.atomic
def pool_update_bounds(
    *,
    pool: Pool,
    min_instances: int,
    max_instances: int,
    scale_up_max_per_window: int | None = None,
    scale_down_max_per_window: int | None = None,
    scale_window_s: int | None = None,
) -> Pool:
    """New bounds (and rate limits, when given). The current target must fit them: changing the
    target is a scaling action (pool_scale), audited and rate limited, so it is never done here."""
    locked = Pool.objects.select_for_update().get(pk=pool.pk)
    locked.min_instances = min_instances
    locked.max_instances = max_instances
    limits = {
        "scale_up_max_per_window": scale_up_max_per_window,
        "scale_down_max_per_window": scale_down_max_per_window,
        "scale_window_s": scale_window_s,
    }
    for name, value in limits.items():
        if value is not None:
            setattr(locked, name, value)
    if min_instances <= max_instances and not (min_instances <= locked.target_instances <= max_instances):
        raise DomainValidationError(
            fields={
                "target_instances": [
                    f"the current target ({locked.target_instances}) is outside {min_instances}..{max_instances};"
                    " scale the pool first"
                ]
            }
        )
    full_clean_or_raise(locked)
    locked.save()
    return locked


@transaction.atomic
def pool_scale(*, pool: Pool, target_instances: int, actor: Any, reason: str = "", now: datetime | None = None) -> Pool:
    """Sets the pool's desired instance count, within its bounds and its rate limits.

    The rate limit counts the instances added (removed) by pool_scaled events in the last
    scale_window_s, plus this change. Scaling down below the instances that serve or are about to
    (starting, ready) drains the least-loaded ready ones. Setting the current target is a no-op
    and records nothing.
    """
    now = now or timezone.now()
    locked = Pool.objects.select_for_update().get(pk=pool.pk)
    if not locked.min_instances <= target_instances <= locked.max_instances:
        raise DomainValidationError(
            fields={"target_instances": [f"must be within {locked.min_instances}..{locked.max_instances}"]}
        )
    before = locked.target_instances
    change = target_instances - before
    if change == 0:
        return locked
    added, removed = selectors.pool_scaled_in_window(
        pool_id=locked.pk, since=now - timedelta(seconds=locked.scale_window_s)
    )
    if change > 0 and added + change > locked.scale_up_max_per_window:
        raise ConflictError(
            f"scale-up limit: {added} instance(s) added in the last {locked.scale_window_s} s, "
            f"at most {locked.scale_up_max_per_window} per window"
        )
    if change < 0 and removed - change > locked.scale_down_max_per_window:
        raise ConflictError(
            f"scale-down limit: {removed} instance(s) removed in the last {locked.scale_window_s} s, "
            f"at most {locked.scale_down_max_per_window} per window"
        )
    scaling_event_record(
        action=ScalingAction.POOL_SCALED,
        actor=actor,
        reason=reason,
        pool=locked,
        before={"target_instances": before},
        after={"target_instances": target_instances},
        now=now,
    )
    locked.target_instances = target_instances
    locked.save(update_fields=["target_instances", "updated_at"])
    if change < 0:
        _drain_surplus(pool=locked, actor=actor, reason=reason, now=now)
    return locked


def _drain_surplus(*, pool: Pool, actor: Any, reason: str, now: datetime) -> None:
    # Draining instances are already on their way out, so they do not count toward the target.
    serving = pool.instances.filter(state__in=[InstanceState.STARTING, InstanceState.READY]).count()
    surplus = serving - pool.target_instances
    if surplus <= 0:
        return
    # Starting instances cannot be drained; if they make up the surplus, the next scale-down handles them.
    for instance in selectors.instances_least_loaded_ready(pool_id=pool.pk).select_for_update()[:surplus]:
        _transition(instance, InstanceState.DRAINING)
        scaling_event_record(
            action=ScalingAction.INSTANCE_DRAIN_REQUESTED,
            actor=actor,
            reason=reason or "pool scaled down",
            instance=instance,
            before={"state": InstanceState.READY},
            after={"state": InstanceState.DRAINING},
            now=now,
        )
        queue_task(tasks.instance_drain_task, instance.pk)


def _transition(instance: EngineInstance, to_state: str, *, extra_fields: tuple[str, ...] = ()) -> str:
    """Moves a locked instance to `to_state` and saves it; returns the state it left."""
    from_state = instance.state
    if to_state not in ALLOWED_TRANSITIONS[from_state]:
        raise ConflictError(f"instance {instance.worker_id} is {from_state}; it cannot become {to_state}")
    instance.state = to_state
    instance.save(update_fields=["state", *extra_fields])
    return from_state


def _locked_instance(instance_id: int) -> EngineInstance:
    return EngineInstance.objects.select_for_update().select_related("pool").get(pk=instance_id)


def _request_transition(
    *, instance: EngineInstance, to_state: str, action: str, task: Any, actor: Any, reason: str, now: datetime | None
) -> EngineInstance:
    locked = _locked_instance(instance.pk)
    from_state = _transition(locked, to_state)
    scaling_event_record(
        action=action,
        actor=actor,
        reason=reason,
        instance=locked,
        before={"state": from_state},
        after={"state": to_state},
        now=now,
    )
    queue_task(task, locked.pk)
    return locked


@transaction.atomic
def instance_drain(
    *, instance: EngineInstance, actor: Any, reason: str = "", now: datetime | None = None
) -> EngineInstance:
    """ready → draining: the worker finishes what it has and takes nothing new; stopped once drained."""
    return _request_transition(
        instance=instance,
        to_state=InstanceState.DRAINING,
        action=ScalingAction.INSTANCE_DRAIN_REQUESTED,
        task=tasks.instance_drain_task,
        actor=actor,
        reason=reason,
        now=now,
    )


@transaction.atomic
def instance_stop(
    *, instance: EngineInstance, actor: Any, reason: str = "", now: datetime | None = None
) -> EngineInstance:
    """→ stopped at once (no new requests are routed to it), then the worker is told to shut down."""
    return _request_transition(
        instance=instance,
        to_state=InstanceState.STOPPED,
        action=ScalingAction.INSTANCE_STOP_REQUESTED,
        task=tasks.instance_stop_task,
        actor=actor,
        reason=reason,
        now=now,
    )


@transaction.atomic
def instance_resume(
    *, instance: EngineInstance, actor: Any, reason: str = "", now: datetime | None = None
) -> EngineInstance:
    """draining → ready: cancels a drain. Failed and stopped instances come back by registering again."""
    locked = _locked_instance(instance.pk)
    if locked.state != InstanceState.DRAINING:
        raise ConflictError(f"instance {locked.worker_id} is {locked.state}; only a draining instance can resume")
    return _request_transition(
        instance=locked,
        to_state=InstanceState.READY,
        action=ScalingAction.INSTANCE_RESUMED,
        task=tasks.instance_resume_task,
        actor=actor,
        reason=reason,
        now=now,
    )


@transaction.atomic
def instance_register(
    *,
    worker_id: str,
    pool_name: str,
    role: str,
    model: str,
    hostname: str,
    request_endpoint: str,
    heartbeat_endpoint: str,
    ep_size: int = 1,
    num_accelerators: int = 0,
    accelerator_kind: str = "cpu",
    started_at: float = 0.0,
    cluster_name: str | None = None,
    now: datetime | None = None,
) -> EngineInstance:
    """A worker announces itself: a new or returning instance becomes ready in its pool.

    The worker's role must be the pool's kind ("mixed" workers only join "mixed" pools). `model` is
    what the worker reports; it is recorded in the event, not checked against the pool's.
    """
    now = now or timezone.now()
    pools = selectors.pool_by_name(name=pool_name, cluster_name=cluster_name)
    if not pools:
        where = f" in cluster {cluster_name!r}" if cluster_name is not None else ""
        raise DomainValidationError(fields={"pool": [f"no pool named {pool_name!r}{where}"]})
    if len(pools) > 1:
        raise DomainValidationError(fields={"pool": [f"pool name {pool_name!r} is in several clusters; name one"]})
    pool = pools[0]
    if role != pool.kind:
        raise DomainValidationError(
            fields={"role": [f"a {role!r} worker cannot join pool {pool.name!r}, whose kind is {pool.kind!r}"]}
        )
    node, _ = Node.objects.update_or_create(
        cluster=pool.cluster,
        hostname=hostname,
        defaults={"accelerator_kind": accelerator_kind, "num_accelerators": num_accelerators},
    )
    fields = {
        "pool": pool,
        "node": node,
        "request_endpoint": request_endpoint,
        "heartbeat_endpoint": heartbeat_endpoint,
        "ep_size": ep_size,
        "started_at": started_at,
        "registered_at": now,
        "last_heartbeat_at": now,
        "num_running": 0,
        "num_waiting": 0,
        "kv_usage": 0.0,
    }
    instance = EngineInstance.objects.select_for_update().filter(worker_id=worker_id).first()
    if instance is None:
        from_state = None
        instance = EngineInstance(worker_id=worker_id, state=InstanceState.READY, **fields)
        full_clean_or_raise(instance)
        instance.save()
    else:
        from_state = instance.state
        for name, value in fields.items():
            setattr(instance, name, value)
        full_clean_or_raise(instance)
        if from_state == InstanceState.READY:
            instance.save()
        else:
            _transition(instance, InstanceState.READY, extra_fields=tuple(fields))
    scaling_event_record(
        action=ScalingAction.INSTANCE_REGISTERED,
        actor=None,
        reason=f"worker registered (model {model!r}, host {hostname!r})",
        instance=instance,
        before={"state": from_state},
        after={"state": InstanceState.READY, "request_endpoint": request_endpoint},
        now=now,
    )
    return instance


@transaction.atomic
def instance_record_heartbeat(
    *,
    worker_id: str,
    state: str,
    num_running: int,
    num_waiting: int,
    kv_usage: float,
    ttl_policy_version: int,
    ep_layout_version: int,
    at: datetime,
) -> EngineInstance | None:
    """Updates an instance's load from its heartbeat; None for a worker that has not registered.

    Worker states: "drained" moves a draining instance to stopped; "ready" brings a starting or
    failed instance back to ready. Load alone is written at most once per HEARTBEAT_WRITE_INTERVAL.
    """
    instance = EngineInstance.objects.filter(worker_id=worker_id).first()
    if instance is None:
        return None
    load = {
        "num_running": max(num_running, 0),
        "num_waiting": max(num_waiting, 0),
        # Clamped: a worker's float arithmetic may report 1.0000001.
        "kv_usage": min(max(kv_usage, 0.0), 1.0),
        "ttl_policy_version": ttl_policy_version,
        "ep_layout_version": ep_layout_version,
        "last_heartbeat_at": at,
    }
    comes_back = state == "ready" and instance.state in (InstanceState.STARTING, InstanceState.FAILED)
    if state == "drained" and instance.state == InstanceState.DRAINING:
        EngineInstance.objects.filter(pk=instance.pk).update(**load)
        instance_mark_drained(instance_id=instance.pk, now=at)
    elif comes_back:
        locked = _locked_instance(instance.pk)
        for name, value in load.items():
            setattr(locked, name, value)
        from_state = _transition(locked, InstanceState.READY, extra_fields=tuple(load))
        scaling_event_record(
            action=ScalingAction.INSTANCE_READY,
            actor=None,
            reason="heartbeats arrive",
            instance=locked,
            before={"state": from_state},
            after={"state": InstanceState.READY},
            now=at,
        )
    else:
        # Conditional, so a burst of heartbeats (or an old one arriving late) writes the row once.
        EngineInstance.objects.filter(
            Q(last_heartbeat_at__isnull=True) | Q(last_heartbeat_at__lte=at - HEARTBEAT_WRITE_INTERVAL),
            pk=instance.pk,
        ).update(**load)
    instance.refresh_from_db()
    return instance


@transaction.atomic
def instance_mark_drained(*, instance_id: int, now: datetime | None = None) -> bool:
    """The worker reports it drained: draining → stopped (instance_drained, then instance_stopped).

    Returns False and changes nothing when the instance is no longer draining (already stopped by
    a heartbeat, or resumed meanwhile), so the drain task and heartbeats can both report it.
    """
    instance = _locked_instance(instance_id)
    if instance.state != InstanceState.DRAINING:
        return False
    _transition(instance, InstanceState.STOPPED)
    for action in (ScalingAction.INSTANCE_DRAINED, ScalingAction.INSTANCE_STOPPED):
        scaling_event_record(
            action=action,
            actor=None,
            reason="worker drained",
            instance=instance,
            before={"state": InstanceState.DRAINING},
            after={"state": InstanceState.STOPPED},
            now=now,
        )
    return True


@transaction.atomic
def instance_mark_stopped(*, instance_id: int, now: datetime | None = None) -> None:
    """The worker acknowledged its shutdown (the state became stopped when the stop was requested)."""
    instance = _locked_instance(instance_id)
    scaling_event_record(
        action=ScalingAction.INSTANCE_STOPPED,
        actor=None,
        reason="worker acknowledged shutdown",
        instance=instance,
        after={"state": instance.state},
        now=now,
    )


@transaction.atomic
def instance_record_control_failure(
    *, instance_id: int, command: str, error: str, now: datetime | None = None
) -> ScalingEvent:
    """A control message the worker did not acknowledge (or refused); the state is left as it is."""
    instance = EngineInstance.objects.select_related("pool").get(pk=instance_id)
    return scaling_event_record(
        action=ScalingAction.CONTROL_FAILED,
        actor=None,
        reason=error,
        instance=instance,
        after={"command": command, "error": error, "state": instance.state},
        now=now,
    )


@transaction.atomic
def instances_fail_silent(*, older_than: datetime, now: datetime | None = None) -> list[EngineInstance]:
    """Live instances with no heartbeat since `older_than` (registration counts as one) become failed."""
    silent = (
        EngineInstance.objects.select_for_update()
        .select_related("pool")
        .filter(state__in=LIVE_STATES)
        .alias(last_seen=Coalesce("last_heartbeat_at", "registered_at"))
        .filter(last_seen__lt=older_than)
        .order_by("id")
    )
    failed = []
    for instance in silent:
        from_state = _transition(instance, InstanceState.FAILED)
        scaling_event_record(
            action=ScalingAction.INSTANCE_FAILED,
            actor=None,
            reason=f"no heartbeat since {older_than.isoformat()}",
            instance=instance,
            before={"state": from_state, "last_heartbeat_at": _iso(instance.last_heartbeat_at)},
            after={"state": InstanceState.FAILED},
            now=now,
        )
        failed.append(instance)
    return failed


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


@transaction.atomic
def topology_ensure_local(*, hostname: str, model: str, pools: list[tuple[str, str, int]]) -> list[Pool]:
    """Cluster "local", this host's node and the pools (name, kind, instances), for the embedded `serve`.

    A pool gets `model` and a target of the instances `serve` starts; its upper bound grows to fit
    them (serve starts what it was asked to), while bounds an operator set otherwise stay.
    """
    cluster, _ = Cluster.objects.get_or_create(name=LOCAL_CLUSTER)
    Node.objects.get_or_create(cluster=cluster, hostname=hostname)
    result = []
    for name, kind, instances in pools:
        pool, created = Pool.objects.get_or_create(
            cluster=cluster,
            name=name,
            defaults={
                "kind": kind,
                "model": model,
                "min_instances": 0,
                "max_instances": max(instances, 1),
                "target_instances": instances,
            },
        )
        if not created:
            if pool.kind != kind:
                raise DomainValidationError(fields={"pools": [f"pool {name!r} exists with kind {pool.kind!r}"]})
            pool.model = model
            pool.max_instances = max(pool.max_instances, instances)
            pool.min_instances = min(pool.min_instances, instances)
            pool.target_instances = instances
            pool.save(update_fields=["model", "min_instances", "max_instances", "target_instances", "updated_at"])
        result.append(pool)
    return result
