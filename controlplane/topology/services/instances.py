"""Engine instances' lifecycle: registration, heartbeats, drain / resume / stop, failure."""

from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from controlplane.common import task_names
from controlplane.common.errors import ConflictError, DomainValidationError
from controlplane.common.validation import full_clean_or_raise
from controlplane.topology import selectors
from controlplane.topology.models import (
    ALLOWED_TRANSITIONS,
    LIVE_STATES,
    EngineInstance,
    InstanceState,
    Node,
    ScalingAction,
    ScalingEvent,
)
from controlplane.topology.services.events import node_queue, queue_node_task, queue_task, scaling_event_record

# Heartbeats arrive every ~100 ms; the database needs the load a few times a minute, not ten times a second.
HEARTBEAT_WRITE_INTERVAL = timedelta(seconds=1)


def transition_locked(instance: EngineInstance, to_state: str, *, extra_fields: tuple[str, ...] = ()) -> str:
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
    *, instance: EngineInstance, to_state: str, action: str, task: str, actor: Any, reason: str, now: datetime | None
) -> EngineInstance:
    locked = _locked_instance(instance.pk)
    from_state = transition_locked(locked, to_state)
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
    *,
    instance: EngineInstance,
    actor: Any,
    reason: str = "",
    grace_s: float | None = None,
    now: datetime | None = None,
) -> EngineInstance:
    """ready → draining: the worker takes nothing new and finishes what it has; a decode worker
    streams for `grace_s` (default: its pool's drain_grace_s), then migrates its unfinished requests
    to other decode workers. Stopped once drained."""
    locked = _locked_instance(instance.pk)
    grace_s = locked.pool.drain_grace_s if grace_s is None else grace_s
    from_state = transition_locked(locked, InstanceState.DRAINING)
    scaling_event_record(
        action=ScalingAction.INSTANCE_DRAIN_REQUESTED,
        actor=actor,
        reason=reason,
        instance=locked,
        before={"state": from_state},
        after={"state": InstanceState.DRAINING, "grace_s": grace_s},
        now=now,
    )
    queue_task(task_names.INSTANCE_DRAIN, locked.pk, grace_s)
    return locked


@transaction.atomic
def instance_stop(
    *, instance: EngineInstance, actor: Any, reason: str = "", now: datetime | None = None
) -> EngineInstance:
    """→ stopped at once (no new requests are routed to it), then the worker is told to shut down."""
    return _request_transition(
        instance=instance,
        to_state=InstanceState.STOPPED,
        action=ScalingAction.INSTANCE_STOP_REQUESTED,
        task=task_names.INSTANCE_STOP,
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
        task=task_names.INSTANCE_RESUME,
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
    transfer_endpoint: str = "",
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
    instance = EngineInstance.objects.select_for_update().filter(worker_id=worker_id).first()
    fields = {}
    # A node agent placed it: it stays on that agent's node (its queue), whatever the host calls itself.
    if instance is None or (instance.pid is None and instance.state != InstanceState.STARTING):
        fields["node"], _ = Node.objects.update_or_create(
            cluster=pool.cluster,
            hostname=hostname,
            defaults={"accelerator_kind": accelerator_kind, "num_accelerators": num_accelerators},
        )
    fields |= {
        "pool": pool,
        "request_endpoint": request_endpoint,
        "heartbeat_endpoint": heartbeat_endpoint,
        "transfer_endpoint": transfer_endpoint,
        "ep_size": ep_size,
        "started_at": started_at,
        "registered_at": now,
        "last_heartbeat_at": now,
        "num_running": 0,
        "num_waiting": 0,
        "kv_usage": 0.0,
    }
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
            transition_locked(instance, InstanceState.READY, extra_fields=tuple(fields))
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
    max_num_seqs: int = 0,
    kv_capacity_tokens: int = 0,
    num_migrated_out: int = 0,
    num_migrations_failed: int = 0,
) -> EngineInstance | None:
    """Updates an instance's load from its heartbeat; None for a worker that has not registered.

    Worker states: "drained" moves a draining instance to stopped (recording the requests it
    migrated, `num_migrated_out` and `num_migrations_failed`); "ready" brings a starting or failed
    instance back to ready. Load alone is written at most once per HEARTBEAT_WRITE_INTERVAL.
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
        "max_num_seqs": max(max_num_seqs, 0),
        "kv_capacity_tokens": max(kv_capacity_tokens, 0),
    }
    comes_back = state == "ready" and instance.state in (InstanceState.STARTING, InstanceState.FAILED)
    if state == "drained" and instance.state == InstanceState.DRAINING:
        EngineInstance.objects.filter(pk=instance.pk).update(**load)
        instance_mark_drained(
            instance_id=instance.pk, now=at, num_migrated=num_migrated_out, num_migrations_failed=num_migrations_failed
        )
    elif comes_back:
        locked = _locked_instance(instance.pk)
        for name, value in load.items():
            setattr(locked, name, value)
        from_state = transition_locked(locked, InstanceState.READY, extra_fields=tuple(load))
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
def instance_mark_drained(
    *, instance_id: int, now: datetime | None = None, num_migrated: int = 0, num_migrations_failed: int = 0
) -> bool:
    """The worker reports it drained: draining → stopped (instance_migrated when it handed requests
    to other workers, with the counts; then instance_drained and instance_stopped).

    Returns False and changes nothing when the instance is no longer draining (already stopped by
    a heartbeat, or resumed meanwhile), so the drain task and heartbeats can both report it.
    """
    instance = _locked_instance(instance_id)
    if instance.state != InstanceState.DRAINING:
        return False
    transition_locked(instance, InstanceState.STOPPED)
    if num_migrated or num_migrations_failed:
        scaling_event_record(
            action=ScalingAction.INSTANCE_MIGRATED,
            actor=None,
            reason=f"the grace period ended: {num_migrated} requests moved to other decode workers",
            instance=instance,
            before={"state": InstanceState.DRAINING},
            after={"num_migrated": num_migrated, "num_migrations_failed": num_migrations_failed},
            now=now,
        )
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
    if instance.pid is not None and instance.node is not None:
        # A node agent started it, so that agent ends the idle process.
        queue_node_task(task_names.NODE_STOP_INSTANCE, node_queue(instance.node.hostname), instance.pk)
    return True


@transaction.atomic
def instance_record_failover(
    *,
    worker_id: str,
    num_resumed: int,
    num_recomputed_tokens: int,
    max_recomputed_tokens: int,
    now: datetime | None = None,
) -> ScalingEvent | None:
    """A decode worker resumed `num_resumed` more requests of failed workers (from their checkpoints
    and the KV store): an instance_failed_over event on it; None for a worker not registered."""
    instance = EngineInstance.objects.select_related("pool").filter(worker_id=worker_id).first()
    if instance is None:
        return None
    return scaling_event_record(
        action=ScalingAction.INSTANCE_FAILED_OVER,
        actor=None,
        reason=f"resumed {num_resumed} requests of failed decode workers",
        instance=instance,
        after={
            "num_resumed": num_resumed,
            "num_recomputed_tokens": num_recomputed_tokens,
            "max_recomputed_tokens": max_recomputed_tokens,
        },
        now=now,
    )


@transaction.atomic
def instance_record_ep_resize(
    *, worker_id: str, ep_size: int, resized_at: float, reason: str, now: datetime | None = None
) -> ScalingEvent | None:
    """An expert-parallel worker re-formed its group with `ep_size` ranks at `resized_at` (its
    time.time()): the instance's new size and an ep_resized event, once per resize (a restarted
    registry hears the same resize again); None for a worker not registered or a resize on record."""
    instance = EngineInstance.objects.select_for_update().filter(worker_id=worker_id).first()
    if (
        instance is None
        or instance.events.filter(action=ScalingAction.EP_RESIZED, after__resized_at=resized_at).exists()
    ):
        return None
    before = {"ep_size": instance.ep_size}
    instance.ep_size = ep_size
    instance.save(update_fields=["ep_size"])
    return scaling_event_record(
        action=ScalingAction.EP_RESIZED,
        actor=None,
        reason=reason or "the EP group re-formed",
        instance=instance,
        pool=instance.pool,
        before=before,
        after={"ep_size": ep_size, "resized_at": resized_at},
        now=now,
    )


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
        from_state = transition_locked(instance, InstanceState.FAILED)
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
