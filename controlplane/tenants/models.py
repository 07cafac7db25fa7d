"""Who may call the API: tenants and their API keys (only a hash of each key is stored)."""

import secrets

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

# The namespace of every tenant that opts into a shared prefix cache.
SHARED_CACHE_NAMESPACE = "shared"
# A tenant's share of the queues against another's is the ratio of their weights; beyond a thousand
# to one the lighter tenant would only ever get the crumbs.
MAX_FAIR_SHARE_WEIGHT = 1000


def new_cache_namespace() -> str:
    return secrets.token_hex(16)


class Tenant(models.Model):
    name = models.CharField(max_length=100, unique=True)
    # A tenant's own namespace is part of every KV block hash it produces, so no tenant can hit
    # (or time) another tenant's cached prefixes. Unique so two tenants never collide by accident.
    cache_namespace = models.CharField(max_length=64, unique=True, default=new_cache_namespace)
    share_prefix_cache = models.BooleanField(
        default=False, help_text=f"Use the common '{SHARED_CACHE_NAMESPACE}' namespace instead of its own."
    )
    rate_limit_rpm = models.PositiveIntegerField(default=600, help_text="Requests per minute.")
    token_quota_per_day = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Prompt plus completion tokens per UTC day; empty = unlimited."
    )
    # Admission caps: past either one a request is refused with 429. Empty: the gateway's defaults
    # (SLUICE_TENANT_MAX_REQUESTS_IN_FLIGHT, SLUICE_TENANT_MAX_QUEUED_PROMPT_TOKENS). Queued prompt
    # tokens are those of admitted requests still waiting for their first output token; a request
    # that finds none of its tenant's queued is admitted whatever its length.
    max_requests_in_flight = models.PositiveIntegerField(
        null=True, blank=True, help_text="API calls at once, until each response ends; empty = the gateway's default."
    )
    max_queued_prompt_tokens = models.PositiveIntegerField(
        null=True, blank=True, help_text="Prompt tokens awaiting their first output; empty = the gateway's default."
    )
    # The share of the gateway's and the engines' queues while tenants compete is the ratio of
    # their weights.
    fair_share_weight = models.PositiveIntegerField(
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_FAIR_SHARE_WEIGHT)],
        help_text=f"Share of the queues against other tenants' weights (1 to {MAX_FAIR_SHARE_WEIGHT}).",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=~models.Q(cache_namespace=SHARED_CACHE_NAMESPACE), name="tenant_private_cache_namespace"
            ),
            models.CheckConstraint(condition=models.Q(rate_limit_rpm__gte=1), name="tenant_rate_limit_positive"),
            models.CheckConstraint(
                condition=models.Q(max_requests_in_flight__isnull=True) | models.Q(max_requests_in_flight__gte=1),
                name="tenant_max_requests_in_flight_positive",
            ),
            models.CheckConstraint(
                condition=models.Q(max_queued_prompt_tokens__isnull=True) | models.Q(max_queued_prompt_tokens__gte=1),
                name="tenant_max_queued_prompt_tokens_positive",
            ),
            models.CheckConstraint(
                condition=models.Q(fair_share_weight__gte=1, fair_share_weight__lte=MAX_FAIR_SHARE_WEIGHT),
                name="tenant_fair_share_weight_range",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def prefix_cache_namespace(self) -> str:
        """The namespace its requests are cached under."""
        return SHARED_CACHE_NAMESPACE if self.share_prefix_cache else self.cache_namespace


class ApiKey(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, blank=True, help_text="A label people give the key.")
    # The key's first characters: shown to people to tell keys apart, and narrows the lookup.
    prefix = models.CharField(max_length=12, db_index=True)
    key_hash = models.CharField(max_length=64, unique=True)  # SHA-256 hex of the whole key
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.tenant.name})"


class TenantUsage(models.Model):
    """What a tenant used in one UTC day; one row per (tenant, day), incremented in place."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="usage")
    day = models.DateField()
    requests = models.PositiveBigIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0, help_text="Prompt tokens served from the KV cache.")
    completion_tokens = models.PositiveBigIntegerField(default=0)

    class Meta:
        verbose_name_plural = "tenant usage"
        ordering = ["-day", "tenant_id"]
        constraints = [models.UniqueConstraint(fields=["tenant", "day"], name="tenantusage_unique_day")]

    def __str__(self) -> str:
        return f"{self.tenant.name} {self.day}"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
