from datetime import date

from django.db.models import QuerySet
from django.utils import timezone

from controlplane.tenants.models import ApiKey, TenantUsage


def api_key_active_candidates(*, prefix: str) -> QuerySet[ApiKey]:
    """Unrevoked keys sharing a prefix; the caller compares hashes."""
    return ApiKey.objects.select_related("tenant").filter(prefix=prefix, revoked_at__isnull=True)


def api_keys_exist() -> bool:
    """Revoked keys count: revoking the last key must not open the gateway."""
    return ApiKey.objects.exists()


def tenant_tokens_used_today(*, tenant_id: int, today: date | None = None) -> int:
    """Prompt plus completion tokens recorded for the tenant on the current UTC day."""
    usage = TenantUsage.objects.filter(tenant_id=tenant_id, day=today or utc_today()).first()
    return 0 if usage is None else usage.total_tokens


def tenant_usage_list(*, tenant_id: int | None = None) -> QuerySet[TenantUsage]:
    """Daily usage rows, newest day first; every tenant's when tenant_id is None."""
    usage = TenantUsage.objects.select_related("tenant")
    return usage if tenant_id is None else usage.filter(tenant_id=tenant_id)


def utc_today() -> date:
    return timezone.now().date()  # USE_TZ: now() is in UTC
