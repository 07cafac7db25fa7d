"""Instances that node agents start and stop: the request to start one on a node, what the agent
reports (process started, process exited), and starts no agent took up in time."""

from datetime import datetime
from typing import Any
from uuid import uuid4

from django.db import transaction
from django.utils import timezone

from controlplane.common import task_names
from controlplane.common.errors import DomainValidationError
from controlplane.topology import selectors
from controlplane.topology.models import (
    LIVE_STATES,
    EngineInstance,
    InstanceState,
    Node,
    Pool,
    ScalingAction,
)
from controlplane.topology.services.events import node_queue, queue_node_task, scaling_event_record
from controlplane.topology.services.instances import transition_locked
from workers.worker.node_agent import WorkerLaunch


@transaction.atomic
def instance_start(
    *, pool: Pool, node_hostname: str, actor: Any, reason: str = "", now: datetime | None = None
) -> EngineInstance:
    """A new instance of `pool` on the node `node_hostname`, starting: its node's agent starts the worker,
    which becomes ready when it registers under the instance's worker id. Refused (nothing written) for a
    node not in the pool's cluster and for a pool whose serving instances are at its max already."""
    now = now or timezone.now()
    locked = Pool.objects.select_for_update().select_related("cluster").get(pk=pool.pk)
    node = Node.objects.filter(cluster=locked.cluster, hostname=node_hostname).first()
    if node is None:
        raise DomainValidationError(fields={"node": [f"no node {node_hostname!r} in cluster {locked.cluster.name!r}"]})
    serving = selectors.pool_serving_count(pool_id=locked.pk)
    if serving >= locked.max_instances:
        raise DomainValidationError(
            fields={
                "pool": [f"pool {locked.name!r} has {serving} serving instance(s), its max is {locked.max_instances}"]
            }
        )
    # Short: the worker's ipc socket paths are built from it, and those have a ~100-byte limit.
    instance = EngineInstance.objects.create(
        pool=locked,
        node=node,
        worker_id=f"{locked.name}-{uuid4().hex[:10]}",
        request_endpoint="",
        heartbeat_endpoint="",
        state=InstanceState.STARTING,
        registered_at=now,
    )
    scaling_event_record(
        action=ScalingAction.INSTANCE_START_REQUESTED,
        actor=actor,
        reason=reason,
        instance=instance,
        after={"state": InstanceState.STARTING, "node": node.hostname, "worker_id": instance.worker_id},
        now=now,
    )
    queue_node_task(task_names.NODE_START_INSTANCE, node_queue(node.hostname), instance.pk)
    return instance


@transaction.atomic
def instance_claim_start(*, instance_id: int) -> WorkerLaunch | None:
    """What an agent is to start for the instance; None when it is no longer waiting for a process
    (failed for want of an agent, stopped, or started already): a late start task then does nothing."""
    instance = EngineInstance.objects.select_for_update().select_related("pool").filter(pk=instance_id).first()
    if instance is None or instance.state != InstanceState.STARTING or instance.pid is not None:
        return None
    return WorkerLaunch(
        instance_id=instance.pk,
        worker_id=instance.worker_id,
        pool=instance.pool.name,
        role=instance.pool.kind,
        model=instance.pool.model,
        quantization=instance.pool.quantization or None,
        kv_cache_dtype=instance.pool.kv_cache_dtype,
    )


@transaction.atomic
def instance_record_started(
    *, instance_id: int, pid: int, request_endpoint: str, heartbeat_endpoint: str, now: datetime | None = None
) -> EngineInstance:
    instance = EngineInstance.objects.select_for_update().select_related("pool").get(pk=instance_id)
    instance.pid = pid
    fields = ["pid"]
    # The worker may have registered already, with the endpoints as it advertises them.
    if not instance.request_endpoint:
        instance.request_endpoint, instance.heartbeat_endpoint = request_endpoint, heartbeat_endpoint
        fields += ["request_endpoint", "heartbeat_endpoint"]
    instance.save(update_fields=fields)
    scaling_event_record(
        action=ScalingAction.INSTANCE_STARTED,
        actor=None,
        reason=f"node agent on {instance.node.hostname if instance.node else '?'} started the worker process",
        instance=instance,
        after={"pid": pid, "request_endpoint": request_endpoint},
        now=now,
    )
    return instance


@transaction.atomic
def instance_record_start_failure(*, instance_id: int, error: str, now: datetime | None = None) -> None:
    """The agent could not start the process (e.g. no such program): a starting instance fails."""
    _fail_live(EngineInstance.objects.select_for_update().get(pk=instance_id), f"start failed: {error}", now)


@transaction.atomic
def instance_record_exit(*, instance_id: int, exit_code: int, requested: bool, now: datetime | None = None) -> None:
    """The agent saw the instance's process end. Unasked for, a live instance becomes failed."""
    instance = EngineInstance.objects.select_for_update().select_related("pool").filter(pk=instance_id).first()
    if instance is None:
        return
    scaling_event_record(
        action=ScalingAction.INSTANCE_EXITED,
        actor=None,
        reason="worker process exited" + ("" if requested else " unexpectedly"),
        instance=instance,
        after={"exit_code": exit_code, "requested": requested, "state": instance.state},
        now=now,
    )
    if not requested:
        _fail_live(instance, f"worker process exited with code {exit_code}", now)


@transaction.atomic
def instances_fail_unstarted(*, older_than: datetime, now: datetime | None = None) -> list[EngineInstance]:
    """Instances still starting since before `older_than` become failed, saying whether no agent took
    the start (no process: nothing consumes the node's queue) or the worker never registered."""
    stale = (
        EngineInstance.objects.select_for_update(of=("self",))
        .select_related("pool", "node")
        .filter(state=InstanceState.STARTING, registered_at__lt=older_than)
        .order_by("id")
    )
    failed = []
    for instance in stale:
        hostname = instance.node.hostname if instance.node else "?"
        if instance.pid is None:
            reason = f"no node agent took the start: nothing consumes queue {node_queue(hostname)!r}"
        else:
            reason = f"the worker (pid {instance.pid} on {hostname}) did not register"
        _fail_live(instance, f"{reason} since {older_than.isoformat()}", now)
        failed.append(instance)
    return failed


def _fail_live(instance: EngineInstance, reason: str, now: datetime | None) -> None:
    if instance.state not in LIVE_STATES:
        return
    from_state = transition_locked(instance, InstanceState.FAILED)
    scaling_event_record(
        action=ScalingAction.INSTANCE_FAILED,
        actor=None,
        reason=reason,
        instance=instance,
        before={"state": from_state},
        after={"state": InstanceState.FAILED},
        now=now,
    )
