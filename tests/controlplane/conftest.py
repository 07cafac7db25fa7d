"""Factories for the control plane's suites (tenants, API keys)."""

from collections.abc import Callable

import pytest

from controlplane.tenants.models import Tenant
from controlplane.tenants.services import api_key_create, tenant_get_or_create


@pytest.fixture
def make_tenant(db) -> Callable[..., Tenant]:
    def make(name: str = "acme", **fields) -> Tenant:
        tenant = tenant_get_or_create(name=name)
        if fields:
            Tenant.objects.filter(pk=tenant.pk).update(**fields)
            tenant.refresh_from_db()
        return tenant

    return make


@pytest.fixture
def make_api_key(make_tenant) -> Callable[..., str]:
    """Creates a key for the named tenant (created with the given fields) and returns the raw key."""

    def make(tenant: str = "acme", **fields) -> str:
        _, raw_key = api_key_create(tenant=make_tenant(tenant, **fields))
        return raw_key

    return make
