"""The Redis that gateways share rate-limit buckets and quota counters through (SLUICE_REDIS_URL).

One asyncio client per event loop, like the gateway's EngineClient (engine.py): a server has one
loop, tests get one per loop, and redis.asyncio connections belong to the loop that opened them.

When Redis cannot be reached the gateway keeps serving: each caller falls back to what one gateway
knows by itself (rate_limit.py, quota.py say what that is), and `report_unavailable` logs the outage
once, not once per request, until Redis answers again (`report_available`).
"""

import asyncio
import logging

import redis.asyncio
from django.conf import settings

log = logging.getLogger(__name__)

# A Redis that does not answer within this long counts as down for the request at hand: admission
# must not wait on it for long.
TIMEOUT_S = 0.25

# Errors that mean "Redis is unavailable" (connection refused or lost, timeout, a script error).
REDIS_ERRORS = (redis.RedisError, OSError)

_current: tuple[asyncio.AbstractEventLoop, redis.asyncio.Redis] | None = None
_down = False


def redis_key(*parts: object) -> str:
    return ":".join([settings.SLUICE_REDIS_PREFIX, *map(str, parts)])


def shared_redis() -> redis.asyncio.Redis | None:
    """This loop's client for SLUICE_REDIS_URL; None when none is configured."""
    global _current
    if not settings.SLUICE_REDIS_URL:
        return None
    loop = asyncio.get_running_loop()
    if _current is None or _current[0] is not loop:
        client = redis.asyncio.Redis.from_url(
            settings.SLUICE_REDIS_URL, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S
        )
        _current = (loop, client)
    return _current[1]


def report_unavailable(what: str, error: BaseException) -> None:
    global _down
    if not _down:
        _down = True
        log.warning(
            "shared Redis unavailable (%s: %s): %s falls back to this gateway's own", type(error).__name__, error, what
        )


def report_available() -> None:
    global _down
    if _down:
        _down = False
        log.warning("shared Redis answers again: rate limits and quotas are shared across gateways")
