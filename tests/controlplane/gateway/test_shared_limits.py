"""Rate limits and daily token quotas shared by several gateways through one Redis (DB 13 here,
under a prefix of the test's own), and what a gateway does when that Redis is down."""

import asyncio
import logging
import uuid

import pytest
import redis
import redis.asyncio

from controlplane.gateway import quota, shared_redis
from controlplane.gateway.errors import GatewayError
from controlplane.gateway.rate_limit import RateLimiter, SharedRateLimiter
from controlplane.tenants.models import Tenant
from controlplane.tenants.services import tenant_usage_record

REDIS_URL = "redis://127.0.0.1:6379/13"
DOWN_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1


@pytest.fixture
def prefix():
    prefix = f"test:{uuid.uuid4().hex}"
    yield prefix
    client = redis.Redis.from_url(REDIS_URL)
    for name in client.scan_iter(match=f"{prefix}:*"):
        client.delete(name)


def test_two_gateways_together_allow_at_most_the_tenants_rate(prefix):
    async def twenty_requests() -> list[float]:
        gateways = [
            SharedRateLimiter(redis.asyncio.Redis.from_url(REDIS_URL), prefix=prefix, fallback=RateLimiter())
            for _ in range(2)
        ]
        return [await gateways[i % 2].acquire(7, per_minute=5) for i in range(20)]

    waits = asyncio.run(twenty_requests())

    assert sum(wait == 0 for wait in waits) == 5
    assert waits[:5] == [0.0] * 5 and all(wait > 0 for wait in waits[5:])


def test_with_redis_down_the_rate_limit_falls_back_to_the_gateways_own_bucket(caplog):
    async def three_requests() -> list[float]:
        client = redis.asyncio.Redis.from_url(DOWN_URL, socket_connect_timeout=0.2)
        limiter = SharedRateLimiter(client, prefix="unused", fallback=RateLimiter())
        return [await limiter.acquire(7, per_minute=2) for _ in range(3)]

    with caplog.at_level(logging.WARNING, logger="controlplane.gateway.shared_redis"):
        waits = asyncio.run(three_requests())
    shared_redis.report_available()

    assert waits[:2] == [0.0, 0.0] and waits[2] > 0
    assert "shared Redis unavailable" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_two_gateways_share_one_quota_counter_seeded_from_the_usage_rows(prefix):
    tenant = Tenant.objects.create(name="q", token_quota_per_day=100)
    tenant_usage_record(tenant_id=tenant.pk, prompt_tokens=30, cached_tokens=0, completion_tokens=10)

    async def scenario() -> tuple[int, int, int]:
        one, two = (quota.SharedQuotaCounter(redis.asyncio.Redis.from_url(REDIS_URL), prefix=prefix) for _ in "12")
        seeded = await one.used_today(tenant.pk)  # from the row: 40
        await two.add(tenant.pk, 25)  # gateway two records a call
        seen_by_one = await one.used_today(tenant.pk)
        await one.add(tenant.pk, 50)
        return seeded, seen_by_one, await two.used_today(tenant.pk)

    assert asyncio.run(scenario()) == (40, 65, 115)


@pytest.mark.django_db(transaction=True)
def test_an_add_before_any_seed_does_not_start_the_counter_at_one_calls_tokens(prefix):
    tenant = Tenant.objects.create(name="q2", token_quota_per_day=100)
    tenant_usage_record(tenant_id=tenant.pk, prompt_tokens=60, cached_tokens=0, completion_tokens=0)

    async def scenario() -> int:
        counter = quota.SharedQuotaCounter(redis.asyncio.Redis.from_url(REDIS_URL), prefix=prefix)
        await counter.add(tenant.pk, 5)
        return await counter.used_today(tenant.pk)

    assert asyncio.run(scenario()) == 60


@pytest.mark.django_db(transaction=True)
def test_with_redis_down_the_quota_is_read_from_the_usage_rows(settings):
    settings.SLUICE_REDIS_URL = DOWN_URL
    tenant = Tenant.objects.create(name="q3", token_quota_per_day=100)
    tenant_usage_record(tenant_id=tenant.pk, prompt_tokens=90, cached_tokens=0, completion_tokens=20)

    async def check() -> None:
        await quota.check_token_quota(tenant)

    with pytest.raises(GatewayError, match="quota of 100 tokens is used up \\(110 used today\\)"):
        asyncio.run(check())
    shared_redis.report_available()
