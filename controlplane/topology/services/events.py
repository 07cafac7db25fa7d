"""The audit trail: every scaling action's ScalingEvent, and the control messages queued after commit."""

from datetime import datetime
from functools import partial
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane.celery import app
from controlplane.common.actors import actor_label, actor_user
from controlplane.topology.models import (
    EngineInstance,
    Pool,
    ScalingEvent,
)


def queue_task(name: str, *args: Any) -> None:
    """Queues the Celery task registered as `name` (a task_names constant) once the current
    transaction commits.

    robust: a broker that is down (or an eager task that fails) is logged instead of failing the
    caller after its change was already committed.
    """
    transaction.on_commit(partial(app.tasks[name].delay, *args), robust=True)


def node_queue(hostname: str) -> str:
    """The Celery queue the agent of a node consumes."""
    return f"node.{hostname}"


def queue_node_task(name: str, queue: str, *args: Any) -> None:
    """Queues a node agent's task (registered as `name`) on its node's queue once the current
    transaction commits; it expires unconsumed after SLUICE_INSTANCE_START_TIMEOUT_S, when the
    instance is failed for want of an agent.

    Without a broker (the embedded default) nothing is queued: an eager task would run in whichever
    process asked (the gateway, the registry), which must not own workers. There the local agent runs
    in `serve`'s supervisor and finds the same work in the database (controlplane.topology.node_agent).
    """
    if app.conf.task_always_eager:
        return
    send = partial(
        app.tasks[name].apply_async, args=args, queue=queue, expires=settings.SLUICE_INSTANCE_START_TIMEOUT_S
    )
    transaction.on_commit(send, robust=True)


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
    why: dict | None = None,
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
        why=why or {},
    )
