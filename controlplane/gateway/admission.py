"""What every API call passes before any work is done for it."""

import asyncio
from dataclasses import dataclass

from django.conf import settings
from django.http import HttpRequest

from controlplane.gateway.auth import authenticate
from controlplane.gateway.catalog import Catalog, require_model, served_catalog
from controlplane.gateway.quota import check_token_quota
from controlplane.gateway.rate_limit import check_rate_limit
from controlplane.gateway.request_body import check_body_received, parse_json_object
from controlplane.tenants.models import Tenant
from recipe.api import PreparedRequest, count_tokens, prepare_request


@dataclass(frozen=True, slots=True)
class Admission:
    tenant: Tenant
    body: dict
    catalog: Catalog


async def admit_caller(request: HttpRequest) -> Tenant:
    """The key, then the tenant's rate limit and daily token quota."""
    tenant = await authenticate(request)
    check_rate_limit(tenant)
    await check_token_quota(tenant)
    return tenant


async def admit(request: HttpRequest) -> Admission:
    """Cheapest first: the body's size and arrival (413, 408), the caller (401, 429), JSON (400), the
    model (404)."""
    check_body_received(request)
    tenant = await admit_caller(request)
    body = parse_json_object(request)
    catalog = await served_catalog()
    require_model(body, catalog)
    return Admission(tenant=tenant, body=body, catalog=catalog)


async def prepare(admission: Admission, *, protocol: str) -> PreparedRequest:
    """Raises the recipe's ApiError for invalid fields, bodies past SLUICE_REQUEST_LIMITS and prompts
    over the context window. Off the event loop: rendering and tokenizing a prompt of megabytes takes
    a while."""
    models, limits = admission.catalog.models, settings.SLUICE_REQUEST_LIMITS
    return await asyncio.to_thread(prepare_request, protocol, admission.body, models, limits)


async def count_prompt_tokens(admission: Admission) -> int:
    """Anthropic's count_tokens, held to the same limits as a generation; off the event loop too."""
    models, limits = admission.catalog.models, settings.SLUICE_REQUEST_LIMITS
    return await asyncio.to_thread(count_tokens, admission.body, models, limits)
