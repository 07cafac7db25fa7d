"""Writes to the topology: pools and their bounds, scaling, instance lifecycle, and the audit trail.

Every state change of a pool or an instance writes its ScalingEvent in the same transaction, and the
control message it implies is queued with transaction.on_commit, so a rolled-back change sends nothing.
One module per domain: events, pools, instances, agents (node agents' starts and exits), autoscale,
data_plane_keys (the CURVE keypair's versions and exports).
"""

from controlplane.topology.services.agents import (
    instance_claim_start,
    instance_record_exit,
    instance_record_start_failure,
    instance_record_started,
    instance_start,
    instances_fail_unstarted,
)
from controlplane.topology.services.autoscale import (
    TickReport,
    autoscale_tick,
    pool_autoscale,
    pool_autoscale_pause,
    pool_reconcile,
)
from controlplane.topology.services.data_plane_keys import (
    data_plane_key_create,
    data_plane_key_ensure,
    data_plane_key_export,
)
from controlplane.topology.services.events import node_queue, queue_node_task, queue_task, scaling_event_record
from controlplane.topology.services.instances import (
    instance_drain,
    instance_mark_drained,
    instance_mark_stopped,
    instance_record_control_failure,
    instance_record_ep_resize,
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
    pool_set_precision,
    pool_update_bounds,
    topology_ensure_local,
)

__all__ = [
    "LOCAL_CLUSTER",
    "TickReport",
    "autoscale_tick",
    "instance_claim_start",
    "instance_record_exit",
    "instance_record_start_failure",
    "instance_record_started",
    "instance_start",
    "instances_fail_unstarted",
    "node_queue",
    "pool_autoscale",
    "pool_autoscale_pause",
    "pool_reconcile",
    "queue_node_task",
    "cluster_create",
    "data_plane_key_create",
    "data_plane_key_ensure",
    "data_plane_key_export",
    "instance_drain",
    "instance_mark_drained",
    "instance_mark_stopped",
    "instance_record_control_failure",
    "instance_record_ep_resize",
    "instance_record_failover",
    "instance_record_heartbeat",
    "instance_register",
    "instance_resume",
    "instance_stop",
    "instances_fail_silent",
    "node_create",
    "pool_create",
    "pool_scale",
    "pool_set_precision",
    "pool_update_bounds",
    "queue_task",
    "scaling_event_record",
    "topology_ensure_local",
]
