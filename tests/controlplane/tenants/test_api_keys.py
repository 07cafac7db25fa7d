import hashlib
from datetime import timedelta

from django.db import connection
from django.utils import timezone

from controlplane.tenants.models import SHARED_CACHE_NAMESPACE, ApiKey, Tenant
from controlplane.tenants.services import (
    api_key_authenticate,
    api_key_create,
    api_key_revoke,
    tenant_get_or_create,
)


def _all_key_rows_as_text() -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT * FROM {ApiKey._meta.db_table}")
        return repr(cursor.fetchall())


def test_the_raw_key_is_stored_nowhere_only_its_hash(make_tenant):
    # given / when
    api_key, raw_key = api_key_create(tenant=make_tenant())

    # then
    assert raw_key.startswith("sk-sluice-") and len(raw_key) == len("sk-sluice-") + 43
    assert raw_key not in _all_key_rows_as_text()
    assert raw_key[len("sk-sluice-") :] not in _all_key_rows_as_text()
    api_key.refresh_from_db()
    assert api_key.key_hash == hashlib.sha256(raw_key.encode()).hexdigest()
    assert api_key.prefix == raw_key[:12]


def test_keys_are_random(make_tenant):
    tenant = make_tenant()
    assert len({api_key_create(tenant=tenant)[1] for _ in range(5)}) == 5


def test_authenticate_returns_the_key_with_its_tenant(make_tenant):
    # given
    api_key, raw_key = api_key_create(tenant=make_tenant("acme"))

    # when
    found = api_key_authenticate(raw_key=raw_key)

    # then
    assert found == api_key
    assert found.tenant.name == "acme"
    assert found.last_used_at is not None


def test_authenticate_rejects_unknown_and_malformed_keys(make_tenant):
    _, raw_key = api_key_create(tenant=make_tenant())
    same_prefix_other_tail = raw_key[:12] + "x" * (len(raw_key) - 12)

    for presented in [same_prefix_other_tail, raw_key[:-1], raw_key + "x", "sk-other-" + raw_key[9:], "", "Bearer"]:
        assert api_key_authenticate(raw_key=presented) is None, presented


def test_a_revoked_key_no_longer_authenticates(make_tenant):
    # given
    api_key, raw_key = api_key_create(tenant=make_tenant())
    assert api_key_authenticate(raw_key=raw_key) is not None

    # when
    api_key_revoke(api_key=api_key)
    revoked_at = api_key.revoked_at
    api_key_revoke(api_key=api_key)

    # then
    assert api_key_authenticate(raw_key=raw_key) is None
    api_key.refresh_from_db()
    assert api_key.revoked_at == revoked_at  # revoking again changes nothing


def test_last_used_at_is_written_at_most_once_a_minute(make_tenant):
    # given
    api_key, raw_key = api_key_create(tenant=make_tenant())
    recently = timezone.now() - timedelta(seconds=30)
    ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=recently)

    # when / then: within the minute the row is not written
    api_key_authenticate(raw_key=raw_key)
    api_key.refresh_from_db()
    assert api_key.last_used_at == recently

    # when / then: after it, it is
    long_ago = timezone.now() - timedelta(minutes=2)
    ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=long_ago)
    api_key_authenticate(raw_key=raw_key)
    api_key.refresh_from_db()
    assert api_key.last_used_at > recently


def test_tenant_get_or_create_is_idempotent_and_namespaces_are_private(db):
    # given / when
    acme = tenant_get_or_create(name="acme")
    again = tenant_get_or_create(name="acme")
    other = tenant_get_or_create(name="other")

    # then
    assert again == acme
    assert acme.prefix_cache_namespace == acme.cache_namespace
    assert acme.cache_namespace != other.cache_namespace
    assert SHARED_CACHE_NAMESPACE not in (acme.cache_namespace, other.cache_namespace)


def test_tenants_that_share_the_prefix_cache_use_the_shared_namespace(db):
    # given
    tenant_get_or_create(name="acme")
    Tenant.objects.filter(name="acme").update(share_prefix_cache=True)

    # when
    acme = Tenant.objects.get(name="acme")

    # then
    assert acme.prefix_cache_namespace == SHARED_CACHE_NAMESPACE
    assert acme.cache_namespace != SHARED_CACHE_NAMESPACE
