from datetime import datetime

from django.db.models import Count, Exists, F, OuterRef, QuerySet, Sum
from django.db.models.functions import Coalesce

from controlplane.topology.models import (
    LIVE_STATES,
    DataPlaneKey,
    EngineInstance,
    InstanceState,
    Pool,
    ScalingAction,
    ScalingEvent,
)


def pool_list(*, kind: str | None = None) -> QuerySet[Pool]:
    """Every pool, or those of one kind (a PoolKind value)."""
    pools = Pool.objects.select_related("cluster").order_by("cluster__name", "name")
    return pools if kind is None else pools.filter(kind=kind)


def pool_scaling_summary() -> list[dict]:
    """Each pool's target, autoscaler pause and instances by state (every state, zeros included)."""
    counts: dict[int, dict[str, int]] = {}
    rows = EngineInstance.objects.values_list("pool_id", "state").annotate(count=Count("id")).order_by()
    for pool_id, state, count in rows:
        counts.setdefault(pool_id, {})[state] = count
    return [
        {
            "pool": str(pool),
            "target_instances": pool.target_instances,
            "autoscale_paused": pool.autoscale_paused,
            "instances": {state: counts.get(pool.pk, {}).get(state, 0) for state in InstanceState.values},
        }
        for pool in pool_list()
    ]


def scaling_event_counts() -> list[dict]:
    """Scaling events ever recorded, by pool and action: [{"pool", "action", "count"}]. An instance's
    event counts under its instance's pool; one of neither under pool "". Events are never deleted,
    so each count only grows (a Prometheus counter)."""
    rows = (
        ScalingEvent.objects.annotate(of_pool=Coalesce("pool_id", "instance__pool_id"))
        .values_list("of_pool", "action")
        .annotate(count=Count("id"))
        .order_by()
    )
    names = {pool.pk: str(pool) for pool in pool_list()}
    return sorted(
        ({"pool": names.get(pool_id, ""), "action": action, "count": count} for pool_id, action, count in rows),
        key=lambda row: (row["pool"], row["action"]),
    )


def pool_by_name(*, name: str, cluster_name: str | None = None) -> list[Pool]:
    """Pools with that name (in that cluster when given): more than one means the name is ambiguous."""
    pools = Pool.objects.select_related("cluster").filter(name=name)
    if cluster_name is not None:
        pools = pools.filter(cluster__name=cluster_name)
    return list(pools[:2])


def instance_list(*, pool_id: int | None = None, state: str | None = None) -> QuerySet[EngineInstance]:
    instances = EngineInstance.objects.select_related("pool", "node").order_by("pool_id", "worker_id")
    if pool_id is not None:
        instances = instances.filter(pool_id=pool_id)
    if state is not None:
        instances = instances.filter(state=state)
    return instances


def instances_live(*, pool_id: int | None = None) -> QuerySet[EngineInstance]:
    """Instances that hold a worker process (starting, ready, draining): where control messages go."""
    instances = EngineInstance.objects.filter(state__in=LIVE_STATES).order_by("id")
    return instances if pool_id is None else instances.filter(pool_id=pool_id)


def pool_serving_count(*, pool_id: int) -> int:
    """Instances that serve or are about to (starting, ready): what a pool's target counts."""
    return EngineInstance.objects.filter(
        pool_id=pool_id, state__in=[InstanceState.STARTING, InstanceState.READY]
    ).count()


def pool_recovering_count(*, pool_id: int, since: datetime) -> int:
    """Failed instances heard from since `since` whose process no agent saw exit: they went silent
    (a loaded host) or a supervisor restarts them, and they come back as ready when they do."""
    exited = ScalingEvent.objects.filter(
        instance_id=OuterRef("pk"), action=ScalingAction.INSTANCE_EXITED, created_at__gte=OuterRef("registered_at")
    )
    return (
        EngineInstance.objects.filter(pool_id=pool_id, state=InstanceState.FAILED, last_heartbeat_at__gte=since)
        .exclude(Exists(exited))
        .count()
    )


def local_workers_registered(*, worker_ids: list[str], since: datetime) -> bool:
    """Whether every one of these workers registered since `since` (and is ready)."""
    ready = EngineInstance.objects.filter(worker_id__in=worker_ids, state=InstanceState.READY, registered_at__gte=since)
    return ready.count() == len(set(worker_ids))


def local_workers_kv_capacity(*, worker_ids: list[str], since: datetime) -> dict[str, int]:
    """Tokens of KV cache of those of these workers that registered since `since`, are ready and have
    reported their capacity in a heartbeat."""
    ready = EngineInstance.objects.filter(
        worker_id__in=worker_ids, state=InstanceState.READY, registered_at__gte=since, kv_capacity_tokens__gt=0
    )
    return dict(ready.values_list("worker_id", "kv_capacity_tokens"))


def instances_least_loaded_ready(*, pool_id: int) -> QuerySet[EngineInstance]:
    """Ready instances, least loaded first: fewest requests, then least KV in use, then newest."""
    return (
        EngineInstance.objects.filter(pool_id=pool_id, state=InstanceState.READY)
        .annotate(load=F("num_running") + F("num_waiting"))
        .order_by("load", "kv_usage", "-registered_at", "-id")
    )


def pool_live_ranks(*, pool_id: int) -> int:
    """Sum of ep_size over the pool's live instances (0 when none is live)."""
    return instances_live(pool_id=pool_id).aggregate(ranks=Sum("ep_size"))["ranks"] or 0


def pool_scaled_in_window(*, pool_id: int, since: datetime) -> tuple[int, int]:
    """(instances added, instances removed) by pool_scaled events since `since`, from their before/after."""
    added = removed = 0
    events = ScalingEvent.objects.filter(pool_id=pool_id, action=ScalingAction.POOL_SCALED, created_at__gte=since)
    for before, after in events.values_list("before", "after"):
        change = after["target_instances"] - before["target_instances"]
        added += max(change, 0)
        removed += max(-change, 0)
    return added, removed


def pool_last_event(*, pool_id: int, actions: list[str]) -> ScalingEvent | None:
    return ScalingEvent.objects.filter(pool_id=pool_id, action__in=actions).order_by("-created_at", "-id").first()


def nodes_without_agent(*, cluster_id: int) -> list[int]:
    """Nodes whose latest instance failed before any agent started its process: nothing serves their
    queue (or could start a worker there). An operator's start on such a node tries it again."""
    latest: dict[int, tuple] = {}
    rows = EngineInstance.objects.filter(node__cluster_id=cluster_id).order_by("-id")
    for node, state, pid, endpoint in rows.values_list("node_id", "state", "pid", "request_endpoint"):
        latest.setdefault(node, (state, pid, endpoint))
    return [
        node
        for node, (state, pid, endpoint) in latest.items()
        if state == InstanceState.FAILED and pid is None and not endpoint
    ]


def instances_to_start(*, hostname: str) -> QuerySet[EngineInstance]:
    """Starting instances placed on the node that no agent has started a process for yet."""
    return EngineInstance.objects.filter(
        node__hostname=hostname, state=InstanceState.STARTING, pid__isnull=True
    ).order_by("id")


def scaling_event_list(
    *,
    pool_id: int | None = None,
    instance_id: int | None = None,
    action: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> QuerySet[ScalingEvent]:
    events = ScalingEvent.objects.select_related("pool", "instance")
    filters = {
        "pool_id": pool_id,
        "instance_id": instance_id,
        "action": action,
        "created_at__gte": since,
        "created_at__lt": until,
    }
    return events.filter(**{name: value for name, value in filters.items() if value is not None})


def data_plane_key_latest() -> DataPlaneKey | None:
    return DataPlaneKey.objects.order_by("-version").first()


def data_plane_key_by_version(version: int) -> DataPlaneKey | None:
    return DataPlaneKey.objects.filter(version=version).first()
