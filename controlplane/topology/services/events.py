"""The audit trail: every scaling action's ScalingEvent, and the control messages queued after commit."""

from datetime import datetime
from functools import partial
from typing import Any

from django.db import transaction
from django.utils import timezone

from controlplane.common.actors import actor_label, actor_user
from controlplane.topology.models import (
    EngineInstance,
    Pool,
    ScalingEvent,
)


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
