"""Factories for the control plane's suites (tenants, API keys, pools, instances, users in roles)."""

import importlib
from collections.abc import Callable

import pytest
from django.apps import apps as django_apps
from django.contrib.auth.models import Group, User

from controlplane.tenants.models import Tenant
from controlplane.tenants.services import api_key_create, tenant_get_or_create
from controlplane.topology.models import Cluster, EngineInstance, Pool
from controlplane.topology.services import instance_register, pool_create


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


@pytest.fixture
def make_pool(db) -> Callable[..., Pool]:
    """A pool in cluster "test" (created on first use); fields override pool_create's defaults."""

    def make(name: str = "decode", *, kind: str = "decode", **fields) -> Pool:
        cluster, _ = Cluster.objects.get_or_create(name="test")
        fields = {"model": "smollm2-135m-instruct", "min_instances": 0, "max_instances": 8, **fields}
        return pool_create(cluster=cluster, name=name, kind=kind, **fields)

    return make


@pytest.fixture
def make_instance(make_pool) -> Callable[..., EngineInstance]:
    """A registered (ready) instance of `pool` (default: a decode pool), then any fields set directly."""
    counter = iter(range(1_000_000))

    def make(pool: Pool | None = None, **fields) -> EngineInstance:
        pool = pool or Pool.objects.filter(name="decode").first() or make_pool()
        n = next(counter)
        instance = instance_register(
            worker_id=fields.pop("worker_id", f"{pool.name}-{n}"),
            pool_name=pool.name,
            cluster_name=pool.cluster.name,
            role=pool.kind,
            model=pool.model,
            hostname="host-a",
            request_endpoint=fields.pop("request_endpoint", f"ipc:///tmp/sluice-test-{n}.req"),
            heartbeat_endpoint=f"ipc:///tmp/sluice-test-{n}.hb",
        )
        if fields:
            EngineInstance.objects.filter(pk=instance.pk).update(**fields)
            instance.refresh_from_db()
        return instance

    return make


@pytest.fixture
def make_user(db) -> Callable[..., User]:
    """A staff user in the named role's group ("admin", "operator", "auditor", "tenant"; None: no group)."""

    def make(role: str | None, username: str | None = None) -> User:
        user = User.objects.create_user(username=username or f"{role or 'nobody'}-user", password="pw", is_staff=True)
        if role is not None:
            user.groups.add(Group.objects.get(name=role))
        return user

    return make


@pytest.fixture
def default_ttl_policies(transactional_db) -> None:
    """The traffic classes and first TTLs that a data migration creates. A transactional test's flush
    empties every table, so its tests that need them create them again (the roles' groups come back
    by themselves: the flush runs post_migrate)."""
    migration = importlib.import_module("migrations.policies.0002_default_ttl_policies")
    migration.create_defaults(django_apps, None)
