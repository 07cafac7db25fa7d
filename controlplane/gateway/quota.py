"""Per-tenant daily token quotas, checked before a request is admitted.

A request is admitted while the tenant's tokens recorded today are under its quota, so the request
that crosses the quota finishes and the next one is refused. Days are UTC days, like the usage rows.
"""

import math
from datetime import UTC, datetime, timedelta

from asgiref.sync import sync_to_async

from controlplane.gateway.errors import GatewayError
from controlplane.tenants.models import Tenant
from controlplane.tenants.selectors import tenant_tokens_used_today


def _seconds_to_next_utc_day(now: datetime) -> int:
    tomorrow = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return math.ceil((tomorrow - now).total_seconds())


async def check_token_quota(tenant: Tenant) -> None:
    quota = tenant.token_quota_per_day
    if quota is None:
        return
    used = await sync_to_async(tenant_tokens_used_today)(tenant_id=tenant.pk)
    if used >= quota:
        retry_after = _seconds_to_next_utc_day(datetime.now(UTC))
        raise GatewayError(
            "rate_limit",
            f"Daily token quota of {quota} tokens is used up ({used} used today); it resets at 00:00 UTC.",
            retry_after=retry_after,
        )
