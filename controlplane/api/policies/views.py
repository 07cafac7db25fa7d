"""traffic-classes/, ttl-policies/ and ep-layouts/: read by operators and auditors, written by admins."""

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from controlplane.api.inputs import ReasonSerializer, validated
from controlplane.api.policies.filters import EPLayoutFilter, TTLPolicyFilter
from controlplane.api.policies.serializers import (
    EPLayoutSerializer,
    EPRebalancePolicySerializer,
    TrafficClassSerializer,
    TTLPolicyCurrentSerializer,
    TTLPolicySerializer,
)
from controlplane.policies import selectors, services

READ = mixins.ListModelMixin, mixins.RetrieveModelMixin


class TrafficClassViewSet(*READ, viewsets.GenericViewSet):
    """Traffic classes (e.g. agent, chat): each has its own KV block TTL."""

    serializer_class = TrafficClassSerializer
    ordering_fields = ["id", "name", "created_at"]
    ordering = ["name"]
    action_permissions = {
        "list": "policies.view_trafficclass",
        "retrieve": "policies.view_trafficclass",
        "create": "policies.add_trafficclass",
    }

    def get_queryset(self):
        return selectors.traffic_class_list()

    @extend_schema(request=TrafficClassSerializer, responses={201: TrafficClassSerializer})
    def create(self, request):
        traffic_class = services.traffic_class_create(**validated(TrafficClassSerializer, request.data))
        return Response(TrafficClassSerializer(traffic_class).data, status=status.HTTP_201_CREATED)


class TTLPolicyViewSet(*READ, viewsets.GenericViewSet):
    """KV block TTLs per traffic class, versioned: a change is a new version, pushed to every live worker."""

    serializer_class = TTLPolicySerializer
    filterset_class = TTLPolicyFilter
    ordering_fields = ["id", "version", "created_at"]
    ordering = ["traffic_class__name", "-version"]
    action_permissions = {
        "list": "policies.view_ttlpolicy",
        "retrieve": "policies.view_ttlpolicy",
        "current": "policies.view_ttlpolicy",
        "create": "policies.add_ttlpolicy",
    }

    def get_queryset(self):
        return selectors.ttl_policy_list()

    @extend_schema(request=TTLPolicySerializer, responses={201: TTLPolicySerializer})
    def create(self, request):
        policy = services.ttl_policy_set(actor=request.user, **validated(TTLPolicySerializer, request.data))
        return Response(TTLPolicySerializer(policy).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses=TTLPolicyCurrentSerializer, filters=False)
    @action(detail=False, pagination_class=None, filterset_class=None)
    def current(self, request):
        return Response(TTLPolicyCurrentSerializer(selectors.ttl_policy_current()).data)


class EPLayoutViewSet(*READ, viewsets.GenericViewSet):
    """MoE expert placement per pool: created inactive and validated, then activated (one active per pool)."""

    serializer_class = EPLayoutSerializer
    filterset_class = EPLayoutFilter
    ordering_fields = ["id", "version", "created_at"]
    ordering = ["pool_id", "-version"]
    action_permissions = {
        "list": "policies.view_eplayout",
        "retrieve": "policies.view_eplayout",
        "create": "policies.add_eplayout",
        "activate": "policies.apply_eplayout",
    }
    error_responses = {"activate": {"409": "The layout is already active."}}

    def get_queryset(self):
        return selectors.ep_layout_list()

    @extend_schema(request=EPLayoutSerializer, responses={201: EPLayoutSerializer})
    def create(self, request):
        layout = services.ep_layout_create(actor=request.user, **validated(EPLayoutSerializer, request.data))
        return Response(EPLayoutSerializer(layout).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        request=ReasonSerializer,
        responses=EPLayoutSerializer,
        description="Checked again against the pool's instances, then pushed to them. Audited.",
    )
    @action(detail=True, methods=["post"])
    def activate(self, request, pk=None):
        data = validated(ReasonSerializer, request.data)
        layout = services.ep_layout_activate(layout=self.get_object(), actor=request.user, **data)
        return Response(EPLayoutSerializer(layout).data)


class EPRebalancePolicyViewSet(*READ, viewsets.GenericViewSet):
    """When the EPLB re-places a MoE pool's experts: off, propose (an admin activates the proposed
    layout through ep-layouts/{id}/activate/) or auto, every interval_s from the last window_s of loads."""

    serializer_class = EPRebalancePolicySerializer
    filterset_fields = ["pool", "mode"]
    ordering_fields = ["id", "pool"]
    ordering = ["pool_id"]
    action_permissions = {
        "list": "policies.view_eprebalancepolicy",
        "retrieve": "policies.view_eprebalancepolicy",
        "create": "policies.add_eprebalancepolicy",
        "partial_update": "policies.change_eprebalancepolicy",
    }

    def get_queryset(self):
        return selectors.ep_rebalance_policy_list()

    @extend_schema(request=EPRebalancePolicySerializer, responses={201: EPRebalancePolicySerializer})
    def create(self, request):
        data = validated(EPRebalancePolicySerializer, request.data)
        policy = services.ep_rebalance_policy_set(**data)
        return Response(EPRebalancePolicySerializer(policy).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=EPRebalancePolicySerializer, responses=EPRebalancePolicySerializer)
    def partial_update(self, request, pk=None):
        policy = self.get_object()
        data = validated(EPRebalancePolicySerializer, request.data, partial=True)
        data.pop("pool", None)  # a policy stays with its pool
        policy = services.ep_rebalance_policy_set(pool=policy.pool, **data)
        return Response(EPRebalancePolicySerializer(policy).data)
