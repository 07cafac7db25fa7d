"""Policies pushed to workers: KV block TTLs per traffic class (versioned, never edited) and MoE
expert placement per pool (EP layouts, at most one active per pool)."""

from django.conf import settings
from django.db import models

from controlplane.topology.models import Pool

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
    """Which logical experts each rank of a pool holds: placement[rank][slot] = logical expert id."""

    pool = models.ForeignKey(Pool, on_delete=models.PROTECT, related_name="ep_layouts")
    version = models.PositiveIntegerField()
    num_logical_experts = models.PositiveIntegerField()
    placement = models.JSONField()
    is_active = models.BooleanField(default=False)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True)
    created_by_label = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)
    activated_at = models.DateTimeField(null=True, blank=True)

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
