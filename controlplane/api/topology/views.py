"""clusters/, nodes/, pools/, instances/ and scaling-events/: operators, auditors and admins; no API keys."""

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response

from controlplane.api.inputs import DrainSerializer, ReasonSerializer, validated
from controlplane.api.topology.filters import EngineInstanceFilter, NodeFilter, PoolFilter, ScalingEventFilter
from controlplane.api.topology.serializers import (
    POOL_PRECISION_FIELDS,
    ClusterSerializer,
    EngineInstanceSerializer,
    NodeSerializer,
    PoolAutoscaleSerializer,
    PoolBoundsSerializer,
    PoolScaleSerializer,
    PoolSerializer,
    PoolStartInstanceSerializer,
    ScalingEventSerializer,
)
from controlplane.topology import selectors, services
from controlplane.topology.models import Cluster, Node

READ = mixins.ListModelMixin, mixins.RetrieveModelMixin
TRANSITION_REFUSED = "The instance's state does not allow this transition."


class ClusterViewSet(*READ, viewsets.GenericViewSet):
    """Clusters: groups of nodes whose workers share a KV block store."""

    queryset = Cluster.objects.all()
    serializer_class = ClusterSerializer
    ordering_fields = ["id", "name", "created_at"]
    ordering = ["name"]
    action_permissions = {
        "list": "topology.view_cluster",
        "retrieve": "topology.view_cluster",
        "create": "topology.add_cluster",
    }

    @extend_schema(request=ClusterSerializer, responses={201: ClusterSerializer})
    def create(self, request):
        cluster = services.cluster_create(**validated(ClusterSerializer, request.data))
        return Response(ClusterSerializer(cluster).data, status=status.HTTP_201_CREATED)


class NodeViewSet(*READ, viewsets.GenericViewSet):
    """Hosts; workers also create theirs when they register."""

    queryset = Node.objects.all()
    serializer_class = NodeSerializer
    filterset_class = NodeFilter
    ordering_fields = ["id", "hostname"]
    ordering = ["cluster_id", "hostname"]
    action_permissions = {
        "list": "topology.view_node",
        "retrieve": "topology.view_node",
        "create": "topology.add_node",
    }

    @extend_schema(request=NodeSerializer, responses={201: NodeSerializer})
    def create(self, request):
        node = services.node_create(**validated(NodeSerializer, request.data))
        return Response(NodeSerializer(node).data, status=status.HTTP_201_CREATED)


class PoolViewSet(*READ, viewsets.GenericViewSet):
    """Pools of one kind of worker (encode, prefill, decode, or mixed), each scaled on its own."""

    serializer_class = PoolSerializer
    filterset_class = PoolFilter
    ordering_fields = ["id", "name", "kind", "created_at"]
    ordering = ["cluster__name", "name"]
    action_permissions = {
        "list": "topology.view_pool",
        "retrieve": "topology.view_pool",
        "create": "topology.add_pool",
        "partial_update": "topology.change_pool",
        "scale": "topology.scale_pool",
        "autoscale": "topology.scale_pool",
        "start_instance": "topology.scale_pool",
    }
    error_responses = {"scale": {"409": "The pool's scale-up or scale-down limit for the window is reached."}}

    def get_queryset(self):
        return selectors.pool_list()

    @extend_schema(request=PoolSerializer, responses={201: PoolSerializer})
    def create(self, request):
        pool = services.pool_create(**validated(PoolSerializer, request.data))
        return Response(PoolSerializer(pool).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=PoolBoundsSerializer, responses=PoolSerializer)
    def partial_update(self, request, pk=None):
        pool = self.get_object()
        changes = dict(validated(PoolBoundsSerializer, request.data, partial=True))
        precision = {name: changes.pop(name) for name in POOL_PRECISION_FIELDS if name in changes}
        bounds = {"min_instances": pool.min_instances, "max_instances": pool.max_instances, **changes}
        # Bounds first: they may be refused, the precision (checked by the serializer) not.
        pool = services.pool_update_bounds(pool=pool, **bounds)
        if precision:
            pool = services.pool_set_precision(pool=pool, **precision)
        return Response(PoolSerializer(pool).data)

    @extend_schema(
        request=PoolScaleSerializer,
        responses=PoolSerializer,
        description="Sets the desired instance count; scaling down drains the least-loaded instances. Audited.",
    )
    @action(detail=True, methods=["post"])
    def scale(self, request, pk=None):
        data = validated(PoolScaleSerializer, request.data)
        pool = services.pool_scale(pool=self.get_object(), actor=request.user, **data)
        return Response(PoolSerializer(pool).data)

    @extend_schema(
        request=PoolAutoscaleSerializer,
        responses=PoolSerializer,
        description="Pauses or resumes the autoscaler on this pool (a paused pool is left as it is). Audited.",
    )
    @action(detail=True, methods=["post"])
    def autoscale(self, request, pk=None):
        data = validated(PoolAutoscaleSerializer, request.data)
        pool = services.pool_autoscale_pause(pool=self.get_object(), actor=request.user, **data)
        return Response(PoolSerializer(pool).data)

    @extend_schema(
        request=PoolStartInstanceSerializer,
        responses={201: EngineInstanceSerializer},
        description="Starts one more instance of the pool on a node: its node agent starts the worker, which "
        "becomes ready when it registers (or failed, with the reason, when no agent takes the start in time).",
    )
    @action(detail=True, methods=["post"], url_path="start-instance")
    def start_instance(self, request, pk=None):
        data = validated(PoolStartInstanceSerializer, request.data)
        instance = services.instance_start(
            pool=self.get_object(), node_hostname=data["node"], actor=request.user, reason=data["reason"]
        )
        return Response(EngineInstanceSerializer(instance).data, status=status.HTTP_201_CREATED)


class EngineInstanceViewSet(*READ, viewsets.GenericViewSet):
    """Engine workers as registered; drain, stop and resume send them control messages."""

    serializer_class = EngineInstanceSerializer
    filterset_class = EngineInstanceFilter
    ordering_fields = ["id", "worker_id", "registered_at", "last_heartbeat_at", "kv_usage"]
    ordering = ["pool_id", "worker_id"]
    action_permissions = {
        "list": "topology.view_engineinstance",
        "retrieve": "topology.view_engineinstance",
        "drain": "topology.drain_engineinstance",
        "stop": "topology.stop_engineinstance",
        # Resuming cancels a drain, so whoever may drain may resume.
        "resume": "topology.drain_engineinstance",
    }
    error_responses = {name: {"409": TRANSITION_REFUSED} for name in ("drain", "stop", "resume")}

    def get_queryset(self):
        return selectors.instance_list()

    def _transition(self, request, service, serializer=ReasonSerializer):
        data = validated(serializer, request.data)
        instance = service(instance=self.get_object(), actor=request.user, **data)
        return Response(EngineInstanceSerializer(instance).data)

    @extend_schema(
        request=DrainSerializer,
        responses=EngineInstanceSerializer,
        description="ready → draining; a decode worker's requests migrate to others after grace_s.",
    )
    @action(detail=True, methods=["post"])
    def drain(self, request, pk=None):
        return self._transition(request, services.instance_drain, DrainSerializer)

    @extend_schema(request=ReasonSerializer, responses=EngineInstanceSerializer, description="→ stopped.")
    @action(detail=True, methods=["post"])
    def stop(self, request, pk=None):
        return self._transition(request, services.instance_stop)

    @extend_schema(request=ReasonSerializer, responses=EngineInstanceSerializer, description="draining → ready.")
    @action(detail=True, methods=["post"])
    def resume(self, request, pk=None):
        return self._transition(request, services.instance_resume)


class ScalingEventViewSet(*READ, viewsets.GenericViewSet):
    """The audit trail: every scaling action, newest first. Read-only."""

    serializer_class = ScalingEventSerializer
    filterset_class = ScalingEventFilter
    ordering_fields = ["id", "created_at"]
    ordering = ["-created_at", "-id"]
    action_permissions = {"list": "topology.view_scalingevent", "retrieve": "topology.view_scalingevent"}

    def get_queryset(self):
        return selectors.scaling_event_list()
