import django_filters

from controlplane.access.principals import TenantPrincipal
from controlplane.tenants.models import ApiKey, Tenant, TenantUsage


def visible_tenants(request):
    """An API key may only name its own tenant in a filter, so other tenants' ids are not even confirmed."""
    user = getattr(request, "user", None)  # no request while the schema is generated
    if isinstance(user, TenantPrincipal):
        return Tenant.objects.filter(pk=user.tenant.pk)
    return Tenant.objects.all()


class TenantFilter(django_filters.FilterSet):
    name = django_filters.CharFilter(lookup_expr="icontains")

    class Meta:
        model = Tenant
        fields = ["name", "share_prefix_cache"]


class ApiKeyFilter(django_filters.FilterSet):
    tenant = django_filters.ModelChoiceFilter(queryset=visible_tenants)
    revoked = django_filters.BooleanFilter(field_name="revoked_at", lookup_expr="isnull", exclude=True)

    class Meta:
        model = ApiKey
        fields = ["tenant", "revoked"]


class TenantUsageFilter(django_filters.FilterSet):
    tenant = django_filters.ModelChoiceFilter(queryset=visible_tenants)
    since = django_filters.DateFilter(field_name="day", lookup_expr="gte")
    until = django_filters.DateFilter(field_name="day", lookup_expr="lte")

    class Meta:
        model = TenantUsage
        fields = ["tenant", "since", "until"]
