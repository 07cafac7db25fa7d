"""Policies pushed to workers: KV block TTLs per traffic class (versioned, never edited) and MoE
expert placement per pool (EP layouts, at most one active per pool)."""

from django.conf import settings
from django.db import models

from controlplane.topology.models import Pool
from workers.eplb.placement import DEFAULT_TARGET_BALANCE

DEFAULT_TRAFFIC_CLASS = "chat"


class TrafficClass(models.Model):
    name = models.SlugField(max_length=50, unique=True)
    description = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name_plural = "traffic classes"

    def __str__(self) -> str:
        return self.name


class TTLPolicy(models.Model):
    """One version of a class's TTL. An edit is a new row; the newest version of each class applies."""

    traffic_class = models.ForeignKey(TrafficClass, on_delete=models.PROTECT, related_name="ttl_policies")
    version = models.PositiveIntegerField()
    ttl_seconds = models.PositiveIntegerField(help_text="How long a block lives after its last access.")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)
    created_by_label = models.CharField(max_length=200)
    reason = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name = "TTL policy"
        verbose_name_plural = "TTL policies"
        ordering = ["traffic_class__name", "-version"]
        constraints = [
            models.UniqueConstraint(fields=["traffic_class", "version"], name="ttlpolicy_unique_version"),
            models.CheckConstraint(condition=models.Q(ttl_seconds__gt=0), name="ttlpolicy_ttl_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.traffic_class.name} v{self.version}: {self.ttl_seconds} s"


class EPLayout(models.Model):
    """Which logical experts each rank of a pool holds in each MoE layer:
    placement[layer][rank][slot] = logical expert id."""

    pool = models.ForeignKey(Pool, on_delete=models.PROTECT, related_name="ep_layouts")
    version = models.PositiveIntegerField()
    num_logical_experts = models.PositiveIntegerField()
    placement = models.JSONField(help_text="placement[layer][rank][slot] = logical expert id.")
    is_active = models.BooleanField(default=False)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)
    created_by_label = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)
    activated_at = models.DateTimeField(null=True, blank=True)
    # Why this layout, when the EPLB proposed it: the load window, the rule that fired, max/mean
    # before and after, slots changed. Copied into the ep_layout_applied event when it is activated.
    rationale = models.JSONField(default=dict, blank=True)

    class Meta:
        verbose_name = "EP layout"
        ordering = ["pool_id", "-version"]
        permissions = [("apply_eplayout", "Can apply EP layouts")]
        constraints = [
            models.UniqueConstraint(fields=["pool", "version"], name="eplayout_unique_version"),
            models.UniqueConstraint(
                fields=["pool"], condition=models.Q(is_active=True), name="eplayout_one_active_per_pool"
            ),
            models.CheckConstraint(condition=models.Q(num_logical_experts__gte=1), name="eplayout_experts_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.pool} v{self.version}{' (active)' if self.is_active else ''}"


class EPRebalanceMode(models.TextChoices):
    OFF = "off"
    PROPOSE = "propose"  # the EPLB proposes a layout; an admin activates it
    AUTO = "auto"  # the EPLB activates what it proposes


# Placing a layout from a window with fewer tokens than this would follow noise.
DEFAULT_MIN_WINDOW_TOKENS = 10_000


class EPRebalancePolicy(models.Model):
    """When the EPLB re-places a MoE pool's experts: every interval, from the expert loads of the
    last window, when the layout in force is worse balanced than the target."""

    pool = models.OneToOneField(Pool, on_delete=models.CASCADE, related_name="ep_rebalance_policy")
    mode = models.CharField(max_length=10, choices=EPRebalanceMode.choices, default=EPRebalanceMode.OFF)
    interval_s = models.PositiveIntegerField(default=600, help_text="Seconds between two runs of the EPLB.")
    window_s = models.PositiveIntegerField(default=600, help_text="Seconds of expert loads each run places from.")
    target_balance = models.FloatField(
        default=DEFAULT_TARGET_BALANCE,
        help_text="Max/mean GPU load (mean over layers) above which the EPLB proposes a layout.",
    )
    min_window_tokens = models.PositiveBigIntegerField(
        default=DEFAULT_MIN_WINDOW_TOKENS, help_text="Fewer routed tokens in the window: no proposal."
    )
    last_run_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "EP rebalance policy"
        verbose_name_plural = "EP rebalance policies"
        constraints = [
            models.CheckConstraint(condition=models.Q(interval_s__gte=1), name="eprebalance_interval_positive"),
            models.CheckConstraint(condition=models.Q(window_s__gte=1), name="eprebalance_window_positive"),
            models.CheckConstraint(condition=models.Q(target_balance__gte=1.0), name="eprebalance_target_at_least_1"),
        ]

    def __str__(self) -> str:
        return f"{self.pool}: {self.mode} every {self.interval_s} s"
