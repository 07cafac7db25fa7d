from django.db.models import QuerySet

from controlplane.tenants.models import ApiKey


def api_key_active_candidates(*, prefix: str) -> QuerySet[ApiKey]:
    """Unrevoked keys sharing a prefix; the caller compares hashes."""
    return ApiKey.objects.select_related("tenant").filter(prefix=prefix, revoked_at__isnull=True)


def api_keys_exist() -> bool:
    """Revoked keys count: revoking the last key must not open the gateway."""
    return ApiKey.objects.exists()
