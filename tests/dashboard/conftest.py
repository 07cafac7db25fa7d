"""Users in roles for the dashboard's suites."""

from collections.abc import Callable

import pytest
from django.contrib.auth.models import Group, User
from django.test import Client

from controlplane.telemetry import live
from controlplane.topology.models import Cluster, Pool
from controlplane.topology.services import pool_create


@pytest.fixture
def make_user(db) -> Callable[..., User]:
    """A user in the named role's group ("admin", "operator", "auditor", "tenant"; None: no group)."""

    def make(role: str | None, *, username: str | None = None, password: str = "pw") -> User:
        user = User.objects.create_user(username=username or f"{role or 'nobody'}-user", password=password)
        if role is not None:
            # get_or_create: a transactional test's flush may have run before the groups were synced again.
            user.groups.add(Group.objects.get_or_create(name=role)[0])
        return user

    return make


@pytest.fixture
def client_as(make_user) -> Callable[[str | None], Client]:
    """A test client signed in as a new user in that role."""

    def make(role: str | None) -> Client:
        client = Client()
        client.force_login(make_user(role))
        return client

    return make


@pytest.fixture
def no_collector():
    """No collector has published in this process: current_snapshot() is the empty one."""
    live.forget()
    yield
    live.forget()


@pytest.fixture
def make_pool(db) -> Callable[..., Pool]:
    """A pool in cluster "test" (created on first use)."""

    def make(name: str = "decode", *, kind: str = "decode") -> Pool:
        cluster, _ = Cluster.objects.get_or_create(name="test")
        return pool_create(
            cluster=cluster, name=name, kind=kind, model="smollm2-135m-instruct", min_instances=0, max_instances=8
        )

    return make
