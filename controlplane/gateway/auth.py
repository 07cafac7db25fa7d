"""Which tenant a request comes from.

A key is checked against the database on every request (no caching), so a revoked key stops working
at once. While no API key exists at all the gateway runs open: every request is tenant "anonymous".
"""

import functools
import logging

from asgiref.sync import sync_to_async
from django.http import HttpRequest

from controlplane.gateway.errors import GatewayError
from controlplane.tenants.models import Tenant
from controlplane.tenants.selectors import api_keys_exist
from controlplane.tenants.services import api_key_authenticate, tenant_get_or_create

log = logging.getLogger(__name__)

ANONYMOUS_TENANT = "anonymous"


@functools.cache  # once per process
def warn_open_mode() -> None:
    log.warning(
        "NO API KEYS EXIST: the gateway is OPEN, every request is served as tenant %r. "
        "Create a key with `python manage.py create_api_key --tenant NAME` to require authentication.",
        ANONYMOUS_TENANT,
    )


def presented_key(request: HttpRequest) -> str | None:
    """`Authorization: Bearer <key>` (OpenAI) or `x-api-key: <key>` (Anthropic)."""
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and credentials.strip():
        return credentials.strip()
    return request.headers.get("x-api-key") or None


def _tenant_for(raw_key: str | None) -> Tenant | None:
    if raw_key is not None:
        api_key = api_key_authenticate(raw_key=raw_key)
        if api_key is not None:
            return api_key.tenant
    if api_keys_exist():
        return None
    warn_open_mode()
    return tenant_get_or_create(name=ANONYMOUS_TENANT)


async def authenticate(request: HttpRequest) -> Tenant:
    raw_key = presented_key(request)
    tenant = await sync_to_async(_tenant_for)(raw_key)
    if tenant is None:
        message = (
            "Invalid API key." if raw_key else "Missing API key: send `Authorization: Bearer <key>` or `x-api-key`."
        )
        raise GatewayError("authentication", message)
    return tenant
