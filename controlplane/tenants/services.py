import hashlib
import hmac
import secrets
from datetime import date, timedelta

from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from controlplane.common.errors import DomainValidationError
from controlplane.common.validation import full_clean_or_raise
from controlplane.tenants.models import ApiKey, Tenant, TenantUsage
from controlplane.tenants.selectors import api_key_active_candidates, utc_today

KEY_PREFIX = "sk-sluice-"
LOOKUP_PREFIX_LENGTH = 12
# Recording every use would turn each API call into a row write; a minute is precise enough.
LAST_USED_RESOLUTION = timedelta(minutes=1)


def _key_hash(raw_key: str) -> str:
    return hashlib.sha256(raw_key.encode()).hexdigest()


@transaction.atomic
def tenant_get_or_create(*, name: str) -> Tenant:
    tenant, _ = Tenant.objects.get_or_create(name=name)
    return tenant


@transaction.atomic
def tenant_create(
    *,
    name: str,
    rate_limit_rpm: int = 600,
    token_quota_per_day: int | None = None,
    share_prefix_cache: bool = False,
    max_requests_in_flight: int | None = None,
    max_queued_prompt_tokens: int | None = None,
    fair_share_weight: int = 1,
) -> Tenant:
    tenant = Tenant(
        name=name,
        rate_limit_rpm=rate_limit_rpm,
        token_quota_per_day=token_quota_per_day,
        share_prefix_cache=share_prefix_cache,
        max_requests_in_flight=max_requests_in_flight,
        max_queued_prompt_tokens=max_queued_prompt_tokens,
        fair_share_weight=fair_share_weight,
    )
    full_clean_or_raise(tenant)
    tenant.save()
    return tenant


# The fields tenant_update may change; the cache namespace never changes (it is part of every block hash).
TENANT_UPDATABLE_FIELDS = frozenset(
    {
        "name",
        "rate_limit_rpm",
        "token_quota_per_day",
        "share_prefix_cache",
        "max_requests_in_flight",
        "max_queued_prompt_tokens",
        "fair_share_weight",
    }
)


@transaction.atomic
def tenant_update(*, tenant: Tenant, **fields: object) -> Tenant:
    unknown = set(fields) - TENANT_UPDATABLE_FIELDS
    if unknown:
        raise DomainValidationError(fields={name: ["cannot be changed"] for name in sorted(unknown)})
    for name, value in fields.items():
        setattr(tenant, name, value)
    full_clean_or_raise(tenant)
    tenant.save(update_fields=list(fields) or None)
    return tenant


@transaction.atomic
def api_key_create(*, tenant: Tenant, name: str = "") -> tuple[ApiKey, str]:
    """Returns the key and its raw value; the raw value is not kept anywhere."""
    raw_key = KEY_PREFIX + secrets.token_urlsafe(32)
    api_key = ApiKey.objects.create(
        tenant=tenant, name=name, prefix=raw_key[:LOOKUP_PREFIX_LENGTH], key_hash=_key_hash(raw_key)
    )
    return api_key, raw_key


@transaction.atomic
def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])
    return api_key


@transaction.atomic
def api_key_authenticate(*, raw_key: str) -> ApiKey | None:
    """The unrevoked key whose hash matches, with its tenant loaded; None for anything else."""
    if not raw_key.startswith(KEY_PREFIX):
        return None
    presented_hash = _key_hash(raw_key)
    candidates = api_key_active_candidates(prefix=raw_key[:LOOKUP_PREFIX_LENGTH])
    api_key = next((key for key in candidates if hmac.compare_digest(key.key_hash, presented_hash)), None)
    if api_key is None:
        return None
    now = timezone.now()
    stale_before = now - LAST_USED_RESOLUTION
    if api_key.last_used_at is None or api_key.last_used_at < stale_before:
        # Conditional, so concurrent requests with the same key write the row once.
        ApiKey.objects.filter(Q(last_used_at__isnull=True) | Q(last_used_at__lt=stale_before), pk=api_key.pk).update(
            last_used_at=now
        )
        api_key.last_used_at = now
    return api_key


@transaction.atomic
def tenant_usage_record(
    *, tenant_id: int, prompt_tokens: int, cached_tokens: int, completion_tokens: int, day: date | None = None
) -> None:
    """Adds one request's tokens to the tenant's row for the (UTC) day.

    The increments are F() expressions evaluated by the database, so concurrent recordings add up
    instead of overwriting each other; the row is created the first time (get_or_create retries the
    read when a concurrent insert wins the unique constraint).
    """
    counts = {"prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens, "completion_tokens": completion_tokens}
    negative = {name: ["must be >= 0"] for name, value in counts.items() if value < 0}
    if negative:
        raise DomainValidationError(fields=negative)
    day = day or utc_today()
    increments = {name: F(name) + value for name, value in counts.items()}
    rows = TenantUsage.objects.filter(tenant_id=tenant_id, day=day)
    if not rows.update(requests=F("requests") + 1, **increments):
        TenantUsage.objects.get_or_create(tenant_id=tenant_id, day=day)
        rows.update(requests=F("requests") + 1, **increments)
