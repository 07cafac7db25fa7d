"""Per-tenant daily token quotas, checked before a request is admitted.

A request is admitted while the tenant's tokens recorded today are under its quota, so the request
that crosses the quota finishes and the next one is refused. Days are UTC days, like the usage rows.

The usage rows (TenantUsage) are the record. Without SLUICE_REDIS_URL each admission reads the
tenant's row of the day. With it, gateways share one counter per tenant and UTC day in Redis instead
of reading the database per request: a missing counter is seeded from the row (SET NX, so the first
seed wins), each recorded call adds its tokens to an existing one (`count_quota_tokens`, after the
row's update), and the counter expires after SEED_TTL_S, to be seeded from the row again: whatever it
missed (increments made while Redis was unreachable, one racing its seed) is corrected within that.

Redis unreachable: the admission reads the row, as without Redis (exact, one query more); the outage
is logged once (shared_redis).
"""

import math
from datetime import UTC, datetime, timedelta

import redis.asyncio
from asgiref.sync import sync_to_async

from controlplane.gateway import shared_redis
from controlplane.gateway.errors import GatewayError
from controlplane.tenants.models import Tenant
from controlplane.tenants.selectors import tenant_tokens_used_today, utc_today

SEED_TTL_S = 600

# KEYS[1]: a tenant's counter of the day. ARGV[1]: tokens. Adds only to a seeded counter: creating it
# here would start it at this call's tokens instead of the day's.
_ADD_IF_SEEDED = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.call('INCRBY', KEYS[1], ARGV[1])
end
return -1
"""


class SharedQuotaCounter:
    """Tokens used per tenant and UTC day, in Redis, shared by the gateways on the same prefix."""

    def __init__(self, client: redis.asyncio.Redis, *, prefix: str) -> None:
        self._client = client
        self._add = client.register_script(_ADD_IF_SEEDED)
        self._prefix = prefix

    def _key(self, tenant_id: int) -> str:
        return f"{self._prefix}:tokens:{tenant_id}:{utc_today().isoformat()}"

    async def used_today(self, tenant_id: int) -> int:
        key = self._key(tenant_id)
        used = await self._client.get(key)
        if used is None:
            recorded = await sync_to_async(tenant_tokens_used_today)(tenant_id=tenant_id)
            # NX with GET: one round trip; a seed written meanwhile by another gateway wins.
            used = await self._client.set(key, recorded, ex=SEED_TTL_S, nx=True, get=True)
            if used is None:
                return recorded
        return int(used)

    async def add(self, tenant_id: int, tokens: int) -> None:
        await self._add(keys=[self._key(tenant_id)], args=[tokens])


_shared: tuple[redis.asyncio.Redis, SharedQuotaCounter] | None = None


def _counter() -> SharedQuotaCounter | None:
    global _shared
    client = shared_redis.shared_redis()
    if client is None:
        return None
    if _shared is None or _shared[0] is not client:
        _shared = (client, SharedQuotaCounter(client, prefix=shared_redis.redis_key()))
    return _shared[1]


async def tokens_used_today(tenant_id: int) -> int:
    counter = _counter()
    if counter is not None:
        try:
            used = await counter.used_today(tenant_id)
        except shared_redis.REDIS_ERRORS as error:
            shared_redis.report_unavailable("the daily token quota", error)
        else:
            shared_redis.report_available()
            return used
    return await sync_to_async(tenant_tokens_used_today)(tenant_id=tenant_id)


async def count_quota_tokens(tenant_id: int, tokens: int) -> None:
    """Adds a recorded call's tokens to the shared counter, if there is one; call it after the usage
    row is updated. A Redis error is reported, not raised: the row has the tokens."""
    counter = _counter()
    if counter is None or tokens <= 0:
        return
    try:
        await counter.add(tenant_id, tokens)
    except shared_redis.REDIS_ERRORS as error:
        shared_redis.report_unavailable("the daily token quota", error)


def _seconds_to_next_utc_day(now: datetime) -> int:
    tomorrow = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return math.ceil((tomorrow - now).total_seconds())


async def check_token_quota(tenant: Tenant) -> None:
    quota = tenant.token_quota_per_day
    if quota is None:
        return
    used = await tokens_used_today(tenant.pk)
    if used >= quota:
        retry_after = _seconds_to_next_utc_day(datetime.now(UTC))
        raise GatewayError(
            "rate_limit",
            f"Daily token quota of {quota} tokens is used up ({used} used today); it resets at 00:00 UTC.",
            retry_after=retry_after,
        )
