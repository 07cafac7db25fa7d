"""Per-tenant request rate limits: one token bucket per tenant, refilled continuously.

The buckets live in this process's memory, which is exact for the embedded default (one gateway
process). N gateway processes would each allow the full rate; they would need a shared store (Redis).
Only the event loop touches the buckets, so they need no lock.
"""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from controlplane.gateway.errors import GatewayError
from controlplane.tenants.models import Tenant


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated_at: float


class RateLimiter:
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


limiter = RateLimiter()


def check_rate_limit(tenant: Tenant) -> None:
    wait = limiter.acquire(tenant.pk, per_minute=tenant.rate_limit_rpm)
    if wait:
        raise GatewayError(
            "rate_limit",
            f"Rate limit of {tenant.rate_limit_rpm} requests per minute reached; retry after {math.ceil(wait)} s.",
            retry_after=math.ceil(wait),
        )
