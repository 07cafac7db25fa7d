"""A node's agent on the control plane's side: what its tasks (and the embedded supervisor) do with a
workers.worker.node_agent.NodeAgent, recording each outcome through the services.

With a broker every host runs `celery -A controlplane worker -Q node.<SLUICE_NODE_NAME> --pool=solo`:
its start/stop tasks (controlplane.topology.tasks) use the process-wide agent built from the SLUICE_NODE_*
settings. The solo pool keeps the worker processes children of that one process, so they die with it.
Without a broker, `serve` builds its own agent for the local node and calls `reconcile_local` on its
supervisor's timer: the same start and stop, found in the database instead of on a queue.
"""

import logging
import shlex
import threading
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from controlplane.common.connections import close_stale_connections
from controlplane.topology import selectors, services
from controlplane.topology.models import EngineInstance, InstanceState
from workers.worker.node_agent import NodeAgent

log = logging.getLogger(__name__)

_agent: NodeAgent | None = None
_agent_lock = threading.Lock()


def node_agent() -> NodeAgent:
    """This process's agent (a `celery worker -Q node.<name>`), made on first use with its reaper."""
    global _agent
    with _agent_lock:
        if _agent is None:
            options = shlex.split(settings.SLUICE_NODE_WORKER_OPTIONS)
            _agent = NodeAgent(
                runtime_dir=Path(settings.SLUICE_NODE_RUNTIME_DIR),
                registry_endpoint=settings.SLUICE_REGISTRY_ENDPOINT,
                worker_options=lambda role: options,
                on_exit=record_exit,
                cwd=Path(settings.BASE_DIR),
                curve_key_file=settings.SLUICE_CURVE_KEY_FILE,
                advertise_host=settings.SLUICE_NODE_ADVERTISE_HOST,
            )
            _agent.start_reaper(threading.Event())
        return _agent


def record_exit(instance_id: int, exit_code: int, requested: bool) -> None:
    close_stale_connections()  # runs on the reaper's thread too
    services.instance_record_exit(instance_id=instance_id, exit_code=exit_code, requested=requested)


def agent_start(agent: NodeAgent, instance_id: int, *, hostname: str | None = None) -> None:
    """Starts the instance's worker if it still waits for one and is placed on this node."""
    hostname = hostname or settings.SLUICE_NODE_NAME
    node = EngineInstance.objects.filter(pk=instance_id).values_list("node__hostname", flat=True).first()
    if node is not None and node != hostname:
        services.instance_record_start_failure(
            instance_id=instance_id, error=f"the agent of node {hostname!r} got a start for node {node!r}"
        )
        return
    launch = services.instance_claim_start(instance_id=instance_id)
    if launch is None:
        log.info("instance %d no longer waits for a process; not starting it", instance_id)
        return
    try:
        started = agent.start(launch)
    except (OSError, ValueError) as error:
        services.instance_record_start_failure(instance_id=instance_id, error=f"{type(error).__name__}: {error}")
        return
    services.instance_record_started(
        instance_id=instance_id,
        pid=started.pid,
        request_endpoint=started.request_endpoint,
        heartbeat_endpoint=started.heartbeat_endpoint,
    )


def agent_stop(agent: NodeAgent, instance_id: int) -> None:
    """Ends the instance's process (shutdown request, then signals); the exit is recorded by on_exit."""
    if agent.stop(instance_id, grace_s=settings.SLUICE_NODE_STOP_GRACE_S) is None:
        services.instance_record_control_failure(
            instance_id=instance_id, command="stop process", error="no process of this instance on this node's agent"
        )


def reconcile_local(agent: NodeAgent, hostname: str) -> None:
    """The embedded default's agent round: reap, start what waits for this node, end the processes of
    instances that stopped, and of failed ones silent for longer than a start may take (a worker that
    missed heartbeats on a loaded host comes back by itself before that)."""
    close_stale_connections()
    agent.reap()
    for instance_id in selectors.instances_to_start(hostname=hostname).values_list("id", flat=True):
        agent_start(agent, instance_id, hostname=hostname)
    held = EngineInstance.objects.filter(pk__in=agent.held_instances())
    given_up = timezone.now() - timedelta(seconds=settings.SLUICE_INSTANCE_START_TIMEOUT_S)
    ended = held.filter(Q(state=InstanceState.STOPPED) | Q(state=InstanceState.FAILED, last_heartbeat_at__lt=given_up))
    for instance_id in ended.values_list("id", flat=True):
        agent.stop(instance_id, grace_s=settings.SLUICE_NODE_STOP_GRACE_S)
