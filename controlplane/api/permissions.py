"""Who may do what: each viewset declares it, per action, and this one permission class enforces it.

- `action_permissions`: action -> the Django permission ("app.codename") a user needs. The roles
  (controlplane.access.roles) are groups holding those permissions; a superuser holds all of them.
- `tenant_actions`: the actions an API key (TenantPrincipal) may take. The viewset must then scope
  its queryset to the key's tenant (TenantScopedMixin), so another tenant's row is a 404, not a 403.
An action in neither is refused to everyone but superusers; nothing is allowed by default.
"""

from rest_framework.permissions import BasePermission

from controlplane.access.principals import TenantPrincipal


class RolePermission(BasePermission):
    def has_permission(self, request, view) -> bool:
        user = request.user
        if not (user and user.is_authenticated):
            return False  # DRF turns this into 401, as an authenticator offers a WWW-Authenticate challenge
        if not hasattr(view, "action"):
            return False  # only viewsets declare their actions
        if view.action in (None, "metadata"):
            # A method the route does not map, or OPTIONS ("metadata", and there is no metadata class):
            # either way the viewset answers 405 and reveals nothing.
            return True
        if isinstance(user, TenantPrincipal):
            return view.action in getattr(view, "tenant_actions", ())
        required = getattr(view, "action_permissions", {}).get(view.action)
        return user.is_superuser or (required is not None and user.has_perm(required))


class TenantScopedMixin:
    """Limits a viewset's rows to the API key's tenant; `tenant_field` names the lookup to the tenant."""

    tenant_field = "tenant"

    def get_queryset(self):
        queryset = super().get_queryset()
        user = self.request.user
        if isinstance(user, TenantPrincipal):
            queryset = queryset.filter(**{self.tenant_field: user.tenant})
        return queryset
