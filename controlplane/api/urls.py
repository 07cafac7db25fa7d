from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView
from rest_framework.routers import SimpleRouter

from controlplane.api.errors import UnknownPathView
from controlplane.api.policies.views import (
    EPLayoutViewSet,
    EPRebalancePolicyViewSet,
    TrafficClassViewSet,
    TTLPolicyViewSet,
)
from controlplane.api.tenants.views import ApiKeyViewSet, TenantUsageViewSet, TenantViewSet
from controlplane.api.topology.views import (
    ClusterViewSet,
    EngineInstanceViewSet,
    NodeViewSet,
    PoolViewSet,
    ScalingEventViewSet,
)

router = SimpleRouter()
router.register("clusters", ClusterViewSet, basename="cluster")
router.register("nodes", NodeViewSet, basename="node")
router.register("pools", PoolViewSet, basename="pool")
router.register("instances", EngineInstanceViewSet, basename="instance")
router.register("scaling-events", ScalingEventViewSet, basename="scalingevent")
router.register("traffic-classes", TrafficClassViewSet, basename="trafficclass")
router.register("ttl-policies", TTLPolicyViewSet, basename="ttlpolicy")
router.register("ep-layouts", EPLayoutViewSet, basename="eplayout")
router.register("ep-rebalance-policies", EPRebalancePolicyViewSet, basename="eprebalancepolicy")
router.register("tenants", TenantViewSet, basename="tenant")
router.register("keys", ApiKeyViewSet, basename="apikey")
router.register("usage", TenantUsageViewSet, basename="tenantusage")

urlpatterns = [
    # The schema documents the API for anyone: it holds no data.
    path("schema/", SpectacularAPIView.as_view(authentication_classes=[], permission_classes=[]), name="api-schema"),
    path(
        "docs/",
        SpectacularSwaggerView.as_view(url_name="api-schema", authentication_classes=[], permission_classes=[]),
        name="api-docs",
    ),
    path("", include(router.urls)),
    re_path(r"", UnknownPathView.as_view()),
]
