"""The control plane's side of worker registration: records what a workers.worker.registry.RegistryServer
hears (registrations, heartbeats, silences) in the topology through the services.

The callbacks run on the registry's serving thread, which keeps its own database connection; each
one drops a connection the database closed meanwhile, so a restarted PostgreSQL costs one callback.
"""

import logging
from datetime import timedelta

from django.db import close_old_connections, connections
from django.utils import timezone

from controlplane.celery import app
from controlplane.common import task_names
from controlplane.common.errors import DomainValidationError
from controlplane.topology import services
from controlplane.topology.models import EngineInstance, InstanceState
from workers.curve import CurveKey
from workers.protocol.messages import WorkerHeartbeat, WorkerRegistration
from workers.worker.registry import RegistryServer

log = logging.getLogger(__name__)


class TopologyRecorder:
    def __init__(self, *, heartbeat_timeout_s: float) -> None:
        self.heartbeat_timeout = timedelta(seconds=heartbeat_timeout_s)
        # Each worker's resumed-request count as last recorded: a rise is a failover to record.
        self.num_resumed: dict[str, int] = {}
        # Each worker's last EP resize recorded (its time.time()): a later one is a resize to record.
        self.ep_resized_at: dict[str, float] = {}

    def on_register(self, registration: WorkerRegistration) -> str | None:
        close_old_connections()
        try:
            instance = services.instance_register(
                worker_id=registration.worker_id,
                pool_name=registration.pool,
                role=registration.role,
                model=registration.model,
                hostname=registration.hostname,
                request_endpoint=registration.request_endpoint,
                heartbeat_endpoint=registration.heartbeat_endpoint,
                transfer_endpoint=registration.transfer_endpoint,
                ep_size=registration.ep_size,
                num_accelerators=registration.num_accelerators,
                accelerator_kind=registration.accelerator_kind,
                started_at=registration.started_at,
            )
        except DomainValidationError as error:
            return error.message
        # A new worker starts with the built-in TTL defaults: give it the policy in force.
        app.tasks[task_names.TTL_POLICY_PUSH].delay(instance.pk)
        return None

    def on_heartbeat(self, heartbeat: WorkerHeartbeat) -> None:
        close_old_connections()
        services.instance_record_heartbeat(
            worker_id=heartbeat.worker_id,
            state=heartbeat.state,
            num_running=heartbeat.num_running,
            num_waiting=heartbeat.num_waiting,
            kv_usage=heartbeat.kv_usage,
            ttl_policy_version=heartbeat.ttl_policy_version,
            ep_layout_version=heartbeat.ep_layout_version,
            at=timezone.now(),
            max_num_seqs=heartbeat.max_num_seqs,
            kv_capacity_tokens=heartbeat.kv_capacity_tokens,
            num_migrated_out=heartbeat.num_migrated_out,
            num_migrations_failed=heartbeat.num_migrations_failed,
        )
        resumed = heartbeat.num_resumed - self.num_resumed.get(heartbeat.worker_id, 0)
        if resumed > 0:
            services.instance_record_failover(
                worker_id=heartbeat.worker_id,
                num_resumed=resumed,
                num_recomputed_tokens=heartbeat.num_recomputed_tokens,
                max_recomputed_tokens=heartbeat.max_recomputed_tokens,
            )
        self.num_resumed[heartbeat.worker_id] = heartbeat.num_resumed
        if heartbeat.ep_resized_at > self.ep_resized_at.get(heartbeat.worker_id, 0.0):
            services.instance_record_ep_resize(
                worker_id=heartbeat.worker_id,
                ep_size=heartbeat.ep_size,
                resized_at=heartbeat.ep_resized_at,
                reason=heartbeat.ep_resize_reason,
            )
            self.ep_resized_at[heartbeat.worker_id] = heartbeat.ep_resized_at

    def on_silence(self, worker_id: str) -> None:
        self.fail_silent()

    def fail_silent(self) -> None:
        """Every live instance silent for longer than the timeout becomes failed, also those this
        registry never heard from (registered before it started)."""
        close_old_connections()
        for instance in services.instances_fail_silent(older_than=timezone.now() - self.heartbeat_timeout):
            log.warning("engine instance %s failed: no heartbeat", instance.worker_id)


def known_registrations() -> list[WorkerRegistration]:
    """Workers registered before this registry started, as they registered (they will not again)."""
    instances = EngineInstance.objects.select_related("pool", "node").exclude(state=InstanceState.STOPPED)
    return [
        WorkerRegistration(
            worker_id=instance.worker_id,
            pool=instance.pool.name,
            role=instance.pool.kind,
            model=instance.pool.model,
            hostname=instance.node.hostname if instance.node else "",
            request_endpoint=instance.request_endpoint,
            heartbeat_endpoint=instance.heartbeat_endpoint,
            transfer_endpoint=instance.transfer_endpoint,
            ep_size=instance.ep_size,
            started_at=instance.started_at,
        )
        for instance in instances
    ]


def topology_registry_server(
    endpoint: str, recorder: TopologyRecorder, *, heartbeat_report_interval_s: float, key: CurveKey | None = None
) -> RegistryServer:
    """A RegistryServer that records into the topology through `recorder`, following at once the
    instances registered before it started, and closing its thread's database connection at the end.
    `key`: the cluster's CURVE key (workers.curve): only workers holding it get through."""
    return RegistryServer(
        endpoint,
        on_register=recorder.on_register,
        on_heartbeat=recorder.on_heartbeat,
        on_silence=recorder.on_silence,
        heartbeat_timeout_s=recorder.heartbeat_timeout.total_seconds(),
        heartbeat_report_interval_s=heartbeat_report_interval_s,
        known=known_registrations(),
        on_exit=connections.close_all,
        key=key,
    )
