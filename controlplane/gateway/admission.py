"""What every API call passes before any work is done for it."""

from dataclasses import dataclass

from django.http import HttpRequest

from controlplane.gateway.auth import authenticate
from controlplane.gateway.catalog import Catalog, served_catalog
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
    body: bytes  # as received: parsed where it is prepared (preparation)
    catalog: Catalog
    # The call's part of its tenant's caps and its place in the fair queues; whoever ends the call
    # releases it.
    hold: TenantHold


async def admit_caller(request: HttpRequest) -> Tenant:
    """The key, then the tenant's rate limit and daily token quota."""
    tenant = await authenticate(request)
    await check_rate_limit(tenant)
    await check_token_quota(tenant)
    return tenant


async def admit(request: HttpRequest) -> Admission:
    """Cheapest first: the body's size and arrival (413, 408), the caller (401, 429), the tenant's
    requests in flight (429). JSON (400) and the model (404) are checked where the body is prepared."""
    check_body_received(request)
    tenant = await admit_caller(request)
    catalog = await served_catalog()
    return Admission(tenant=tenant, body=request.body, catalog=catalog, hold=loads.admit(tenant))


async def prepare(admission: Admission, *, protocol: str) -> PreparedRequest:
    """Raises the recipe's ApiError for invalid fields, bodies past SLUICE_REQUEST_LIMITS and prompts
    over the context window, and a 429 when its prompts would pass the tenant's queued-token cap."""
    prepared = await prepare_generation(admission.body, protocol=protocol, hold=admission.hold)
    admission.hold.queue_prompt(len(prepared.prompt_token_ids) * prepared.n)
    return prepared


async def count_prompt_tokens(admission: Admission) -> int:
    """Anthropic's count_tokens, held to the same limits as a generation."""
    return await prepare_count(admission.body, hold=admission.hold)
