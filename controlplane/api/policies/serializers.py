from rest_framework import serializers

from controlplane.api.inputs import SlugRelatedField
from controlplane.policies.models import EPLayout, EPRebalancePolicy, TrafficClass, TTLPolicy

# Far above any real model (DeepSeek V3 has 256 routed experts); the checks build sets of this size.
MAX_LOGICAL_EXPERTS = 65536
# Far above any real model's MoE layers (DeepSeek V3 has 58).
MAX_LAYERS = 1024


class TrafficClassSerializer(serializers.ModelSerializer):
    class Meta:
        model = TrafficClass
        fields = ["id", "name", "description", "created_at"]
        read_only_fields = ["id", "created_at"]


class TTLPolicySerializer(serializers.ModelSerializer):
    traffic_class = SlugRelatedField(slug_field="name", queryset=TrafficClass.objects.all())

    class Meta:
        model = TTLPolicy
        fields = ["id", "traffic_class", "version", "ttl_seconds", "reason", "created_by_label", "created_at"]
        read_only_fields = ["id", "version", "created_by_label", "created_at"]
        extra_kwargs = {"reason": {"max_length": 2000}}


class TTLPolicyCurrentSerializer(serializers.Serializer):
    """What workers apply."""

    revision = serializers.IntegerField(help_text="Grows with every new TTL version of any class.")
    ttl_s = serializers.DictField(child=serializers.IntegerField(), help_text="Seconds per traffic class.")
    default_class = serializers.CharField(help_text="The class of blocks whose class has no policy.")


class EPLayoutSerializer(serializers.ModelSerializer):
    placement = serializers.ListField(
        child=serializers.ListField(
            child=serializers.ListField(child=serializers.IntegerField(), max_length=MAX_LOGICAL_EXPERTS),
            min_length=1,
            max_length=MAX_LOGICAL_EXPERTS,
        ),
        min_length=1,
        max_length=MAX_LAYERS,
        help_text=(
            "placement[layer][rank][slot] = logical expert id; every rank holds the same number of slots and "
            "every layer gives every expert at least one."
        ),
    )
    num_logical_experts = serializers.IntegerField(min_value=1, max_value=MAX_LOGICAL_EXPERTS)

    class Meta:
        model = EPLayout
        fields = [
            "id",
            "pool",
            "version",
            "num_logical_experts",
            "placement",
            "is_active",
            "created_by_label",
            "created_at",
            "activated_at",
            "rationale",
        ]
        read_only_fields = [
            "id",
            "version",
            "is_active",
            "created_by_label",
            "created_at",
            "activated_at",
            "rationale",
        ]


class EPRebalancePolicySerializer(serializers.ModelSerializer):
    class Meta:
        model = EPRebalancePolicy
        fields = ["id", "pool", "mode", "interval_s", "window_s", "target_balance", "min_window_tokens", "last_run_at"]
        read_only_fields = ["id", "last_run_at"]
        extra_kwargs = {
            "target_balance": {"min_value": 1.0},
            "interval_s": {"min_value": 1},
            "window_s": {"min_value": 1},
        }
