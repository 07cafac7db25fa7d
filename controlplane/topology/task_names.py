"""The registered names of the topology's Celery tasks (controlplane.topology.tasks). The services queue
tasks by these names, so they never import the tasks, which call the services. The names are the
modules' own paths, as Celery would derive them: queued messages and Celery beat schedules keep
reaching the same tasks."""

INSTANCE_DRAIN = "controlplane.topology.tasks.instance_drain_task"
INSTANCE_STOP = "controlplane.topology.tasks.instance_stop_task"
INSTANCE_RESUME = "controlplane.topology.tasks.instance_resume_task"
NODE_START_INSTANCE = "controlplane.topology.tasks.node_start_instance_task"
NODE_STOP_INSTANCE = "controlplane.topology.tasks.node_stop_instance_task"
AUTOSCALE_TICK = "controlplane.topology.tasks.autoscale_tick_task"
