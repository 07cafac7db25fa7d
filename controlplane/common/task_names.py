"""The registered names of the control plane's Celery tasks. Services queue tasks by these names, so
they never import the tasks modules, which call the services; the registry and Celery beat name them
from here too. Below every app, so any app may queue another's task without importing that app. The
names are the tasks modules' own paths, as Celery would derive them: queued messages keep reaching
the same tasks."""

# controlplane.topology.tasks
INSTANCE_DRAIN = "controlplane.topology.tasks.instance_drain_task"
INSTANCE_STOP = "controlplane.topology.tasks.instance_stop_task"
INSTANCE_RESUME = "controlplane.topology.tasks.instance_resume_task"
NODE_START_INSTANCE = "controlplane.topology.tasks.node_start_instance_task"
NODE_STOP_INSTANCE = "controlplane.topology.tasks.node_stop_instance_task"
AUTOSCALE_TICK = "controlplane.topology.tasks.autoscale_tick_task"

# controlplane.policies.tasks
TTL_POLICY_PUSH = "controlplane.policies.tasks.ttl_policy_push_task"
EP_LAYOUT_PUSH = "controlplane.policies.tasks.ep_layout_push_task"
EP_REBALANCE = "controlplane.policies.tasks.ep_rebalance_task"
EP_REBALANCE_TICK = "controlplane.policies.tasks.ep_rebalance_tick_task"
