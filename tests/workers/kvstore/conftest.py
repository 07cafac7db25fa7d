"""Fixtures shared by the store's suites."""

import uuid
from collections.abc import Iterator

import pytest
import redis

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    """A key prefix of this test's own on the real Redis, deleted afterwards."""
    client = redis.Redis.from_url(REDIS_URL)
    prefix = f"test:sluice:kv:{uuid.uuid4().hex}"
    yield prefix
    if names := list(client.scan_iter(match=f"{prefix}:*", count=1000)):
        client.delete(*names)
    client.close()
