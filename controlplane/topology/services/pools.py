"""Clusters, nodes and pools: creation, bounds, and scaling within bounds and rate limits."""

from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from controlplane.common import task_names
from controlplane.common.errors import ConflictError, DomainValidationError
from controlplane.common.validation import full_clean_or_raise
from controlplane.topology import selectors
from controlplane.topology.models import (
    Cluster,
    InstanceState,
    Node,
    Pool,
    ScalingAction,
)
from controlplane.topology.services.events import queue_task, scaling_event_record
from controlplane.topology.services.instances import transition_locked

LOCAL_CLUSTER = "local"


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
    quantization: str = "",
    kv_cache_dtype: str = "auto",
) -> Pool:
    """A new pool; its target defaults to min_instances (instances are added by scaling it).
    `quantization` and `kv_cache_dtype` are its workers' precision (Pool says how they apply)."""
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
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
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
def pool_set_precision(*, pool: Pool, quantization: str | None = None, kv_cache_dtype: str | None = None) -> Pool:
    """The precision the pool's workers start with from now on (those given); running workers keep
    theirs until they are replaced."""
    locked = Pool.objects.select_for_update().get(pk=pool.pk)
    if quantization is not None:
        locked.quantization = quantization
    if kv_cache_dtype is not None:
        locked.kv_cache_dtype = kv_cache_dtype
    full_clean_or_raise(locked)
    locked.save(update_fields=["quantization", "kv_cache_dtype", "updated_at"])
    return locked


@transaction.atomic
def pool_scale(
    *,
    pool: Pool,
    target_instances: int,
    actor: Any,
    reason: str = "",
    now: datetime | None = None,
    manual: bool = True,
    why: dict | None = None,
) -> Pool:
    """Sets the pool's desired instance count, within its bounds and its rate limits.

    `manual`: an operator's scale, which the autoscaler then leaves standing for a while; the
    autoscaler passes False and its decision's `why`.

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
        why=why,
        now=now,
    )
    locked.target_instances = target_instances
    fields = ["target_instances", "updated_at"]
    if manual:
        locked.last_manual_scale_at = now
        fields.append("last_manual_scale_at")
    locked.save(update_fields=fields)
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
        transition_locked(instance, InstanceState.DRAINING)
        scaling_event_record(
            action=ScalingAction.INSTANCE_DRAIN_REQUESTED,
            actor=actor,
            reason=reason or "pool scaled down",
            instance=instance,
            before={"state": InstanceState.READY},
            after={"state": InstanceState.DRAINING},
            now=now,
        )
        queue_task(task_names.INSTANCE_DRAIN, instance.pk)


@transaction.atomic
def topology_ensure_local(
    *,
    hostname: str,
    model: str,
    pools: list[tuple[str, str, int]],
    quantization: str = "",
    kv_cache_dtype: str = "auto",
) -> list[Pool]:
    """Cluster "local", this host's node and the pools (name, kind, instances), for the embedded `serve`.

    A pool gets `model`, `serve`'s precision (so the workers its node agent adds match serve's own),
    and a target and lower bound of the instances `serve` starts (the autoscaler keeps at least those);
    its upper bound grows to fit them, and an operator's larger one stays.
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
                "quantization": quantization,
                "kv_cache_dtype": kv_cache_dtype,
                # At least what serve starts, so an idle cluster is not scaled below it.
                "min_instances": instances,
                "max_instances": max(instances, 1),
                "target_instances": instances,
            },
        )
        if not created:
            if pool.kind != kind:
                raise DomainValidationError(fields={"pools": [f"pool {name!r} exists with kind {pool.kind!r}"]})
            pool.model, pool.quantization, pool.kv_cache_dtype = model, quantization, kv_cache_dtype
            pool.max_instances = max(pool.max_instances, instances)
            pool.min_instances = instances
            pool.target_instances = instances
            pool.save(
                update_fields=[
                    "model",
                    "quantization",
                    "kv_cache_dtype",
                    "min_instances",
                    "max_instances",
                    "target_instances",
                    "updated_at",
                ]
            )
        result.append(pool)
    return result
