"""API keys for DRF: `Authorization: Bearer sk-sluice-...` authenticates as the key's tenant."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.plumbing import build_bearer_security_scheme_object
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header

from controlplane.access.principals import TenantPrincipal
from controlplane.tenants.services import api_key_authenticate


class ApiKeyAuthentication(BaseAuthentication):
    """Checked against the database on every request (no caching), so a revoked key fails at once."""

    def authenticate(self, request):
        scheme, *credentials = get_authorization_header(request).split() or [b""]
        if scheme.lower() != b"bearer":
            return None  # Basic or none: the other authenticators' business
        if len(credentials) != 1:
            raise exceptions.AuthenticationFailed("Send `Authorization: Bearer <key>` with exactly one key.")
        api_key = api_key_authenticate(raw_key=credentials[0].decode("latin-1"))
        if api_key is None:
            raise exceptions.AuthenticationFailed("Invalid or revoked API key.")
        return TenantPrincipal(tenant=api_key.tenant, api_key=api_key), api_key

    def authenticate_header(self, request) -> str:
        # Its presence is what makes DRF answer unauthenticated requests with 401 rather than 403.
        return 'Bearer realm="api"'


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    target_class = ApiKeyAuthentication
    name = "apiKey"

    def get_security_definition(self, auto_schema):
        return build_bearer_security_scheme_object(header_name="Authorization", token_prefix="Bearer")
