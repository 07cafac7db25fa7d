"""Writes to the topology: pools and their bounds, scaling, instance lifecycle, and the audit trail.

Every state change of a pool or an instance writes its ScalingEvent in the same transaction, and the
control message it implies is queued with transaction.on_commit, so a rolled-back change sends nothing.
One module per domain: events, pools, instances.
"""

from controlplane.topology.services.events import queue_task, scaling_event_record
from controlplane.topology.services.instances import (
    instance_drain,
    instance_mark_drained,
    instance_mark_stopped,
    instance_record_control_failure,
    instance_record_failover,
    instance_record_heartbeat,
    instance_register,
    instance_resume,
    instance_stop,
    instances_fail_silent,
)
from controlplane.topology.services.pools import (
    LOCAL_CLUSTER,
    cluster_create,
    node_create,
    pool_create,
    pool_scale,
    pool_update_bounds,
    topology_ensure_local,
)

__all__ = [
    "LOCAL_CLUSTER",
    "cluster_create",
    "instance_drain",
    "instance_mark_drained",
    "instance_mark_stopped",
    "instance_record_control_failure",
    "instance_record_failover",
    "instance_record_heartbeat",
    "instance_register",
    "instance_resume",
    "instance_stop",
    "instances_fail_silent",
    "node_create",
    "pool_create",
    "pool_scale",
    "pool_update_bounds",
    "queue_task",
    "scaling_event_record",
    "topology_ensure_local",
]
