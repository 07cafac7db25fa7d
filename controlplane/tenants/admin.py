from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from controlplane.tenants.models import ApiKey, Tenant, TenantUsage
from controlplane.tenants.services import api_key_revoke


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "rate_limit_rpm",
        "token_quota_per_day",
        "max_requests_in_flight",
        "max_queued_prompt_tokens",
        "fair_share_weight",
        "share_prefix_cache",
        "created_at",
    ]
    search_fields = ["name"]
    readonly_fields = ["cache_namespace", "created_at"]


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    list_display = ["prefix", "name", "tenant", "created_at", "last_used_at", "revoked_at"]
    list_filter = ["revoked_at"]
    list_select_related = ["tenant"]
    search_fields = ["prefix", "name", "tenant__name"]
    fields = ["tenant", "name", "prefix", "created_at", "last_used_at", "revoked_at"]
    readonly_fields = fields
    actions = ["revoke"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        # The raw key is shown once, at creation: `manage.py create_api_key --tenant NAME`.
        return False

    @admin.action(description="Revoke selected API keys")
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiKey]) -> None:
        for api_key in queryset:
            api_key_revoke(api_key=api_key)
        self.message_user(request, f"Revoked {len(queryset)} key(s).", messages.SUCCESS)


@admin.register(TenantUsage)
class TenantUsageAdmin(admin.ModelAdmin):
    """Read-only: the gateway records usage."""

    list_display = ["day", "tenant", "requests", "prompt_tokens", "cached_tokens", "completion_tokens"]
    list_filter = ["day"]
    list_select_related = ["tenant"]
    search_fields = ["tenant__name"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: TenantUsage | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: TenantUsage | None = None) -> bool:
        return False
