from rest_framework import serializers

from controlplane.tenants.models import ApiKey, Tenant, TenantUsage


class TenantSerializer(serializers.ModelSerializer):
    class Meta:
        model = Tenant
        fields = [
            "id",
            "name",
            "rate_limit_rpm",
            "token_quota_per_day",
            "share_prefix_cache",
            "max_requests_in_flight",
            "max_queued_prompt_tokens",
            "fair_share_weight",
            "created_at",
        ]
        read_only_fields = ["id", "created_at"]
        # The model's check constraints, as field-level messages.
        extra_kwargs = {
            "rate_limit_rpm": {"min_value": 1},
            "max_requests_in_flight": {"min_value": 1},
            "max_queued_prompt_tokens": {"min_value": 1},
        }


class ApiKeySerializer(serializers.ModelSerializer):
    """A key as anyone sees it after creation: its prefix, never its hash."""

    tenant_name = serializers.CharField(source="tenant.name", read_only=True)

    class Meta:
        model = ApiKey
        fields = ["id", "tenant", "tenant_name", "name", "prefix", "created_at", "last_used_at", "revoked_at"]
        read_only_fields = fields


class ApiKeyCreateSerializer(serializers.ModelSerializer):
    class Meta:
        model = ApiKey
        fields = ["tenant", "name"]


class ApiKeyCreatedSerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="The raw key. Shown once: only its hash is stored.")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]
        read_only_fields = fields


class TenantUsageSerializer(serializers.ModelSerializer):
    total_tokens = serializers.IntegerField(read_only=True, help_text="Prompt plus completion tokens.")

    class Meta:
        model = TenantUsage
        fields = [
            "id",
            "tenant",
            "day",
            "requests",
            "prompt_tokens",
            "cached_tokens",
            "completion_tokens",
            "total_tokens",
        ]
        read_only_fields = fields
