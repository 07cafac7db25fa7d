from rest_framework import serializers

from controlplane.api.inputs import ReasonSerializer
from controlplane.topology.models import Cluster, EngineInstance, Node, Pool, ScalingEvent

POOL_LIMIT_FIELDS = ["scale_up_max_per_window", "scale_down_max_per_window", "scale_window_s"]
# The precision of the pool's workers (EngineArgs.quantization, kv_cache_dtype).
POOL_PRECISION_FIELDS = ["quantization", "kv_cache_dtype"]


class ClusterSerializer(serializers.ModelSerializer):
    class Meta:
        model = Cluster
        fields = ["id", "name", "created_at"]
        read_only_fields = ["id", "created_at"]


class NodeSerializer(serializers.ModelSerializer):
    class Meta:
        model = Node
        fields = ["id", "cluster", "hostname", "accelerator_kind", "num_accelerators"]
        read_only_fields = ["id"]


class PoolSerializer(serializers.ModelSerializer):
    class Meta:
        model = Pool
        fields = [
            "id",
            "cluster",
            "name",
            "kind",
            "model",
            "min_instances",
            "max_instances",
            "target_instances",
            *POOL_LIMIT_FIELDS,
            "num_experts",
            "expert_slots_per_rank",
            *POOL_PRECISION_FIELDS,
            "drain_grace_s",
            "autoscale_paused",
            "last_manual_scale_at",
            "created_at",
            "updated_at",
        ]
        # Pausing the autoscaler is an audited action of its own (POST .../autoscale/); drain_grace_s
        # is edited in the admin, and a drain may override it (its grace_s).
        read_only_fields = [
            "id",
            "drain_grace_s",
            "autoscale_paused",
            "last_manual_scale_at",
            "created_at",
            "updated_at",
        ]


class PoolBoundsSerializer(serializers.ModelSerializer):
    """What PATCH may change: bounds, rate limits and the precision of the workers started from then on.
    The target is not here: changing it is scaling (POST .../scale/)."""

    class Meta:
        model = Pool
        fields = ["min_instances", "max_instances", *POOL_LIMIT_FIELDS, *POOL_PRECISION_FIELDS]


class PoolScaleSerializer(ReasonSerializer):
    # The service checks it against the pool's bounds.
    target_instances = serializers.IntegerField(min_value=0)


class PoolAutoscaleSerializer(ReasonSerializer):
    paused = serializers.BooleanField()


class PoolStartInstanceSerializer(ReasonSerializer):
    # The service checks that the node is in the pool's cluster.
    node = serializers.CharField(max_length=255, help_text="The node's hostname: its agent consumes node.<hostname>.")


class EngineInstanceSerializer(serializers.ModelSerializer):
    class Meta:
        model = EngineInstance
        fields = [
            "id",
            "pool",
            "node",
            "worker_id",
            "state",
            "request_endpoint",
            "heartbeat_endpoint",
            "ep_size",
            "started_at",
            "registered_at",
            "last_heartbeat_at",
            "num_running",
            "num_waiting",
            "kv_usage",
            "max_num_seqs",
            "kv_capacity_tokens",
            "pid",
            "ttl_policy_version",
            "ep_layout_version",
        ]
        read_only_fields = fields


class ScalingEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = ScalingEvent
        fields = [
            "id",
            "created_at",
            "actor",
            "actor_label",
            "action",
            "pool",
            "instance",
            "reason",
            "before",
            "after",
            "why",
        ]
        read_only_fields = fields
