"""Where engine workers run: clusters, nodes, pools of one kind of worker, the instances in them,
the data plane's CURVE keys, and the audit trail of every scaling action."""

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.utils import timezone

from workers.args import KV_CACHE_DTYPES, QUANTIZATIONS


class Cluster(models.Model):
    name = models.SlugField(max_length=100, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.name


class Node(models.Model):
    cluster = models.ForeignKey(Cluster, on_delete=models.CASCADE, related_name="nodes")
    hostname = models.CharField(max_length=255)
    accelerator_kind = models.CharField(max_length=50, default="cpu", help_text='e.g. "cpu", "h200".')
    num_accelerators = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["cluster", "hostname"], name="node_unique_hostname")]

    def __str__(self) -> str:
        return f"{self.hostname} ({self.cluster.name})"


class PoolKind(models.TextChoices):
    # Vision encoders: the SigLIP tower and connector only, balanced by patches in flight.
    ENCODE = "encode", "vision encoder"
    PREFILL = "prefill", "prefill"
    DECODE = "decode", "decode"
    # Prefill and decode in one process: for tests and tiny setups.
    MIXED = "mixed", "mixed (prefill + decode)"


class Pool(models.Model):
    cluster = models.ForeignKey(Cluster, on_delete=models.PROTECT, related_name="pools")
    name = models.SlugField(max_length=100)
    kind = models.CharField(max_length=10, choices=PoolKind.choices)
    model = models.CharField(max_length=200)
    min_instances = models.PositiveIntegerField(default=0)
    max_instances = models.PositiveIntegerField(default=1)
    target_instances = models.PositiveIntegerField(default=1, help_text="Desired number of instances.")
    scale_up_max_per_window = models.PositiveIntegerField(default=4)
    scale_down_max_per_window = models.PositiveIntegerField(default=2)
    scale_window_s = models.PositiveIntegerField(default=300)
    num_experts = models.PositiveIntegerField(default=0, help_text="Routed experts per MoE layer; 0 = dense model.")
    drain_grace_s = models.FloatField(
        default=60.0,
        validators=[MinValueValidator(0.0)],
        help_text="Seconds a draining decode instance keeps streaming before its requests migrate to others.",
    )
    expert_slots_per_rank = models.PositiveIntegerField(default=0)
    # The precision of the pool's workers (workers.args: quantization, kv_cache_dtype): every worker a node
    # agent starts for the pool runs with these, whatever its host's options say. A change applies to
    # workers started after it; each worker reports what it runs in its heartbeats.
    quantization = models.CharField(
        max_length=16,
        blank=True,
        default="",
        choices=[(name, name) for name in QUANTIZATIONS],
        help_text="Quantize the weights at load (fp8: e4m3, one scale per 128x128 block); blank: as stored.",
    )
    kv_cache_dtype = models.CharField(
        max_length=16,
        default="auto",
        choices=[(name, name) for name in KV_CACHE_DTYPES],
        help_text="KV cache storage: auto keeps the model's dtype; fp8 stores e4m3 values with their scales.",
    )
    # The autoscaler leaves a paused pool alone; an operator's scale holds against it for a while
    # (workers.autoscale.PlannerConfig.manual_hold_s) counted from last_manual_scale_at.
    autoscale_paused = models.BooleanField(default=False)
    last_manual_scale_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        permissions = [("scale_pool", "Can scale pools")]
        constraints = [
            models.UniqueConstraint(fields=["cluster", "name"], name="pool_unique_name_per_cluster"),
            models.CheckConstraint(
                condition=models.Q(max_instances__gte=models.F("min_instances")), name="pool_max_ge_min"
            ),
            models.CheckConstraint(
                condition=models.Q(target_instances__gte=models.F("min_instances"))
                & models.Q(target_instances__lte=models.F("max_instances")),
                name="pool_target_within_bounds",
            ),
            models.CheckConstraint(
                condition=models.Q(scale_up_max_per_window__gte=1)
                & models.Q(scale_down_max_per_window__gte=1)
                & models.Q(scale_window_s__gte=1),
                name="pool_scale_limits_positive",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.cluster.name}/{self.name}"

    def clean(self) -> None:
        # Field-level messages for the bounds; the check constraints say the same to the database.
        errors = {}
        if self.max_instances is not None and self.min_instances is not None:
            if self.max_instances < self.min_instances:
                errors["max_instances"] = [f"must be >= min_instances ({self.min_instances})"]
            elif self.target_instances is not None and not (
                self.min_instances <= self.target_instances <= self.max_instances
            ):
                errors["target_instances"] = [f"must be within {self.min_instances}..{self.max_instances}"]
        for name in ["scale_up_max_per_window", "scale_down_max_per_window", "scale_window_s"]:
            if getattr(self, name) is not None and getattr(self, name) < 1:
                errors[name] = ["must be >= 1"]
        if errors:
            raise ValidationError(errors)


class InstanceState(models.TextChoices):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


# The states an instance may move to from each state; services refuse anything else.
ALLOWED_TRANSITIONS: dict[str, frozenset[str]] = {
    InstanceState.STARTING: frozenset({InstanceState.READY, InstanceState.FAILED, InstanceState.STOPPED}),
    InstanceState.READY: frozenset({InstanceState.DRAINING, InstanceState.FAILED, InstanceState.STOPPED}),
    InstanceState.DRAINING: frozenset({InstanceState.READY, InstanceState.STOPPED, InstanceState.FAILED}),
    # Heartbeats came back, or the worker registered again.
    InstanceState.FAILED: frozenset({InstanceState.READY}),
    # Re-registered.
    InstanceState.STOPPED: frozenset({InstanceState.READY}),
}

# Instances that hold (or are about to hold) a process: the ones control messages go to.
LIVE_STATES = (InstanceState.STARTING, InstanceState.READY, InstanceState.DRAINING)


class EngineInstance(models.Model):
    pool = models.ForeignKey(Pool, on_delete=models.PROTECT, related_name="instances")
    node = models.ForeignKey(Node, on_delete=models.SET_NULL, null=True, blank=True, related_name="instances")
    worker_id = models.CharField(max_length=200, unique=True)
    # As other hosts connect to them (a wildcard bind is registered under the worker's advertised host).
    request_endpoint = models.CharField(max_length=500)
    heartbeat_endpoint = models.CharField(max_length=500)
    transfer_endpoint = models.CharField(max_length=500, blank=True, help_text="A decode worker's KV transfer PULL.")
    state = models.CharField(max_length=10, choices=InstanceState.choices, default=InstanceState.STARTING)
    ep_size = models.PositiveIntegerField(default=1, help_text="Ranks (devices) this instance spans.")
    # time.time() on the worker when its process started: a new value means it restarted.
    started_at = models.FloatField(default=0.0)
    registered_at = models.DateTimeField(default=timezone.now)
    last_heartbeat_at = models.DateTimeField(null=True, blank=True)
    num_running = models.PositiveIntegerField(default=0)
    num_waiting = models.PositiveIntegerField(default=0)
    kv_usage = models.FloatField(default=0.0, help_text="Fraction of KV pages in use, 0..1.")
    # The worker's limits, from its heartbeats: what the autoscaler sizes decode pools against.
    max_num_seqs = models.PositiveIntegerField(default=0)
    kv_capacity_tokens = models.PositiveBigIntegerField(default=0)
    # The process id, on its node, of a worker that a node agent started (None: started otherwise).
    pid = models.PositiveIntegerField(null=True, blank=True)
    # What the worker reports it applied.
    ttl_policy_version = models.IntegerField(default=0)
    ep_layout_version = models.IntegerField(default=0)

    class Meta:
        permissions = [
            ("drain_engineinstance", "Can drain engine instances"),
            ("stop_engineinstance", "Can stop engine instances"),
        ]
        constraints = [
            models.CheckConstraint(condition=models.Q(ep_size__gte=1), name="instance_ep_size_positive"),
            models.CheckConstraint(
                condition=models.Q(kv_usage__gte=0.0) & models.Q(kv_usage__lte=1.0), name="instance_kv_usage_fraction"
            ),
        ]

    def __str__(self) -> str:
        return self.worker_id


class DataPlaneKey(models.Model):
    """One version of the cluster's CURVE keypair (workers.curve), which authenticates and encrypts
    every ZMQ socket on the network. The latest version is the one exported to hosts; a process keeps
    the version it loaded at start, and processes on different versions cannot talk, so a rotation
    takes effect as each process restarts with the new key file. A rotation inserts a new version."""

    version = models.PositiveIntegerField(unique=True)
    public_key = models.CharField(max_length=40)  # Z85
    # Secret: it leaves the database only as a key file (export_data_plane_key); no API or admin page
    # shows it.
    secret_key = models.CharField(max_length=40)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-version"]
        default_permissions = ()

    def __str__(self) -> str:
        return f"data-plane key v{self.version} ({self.public_key[:8]}…)"


class ScalingAction(models.TextChoices):
    POOL_SCALED = "pool_scaled"
    INSTANCE_REGISTERED = "instance_registered"
    INSTANCE_READY = "instance_ready"
    INSTANCE_DRAIN_REQUESTED = "instance_drain_requested"
    INSTANCE_DRAINED = "instance_drained"
    INSTANCE_STOP_REQUESTED = "instance_stop_requested"
    INSTANCE_STOPPED = "instance_stopped"
    INSTANCE_FAILED = "instance_failed"
    INSTANCE_RESUMED = "instance_resumed"
    # A drained decode instance handed its unfinished requests to other decode instances.
    INSTANCE_MIGRATED = "instance_migrated"
    # A decode instance resumed requests of a failed one from their checkpoints and the KV store.
    INSTANCE_FAILED_OVER = "instance_failed_over"
    EP_LAYOUT_APPLIED = "ep_layout_applied"
    # An expert-parallel instance lost a rank and re-formed its group from the survivors.
    EP_RESIZED = "ep_resized"
    CONTROL_FAILED = "control_failed"
    # Node agents: an instance asked of a node, its process started, its process gone.
    INSTANCE_START_REQUESTED = "instance_start_requested"
    INSTANCE_STARTED = "instance_started"
    INSTANCE_EXITED = "instance_exited"
    # The autoscaler: a pool it kept as it is although its demand asks for a change (rate limit,
    # quota guard, cool-down...), and operators pausing / resuming it on a pool.
    AUTOSCALE_HELD = "autoscale_held"
    AUTOSCALE_PAUSED = "autoscale_paused"
    AUTOSCALE_RESUMED = "autoscale_resumed"
    # The data plane's CURVE keypair: a new version made, a version written to a host's key file.
    DATA_PLANE_KEY_CREATED = "data_plane_key_created"
    DATA_PLANE_KEY_EXPORTED = "data_plane_key_exported"


class ImmutableRowError(Exception):
    """An attempt to change or delete an audit row."""


class ScalingEventQuerySet(models.QuerySet):
    # QuerySet.update()/delete() never call save()/delete() on the rows, so they are refused here too.
    def update(self, **kwargs):
        raise ImmutableRowError("scaling events are immutable")

    def delete(self):
        raise ImmutableRowError("scaling events are immutable")

    update.queryset_only = True
    delete.queryset_only = True


class ScalingEvent(models.Model):
    """One audited action. Rows are only ever inserted.

    Refused in Python: save() of an existing row, delete(), QuerySet.update()/delete() (also through
    the base manager that related-object access and cascades use). Pools, instances and users with
    events cannot be deleted (PROTECT). Not prevented: raw SQL and QuerySet._update()/_raw_delete()
    (private API); the database has no trigger, so the same goes for anyone with a SQL shell.
    """

    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    # PROTECT: a user who acted cannot be deleted (deactivate them instead); their events keep the link.
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, null=True, blank=True, related_name="+"
    )
    actor_label = models.CharField(max_length=200, help_text='Username, "tenant:<name>" or "system".')
    action = models.CharField(max_length=40, choices=ScalingAction.choices)
    pool = models.ForeignKey(Pool, on_delete=models.PROTECT, null=True, blank=True, related_name="events")
    instance = models.ForeignKey(EngineInstance, on_delete=models.PROTECT, null=True, blank=True, related_name="events")
    reason = models.TextField(blank=True)
    before = models.JSONField(default=dict, blank=True)
    after = models.JSONField(default=dict, blank=True)
    # An autoscaler decision's inputs and the rule that fired ({"rule": ..., "inputs": {...}}).
    why = models.JSONField(default=dict, blank=True)

    objects = ScalingEventQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        base_manager_name = "objects"
        # Only services write events, and no one changes or deletes them.
        default_permissions = ("view",)

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.action} by {self.actor_label}"

    def save(self, *args, **kwargs) -> None:
        if not self._state.adding:
            raise ImmutableRowError("scaling events are immutable")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise ImmutableRowError("scaling events are immutable")
