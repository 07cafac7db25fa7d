"""tenants/, keys/ and usage/. API keys (TenantPrincipal) see only their own tenant's keys and usage."""

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from controlplane.access.principals import TenantPrincipal
from controlplane.api.inputs import validated
from controlplane.api.permissions import TenantScopedMixin
from controlplane.api.tenants.filters import ApiKeyFilter, TenantFilter, TenantUsageFilter
from controlplane.api.tenants.serializers import (
    ApiKeyCreatedSerializer,
    ApiKeyCreateSerializer,
    ApiKeySerializer,
    TenantSerializer,
    TenantUsageSerializer,
)
from controlplane.tenants.models import ApiKey, Tenant
from controlplane.tenants.selectors import tenant_usage_list
from controlplane.tenants.services import api_key_create, api_key_revoke, tenant_create, tenant_update

READ = mixins.ListModelMixin, mixins.RetrieveModelMixin


class TenantViewSet(*READ, viewsets.GenericViewSet):
    """Tenants: who may call the inference API, at what rate and daily token quota, how much at once
    (requests in flight, queued prompt tokens) and with what share of the queues (fair_share_weight)."""

    queryset = Tenant.objects.all()
    serializer_class = TenantSerializer
    filterset_class = TenantFilter
    ordering_fields = ["id", "name", "created_at"]
    ordering = ["name"]
    action_permissions = {
        "list": "tenants.view_tenant",
        "retrieve": "tenants.view_tenant",
        "create": "tenants.add_tenant",
        "partial_update": "tenants.change_tenant",
    }

    @extend_schema(request=TenantSerializer, responses={201: TenantSerializer})
    def create(self, request):
        tenant = tenant_create(**validated(TenantSerializer, request.data))
        return Response(TenantSerializer(tenant).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=TenantSerializer, responses=TenantSerializer)
    def partial_update(self, request, pk=None):
        tenant = self.get_object()
        tenant = tenant_update(
            tenant=tenant, **validated(TenantSerializer, request.data, instance=tenant, partial=True)
        )
        return Response(TenantSerializer(tenant).data)


class ApiKeyViewSet(TenantScopedMixin, *READ, viewsets.GenericViewSet):
    """API keys. Admins see every tenant's; an API key sees its own tenant's keys and may revoke them."""

    queryset = ApiKey.objects.select_related("tenant")
    serializer_class = ApiKeySerializer
    filterset_class = ApiKeyFilter
    ordering_fields = ["id", "created_at", "last_used_at"]
    ordering = ["-created_at"]
    action_permissions = {
        "list": "tenants.view_apikey",
        "retrieve": "tenants.view_apikey",
        "create": "tenants.add_apikey",
        "revoke": "tenants.change_apikey",
    }
    tenant_actions = {"list", "retrieve", "revoke"}

    @extend_schema(
        request=ApiKeyCreateSerializer,
        responses={201: ApiKeyCreatedSerializer},
        description="The response carries the raw key; it is never shown again.",
    )
    def create(self, request):
        api_key, raw_key = api_key_create(**validated(ApiKeyCreateSerializer, request.data))
        api_key.key = raw_key
        return Response(ApiKeyCreatedSerializer(api_key).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=ApiKeySerializer, description="Takes effect on the key's next request.")
    @action(detail=True, methods=["post"])
    def revoke(self, request, pk=None):
        api_key = api_key_revoke(api_key=self.get_object())
        return Response(ApiKeySerializer(api_key).data)


class TenantUsageViewSet(*READ, viewsets.GenericViewSet):
    """Requests and tokens per tenant and UTC day. An API key sees its own tenant's."""

    serializer_class = TenantUsageSerializer
    filterset_class = TenantUsageFilter
    ordering_fields = ["id", "day", "requests", "prompt_tokens", "completion_tokens"]
    ordering = ["-day", "tenant_id"]
    action_permissions = {"list": "tenants.view_tenantusage", "retrieve": "tenants.view_tenantusage"}
    tenant_actions = {"list", "retrieve"}

    def get_queryset(self):
        user = self.request.user
        return tenant_usage_list(tenant_id=user.tenant.id if isinstance(user, TenantPrincipal) else None)
