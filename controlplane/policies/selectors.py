import logging
from datetime import datetime, timedelta

import numpy as np
from django.db.models import Max, OuterRef, QuerySet, Subquery
from django.utils import timezone

from controlplane.policies.models import (
    DEFAULT_TRAFFIC_CLASS,
    EPLayout,
    EPRebalanceMode,
    EPRebalancePolicy,
    TrafficClass,
    TTLPolicy,
)
from controlplane.telemetry.selectors import expert_load_rollups
from controlplane.topology.models import Pool

log = logging.getLogger(__name__)


def traffic_class_list() -> QuerySet[TrafficClass]:
    return TrafficClass.objects.order_by("name")


def ttl_policy_list(*, traffic_class_id: int | None = None) -> QuerySet[TTLPolicy]:
    policies = TTLPolicy.objects.select_related("traffic_class")
    return policies if traffic_class_id is None else policies.filter(traffic_class_id=traffic_class_id)


def ttl_policies_latest() -> QuerySet[TTLPolicy]:
    """The newest version of each class's TTL: the ones that apply."""
    newest = TTLPolicy.objects.filter(traffic_class=OuterRef("traffic_class")).order_by("-version").values("version")
    return TTLPolicy.objects.select_related("traffic_class").filter(version=Subquery(newest[:1]))


def ttl_policy_current() -> dict:
    """What workers apply: {"revision", "ttl_s": {class: seconds}, "default_class"}.

    Without "revision" it is what workers.kvstore.ttl.TTLPolicy.from_dict takes. The revision is the
    largest TTLPolicy id: it grows with every new version of any class, so workers can tell which
    of two pushes is newer.
    """
    ttl_s = {policy.traffic_class.name: policy.ttl_seconds for policy in ttl_policies_latest()}
    revision = TTLPolicy.objects.aggregate(revision=Max("id"))["revision"] or 0
    return {"revision": revision, "ttl_s": ttl_s, "default_class": DEFAULT_TRAFFIC_CLASS}


def ep_layout_list(*, pool_id: int | None = None) -> QuerySet[EPLayout]:
    layouts = EPLayout.objects.select_related("pool")
    return layouts if pool_id is None else layouts.filter(pool_id=pool_id)


def ep_layout_active(*, pool_id: int) -> EPLayout | None:
    return EPLayout.objects.filter(pool_id=pool_id, is_active=True).first()


def ep_rebalance_policy_list() -> QuerySet[EPRebalancePolicy]:
    return EPRebalancePolicy.objects.select_related("pool")


def ep_rebalance_due(*, now: datetime | None = None) -> list[int]:
    """Ids of the pools whose EPLB should run now: mode on and the interval passed since its last run."""
    now = now or timezone.now()
    due = []
    for policy in EPRebalancePolicy.objects.exclude(mode=EPRebalanceMode.OFF):
        if policy.last_run_at is None or now >= policy.last_run_at + timedelta(seconds=policy.interval_s):
            due.append(policy.pool_id)
    return due


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
