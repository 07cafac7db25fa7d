"""Per-tenant request rate limits: one token bucket per tenant, refilled continuously.

Without SLUICE_REDIS_URL (the embedded default: one gateway process) the buckets live in this
process's memory; only the event loop touches them, so they need no lock. With it, every gateway
takes from the same bucket in Redis: one Lua script reads, refills and takes in one round trip,
atomically, on Redis's clock (so gateways' clocks need not agree), so N gateways together allow the
tenant's rate, not N times it.

Redis unreachable: fail open to the in-process bucket. Each gateway then limits on its own (the
tenant gets at most N times its rate for the outage) rather than refusing every request because a
shared counter is down; the outage is logged once (shared_redis).
"""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio

from controlplane.gateway import shared_redis
from controlplane.gateway.errors import GatewayError
from controlplane.tenants.models import Tenant

# KEYS[1]: the bucket (hash: tokens, at). ARGV[1]: requests per minute (the capacity). Returns the
# seconds to wait as a string ("0": taken): a Lua number in a reply would be truncated to an integer.
_TAKE = """
local capacity = tonumber(ARGV[1])
local rate = capacity / 60
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1]) or capacity
local at = tonumber(state[2]) or now
tokens = math.min(capacity, tokens + math.max(0, now - at) * rate)
local wait = 0
if tokens >= 1 then
  tokens = tokens - 1
else
  wait = (1 - tokens) / rate
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', tokens), 'at', string.format('%.17g', now))
-- A bucket left alone for a minute is full again, which is what a missing one means.
redis.call('EXPIRE', KEYS[1], 120)
return string.format('%.17g', wait)
"""


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated_at: float


class RateLimiter:
    """The in-process buckets."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[int, _Bucket] = {}

    def acquire(self, key: int, *, per_minute: int) -> float:
        """Takes one request from key's bucket (full at first: a burst of per_minute is allowed).
        Returns 0 when allowed, else the seconds until a request would be."""
        now = self._clock()
        bucket = self._buckets.setdefault(key, _Bucket(tokens=per_minute, updated_at=now))
        refill_per_second = per_minute / 60
        # The capacity follows the tenant's current limit, so an edited limit applies at once.
        bucket.tokens = min(per_minute, bucket.tokens + (now - bucket.updated_at) * refill_per_second)
        bucket.updated_at = now
        if bucket.tokens >= 1:
            bucket.tokens -= 1
            return 0.0
        return (1 - bucket.tokens) / refill_per_second


class SharedRateLimiter:
    """The buckets in Redis, shared by every gateway using the same Redis and prefix; `fallback`
    serves while Redis is unreachable."""

    def __init__(self, client: redis.asyncio.Redis, *, prefix: str, fallback: RateLimiter) -> None:
        self._take = client.register_script(_TAKE)
        self._prefix = prefix
        self.fallback = fallback

    async def acquire(self, key: int, *, per_minute: int) -> float:
        try:
            wait = float(await self._take(keys=[f"{self._prefix}:rate:{key}"], args=[per_minute]))
        except shared_redis.REDIS_ERRORS as error:
            shared_redis.report_unavailable("the rate limit", error)
            return self.fallback.acquire(key, per_minute=per_minute)
        shared_redis.report_available()
        return wait


limiter = RateLimiter()
_shared: tuple[redis.asyncio.Redis, SharedRateLimiter] | None = None


async def _acquire(tenant: Tenant) -> float:
    global _shared
    client = shared_redis.shared_redis()
    if client is None:
        return limiter.acquire(tenant.pk, per_minute=tenant.rate_limit_rpm)
    if _shared is None or _shared[0] is not client:
        _shared = (client, SharedRateLimiter(client, prefix=shared_redis.redis_key(), fallback=limiter))
    return await _shared[1].acquire(tenant.pk, per_minute=tenant.rate_limit_rpm)


async def check_rate_limit(tenant: Tenant) -> None:
    wait = await _acquire(tenant)
    if wait:
        raise GatewayError(
            "rate_limit",
            f"Rate limit of {tenant.rate_limit_rpm} requests per minute reached; retry after {math.ceil(wait)} s.",
            retry_after=math.ceil(wait),
        )
