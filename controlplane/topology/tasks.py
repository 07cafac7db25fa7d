"""Control messages to one engine instance (drain, stop, resume), sent over ZMQ; outcomes are
recorded through the services. Tasks take ids and hold no rules."""

from django.conf import settings

from controlplane.celery import app
from controlplane.common import task_names
from controlplane.common.data_plane import data_plane_key
from controlplane.topology import node_agent, services
from controlplane.topology.models import EngineInstance
from workers.client.control_client import (
    ControlRejectedError,
    ControlTimeoutError,
    new_command_id,
    send_control,
    wait_for_state,
)
from workers.curve import CurveError
from workers.protocol.messages import ControlAck, ControlRequest, DrainRequest, ResumeRequest, ShutdownRequest

# CurveError: this process has no key (or a bad one) for a worker on the network.
CONTROL_ERRORS = (ControlTimeoutError, ControlRejectedError, CurveError)


class ControlRefusedError(Exception):
    """The worker understood the command and answered ok=False."""


def send_checked(endpoint: str, request: ControlRequest) -> ControlAck:
    ack = send_control(endpoint, request, key=data_plane_key())
    if not ack.ok:
        raise ControlRefusedError(f"worker {ack.worker_id} refused {type(request).__name__}: {ack.message}")
    return ack


def _record_failure(instance_id: int, command: str, error: Exception) -> None:
    services.instance_record_control_failure(
        instance_id=instance_id, command=command, error=f"{type(error).__name__}: {error}"
    )


@app.task(name=task_names.INSTANCE_DRAIN)
def instance_drain_task(instance_id: int, grace_s: float | None = None) -> None:
    endpoint = EngineInstance.objects.values_list("request_endpoint", flat=True).get(pk=instance_id)
    try:
        ack = send_checked(endpoint, DrainRequest(command_id=new_command_id(), grace_s=grace_s))
        if ack.state != "drained":
            if app.conf.task_always_eager:
                # Eager tasks (the embedded default) run inside the API request that asked for the
                # drain, which must not wait for streams to finish: the registry records "drained"
                # from the worker's heartbeats instead.
                return
            wait_for_state(endpoint, "drained", timeout_s=settings.SLUICE_DRAIN_TIMEOUT_S, key=data_plane_key())
    except (*CONTROL_ERRORS, ControlRefusedError) as error:
        _record_failure(instance_id, "drain", error)
        return
    services.instance_mark_drained(instance_id=instance_id)


@app.task(name=task_names.INSTANCE_STOP)
def instance_stop_task(instance_id: int) -> None:
    endpoint = EngineInstance.objects.values_list("request_endpoint", flat=True).get(pk=instance_id)
    try:
        send_checked(endpoint, ShutdownRequest(command_id=new_command_id()))
    except (*CONTROL_ERRORS, ControlRefusedError) as error:
        _record_failure(instance_id, "shutdown", error)
        return
    services.instance_mark_stopped(instance_id=instance_id)


@app.task(name=task_names.INSTANCE_RESUME)
def instance_resume_task(instance_id: int) -> None:
    endpoint = EngineInstance.objects.values_list("request_endpoint", flat=True).get(pk=instance_id)
    try:
        send_checked(endpoint, ResumeRequest(command_id=new_command_id()))
    except (*CONTROL_ERRORS, ControlRefusedError) as error:
        _record_failure(instance_id, "resume", error)


@app.task(name=task_names.NODE_START_INSTANCE)
def node_start_instance_task(instance_id: int) -> None:
    """On a node's queue (node.<name>): start the instance's worker process here."""
    node_agent.agent_start(node_agent.node_agent(), instance_id)


@app.task(name=task_names.NODE_STOP_INSTANCE)
def node_stop_instance_task(instance_id: int) -> None:
    """On a node's queue: end the instance's (drained or stopped) worker process here."""
    node_agent.agent_stop(node_agent.node_agent(), instance_id)


@app.task(name=task_names.AUTOSCALE_TICK)
def autoscale_tick_task() -> None:
    """Celery beat's autoscaler tick (the embedded default runs it from serve's supervisor)."""
    services.autoscale_tick()
