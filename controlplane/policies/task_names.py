"""The registered names of the policies' Celery tasks (controlplane.policies.tasks). The services queue
tasks by these names, so they never import the tasks, which call the services. The names are the
module's own path, as Celery would derive them: queued messages and Celery beat schedules keep
reaching the same tasks."""

TTL_POLICY_PUSH = "controlplane.policies.tasks.ttl_policy_push_task"
EP_LAYOUT_PUSH = "controlplane.policies.tasks.ep_layout_push_task"
EP_REBALANCE = "controlplane.policies.tasks.ep_rebalance_task"
EP_REBALANCE_TICK = "controlplane.policies.tasks.ep_rebalance_tick_task"
