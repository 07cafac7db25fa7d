import hashlib
import hmac
import secrets
from datetime import timedelta

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane.tenants.models import ApiKey, Tenant
from controlplane.tenants.selectors import api_key_active_candidates

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
def api_key_create(*, tenant: Tenant) -> tuple[ApiKey, str]:
    """Returns the key and its raw value; the raw value is not kept anywhere."""
    raw_key = KEY_PREFIX + secrets.token_urlsafe(32)
    api_key = ApiKey.objects.create(tenant=tenant, prefix=raw_key[:LOOKUP_PREFIX_LENGTH], key_hash=_key_hash(raw_key))
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
