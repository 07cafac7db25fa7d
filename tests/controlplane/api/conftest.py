"""Clients for each kind of caller of /api/v1: anonymous, a Django user per role, a tenant's API key."""

from collections.abc import Callable

import pytest
from django.contrib.auth.models import Group, User
from rest_framework.test import APIClient

from controlplane.topology.models import Cluster, EngineInstance, Pool
from controlplane.topology.services import cluster_create, instance_register, pool_create
from tests.controlplane.api.helpers import PASSWORD


@pytest.fixture(autouse=True)
def fast_password_hasher(settings):
    # Basic auth checks the password on every request; the production hasher takes ~0.3 s a check.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def make_user(db) -> Callable[..., User]:
    """A user in the role's group; role "superuser" makes a superuser with no group."""

    def make(role: str, username: str | None = None) -> User:
        username = username or f"{role}-user"
        if role == "superuser":
            return User.objects.create_superuser(username, password=PASSWORD)
        user = User.objects.create_user(username, password=PASSWORD)
        user.groups.add(Group.objects.get(name=role))
        return user

    return make


@pytest.fixture
def client_as(make_user, make_api_key) -> Callable[[str], APIClient]:
    """`client_as("operator")`, `client_as("tenant:acme")` (a new key of tenant acme), `client_as("anonymous")`."""

    def make(who: str) -> APIClient:
        client = APIClient()
        if who.startswith("tenant:"):
            client.credentials(HTTP_AUTHORIZATION=f"Bearer {make_api_key(who.removeprefix('tenant:'))}")
        elif who != "anonymous":
            client.force_login(make_user(who))
        return client

    return make


@pytest.fixture
def make_pool(db) -> Callable[..., Pool]:
    """A pool in cluster "main" (created on first use); fields override the defaults below."""

    def make(name: str = "decode", **fields) -> Pool:
        cluster = Cluster.objects.filter(name="main").first() or cluster_create(name="main")
        defaults = {"kind": "decode", "model": "smollm2-135m-instruct", "min_instances": 0, "max_instances": 4}
        return pool_create(cluster=cluster, name=name, **{**defaults, **fields})

    return make


@pytest.fixture
def make_instance(db) -> Callable[..., EngineInstance]:
    """A ready instance, registered the way a worker registers itself."""

    def make(pool: Pool, worker_id: str = "worker-0") -> EngineInstance:
        return instance_register(
            worker_id=worker_id,
            pool_name=pool.name,
            role=pool.kind,
            model=pool.model,
            hostname="host-0",
            request_endpoint=f"ipc:///tmp/{worker_id}.req",
            heartbeat_endpoint=f"ipc:///tmp/{worker_id}.hb",
        )

    return make
