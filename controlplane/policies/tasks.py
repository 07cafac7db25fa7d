"""Pushes of the current TTL policy and of an EP layout to every live instance; each failure is
recorded as a control_failed event of that instance. Tasks take ids and hold no rules."""

from controlplane.celery import app
from controlplane.common import task_names
from controlplane.policies import selectors, services
from controlplane.policies.models import EPLayout
from controlplane.topology.models import Pool
from controlplane.topology.selectors import instances_live
from controlplane.topology.services import instance_record_control_failure
from controlplane.topology.tasks import CONTROL_ERRORS, ControlRefusedError, send_checked
from workers.client.control_client import new_command_id
from workers.protocol.messages import ApplyEPLayoutRequest, ControlRequest, SetTTLPolicyRequest


def _push(instances, command: str, make_request) -> None:
    for instance_id, endpoint in instances.values_list("id", "request_endpoint"):
        request: ControlRequest = make_request()
        try:
            send_checked(endpoint, request)
        except (*CONTROL_ERRORS, ControlRefusedError) as error:
            instance_record_control_failure(
                instance_id=instance_id, command=command, error=f"{type(error).__name__}: {error}"
            )


@app.task(name=task_names.TTL_POLICY_PUSH)
def ttl_policy_push_task(instance_id: int | None = None) -> None:
    """To every live instance, or to one (a worker that just registered)."""
    # Read when the task runs, not when it was queued: a late push never sends an older policy.
    policy = selectors.ttl_policy_current()
    revision = policy.pop("revision")
    instances = instances_live()
    _push(
        instances if instance_id is None else instances.filter(pk=instance_id),
        "set_ttl_policy",
        lambda: SetTTLPolicyRequest(command_id=new_command_id(), version=revision, policy=policy),
    )


@app.task(name=task_names.EP_LAYOUT_PUSH)
def ep_layout_push_task(layout_id: int) -> None:
    layout = EPLayout.objects.get(pk=layout_id)
    _push(
        instances_live(pool_id=layout.pool_id),
        "apply_ep_layout",
        lambda: ApplyEPLayoutRequest(
            command_id=new_command_id(),
            version=layout.version,
            num_logical_experts=layout.num_logical_experts,
            placement=layout.placement,
        ),
    )


@app.task(name=task_names.EP_REBALANCE)
def ep_rebalance_task(pool_id: int) -> None:
    services.ep_rebalance_run(pool=Pool.objects.get(pk=pool_id))


@app.task(name=task_names.EP_REBALANCE_TICK)
def ep_rebalance_tick_task() -> None:
    """Runs the EPLB of every pool that is due (the supervisor's timer or Celery beat calls this)."""
    for pool_id in selectors.ep_rebalance_due():
        ep_rebalance_task.delay(pool_id)
