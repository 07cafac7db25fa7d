"""What every API call passes before any work is done for it: one pipeline, each stage once and in
this order, cheapest first.

1. The body's size and arrival (413, 408).
2. The caller: its API key (401), its tenant's rate limit and daily token quota (429).
3. The tenant's caps: its calls in flight (429). The hold taken here is the call's until it ends.
4. The body's preparation (JSON 400, the model 404, fields and limits 400 or 413), then the tenant's
   queued prompt tokens (429).
"""

from dataclasses import dataclass

from django.http import HttpRequest

from controlplane.gateway.auth import authenticate
from controlplane.gateway.catalog import served_catalog
from controlplane.gateway.preparation import prepare_count, prepare_generation
from controlplane.gateway.quota import check_token_quota
from controlplane.gateway.rate_limit import check_rate_limit
from controlplane.gateway.request_body import check_body_received
from controlplane.gateway.tenant_caps import TenantHold, loads
from controlplane.tenants.models import Tenant
from recipe.api import PreparedRequest


@dataclass(frozen=True, slots=True)
class Admission:
    tenant: Tenant
    # The call's part of its tenant's caps and its place in the fair queues; whoever ends the call
    # releases it.
    hold: TenantHold


async def admit_caller(request: HttpRequest) -> Tenant:
    """Stage 2 alone, for the calls with no body to prepare."""
    tenant = await authenticate(request)
    await check_rate_limit(tenant)
    await check_token_quota(tenant)
    return tenant


async def admit_generation(request: HttpRequest, *, protocol: str) -> tuple[Admission, PreparedRequest]:
    """The admitted call and its prepared request; the caller releases the hold once it is done with
    them. Raises the recipe's ApiError for invalid fields, bodies past SLUICE_REQUEST_LIMITS and
    prompts over the context window, and a 429 when its prompts would pass the tenant's queued-token
    cap (the hold is released then)."""
    admission = await _admit(request)
    try:
        prepared = await prepare_generation(request.body, protocol=protocol, hold=admission.hold)
        admission.hold.queue_prompt(len(prepared.prompt_token_ids) * prepared.n)
    except BaseException:
        admission.hold.release()
        raise
    return admission, prepared


async def admit_count(request: HttpRequest) -> int:
    """Anthropic's count_tokens, held to the same limits as a generation: the call ends with the count."""
    admission = await _admit(request)
    try:
        return await prepare_count(request.body, hold=admission.hold)
    finally:
        admission.hold.release()


async def _admit(request: HttpRequest) -> Admission:
    """Stages 1 to 3."""
    check_body_received(request)
    tenant = await admit_caller(request)
    # Loaded (on first use) before the hold is taken, so a slow first load holds no tenant's cap.
    await served_catalog()
    return Admission(tenant=tenant, hold=loads.admit(tenant))
