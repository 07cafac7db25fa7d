"""Who a request acts as when it authenticated with a tenant's API key, and which role a user has."""

from typing import Any, Literal

from controlplane.tenants.models import ApiKey, Tenant

Role = Literal["admin", "operator", "auditor", "tenant"]
ROLE_ORDER: tuple[Role, ...] = ("admin", "operator", "auditor", "tenant")


class TenantPrincipal:
    """A user-like object for an API key: no Django permissions; access is by owning the tenant's rows."""

    is_authenticated = True
    is_anonymous = False
    is_active = True
    is_staff = False
    is_superuser = False
    pk = None

    def __init__(self, *, tenant: Tenant, api_key: ApiKey) -> None:
        self.tenant = tenant
        self.api_key = api_key
        self.username = f"tenant:{tenant.name}"

    def __str__(self) -> str:
        return self.username

    def has_perm(self, perm: str, obj: Any = None) -> bool:
        return False

    def has_perms(self, perm_list: Any, obj: Any = None) -> bool:
        return False

    def has_module_perms(self, app_label: str) -> bool:
        return False

    def get_username(self) -> str:
        return self.username


def role_of(user: Any) -> Role | None:
    """The strongest role: superusers are admins, a TenantPrincipal is "tenant", else by group."""
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    if isinstance(user, TenantPrincipal):
        return "tenant"
    if not user.is_active:
        return None
    if user.is_superuser:
        return "admin"
    names = set(user.groups.values_list("name", flat=True))
    return next((role for role in ROLE_ORDER if role in names), None)
