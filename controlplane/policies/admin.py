from django import forms
from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from controlplane.common.errors import ConflictError, DomainValidationError
from controlplane.policies.models import EPLayout, EPRebalancePolicy, TrafficClass, TTLPolicy
from controlplane.policies.services import ep_layout_activate, ep_layout_check, ep_layout_create, ttl_policy_set


@admin.register(TrafficClass)
class TrafficClassAdmin(admin.ModelAdmin):
    list_display = ["name", "description", "created_at"]
    search_fields = ["name"]


@admin.register(TTLPolicy)
class TTLPolicyAdmin(admin.ModelAdmin):
    """Add-only: adding creates the class's next version through the service; rows are never edited."""

    list_display = ["traffic_class", "version", "ttl_seconds", "created_by_label", "created_at"]
    list_filter = ["traffic_class"]
    fields = ["traffic_class", "ttl_seconds", "reason"]

    def get_fields(self, request: HttpRequest, obj: TTLPolicy | None = None) -> list[str]:
        return self.fields if obj is None else [*self.fields, "version", "created_by_label", "created_at"]

    def has_change_permission(self, request: HttpRequest, obj: TTLPolicy | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: TTLPolicy | None = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: TTLPolicy, form, change: bool) -> None:
        created = ttl_policy_set(
            traffic_class=obj.traffic_class, ttl_seconds=obj.ttl_seconds, actor=request.user, reason=obj.reason
        )
        obj.pk, obj.version = created.pk, created.version


class EPLayoutForm(forms.ModelForm):
    class Meta:
        model = EPLayout
        fields = ["pool", "num_logical_experts", "placement"]

    def clean(self) -> dict:
        data = super().clean()
        if "pool" in data and not self.errors:
            try:
                ep_layout_check(
                    pool=data["pool"], num_logical_experts=data["num_logical_experts"], placement=data["placement"]
                )
            except DomainValidationError as error:
                for name, field_errors in error.fields.items():
                    for message in field_errors:
                        self.add_error(name if name in self.fields else None, message)
        return data


@admin.register(EPLayout)
class EPLayoutAdmin(admin.ModelAdmin):
    """Add-only (a layout is never edited; a new one gets the next version); activate is an action."""

    form = EPLayoutForm
    list_display = ["pool", "version", "num_logical_experts", "is_active", "activated_at", "created_by_label"]
    list_filter = ["pool", "is_active"]
    actions = ["activate"]

    def get_fields(self, request: HttpRequest, obj: EPLayout | None = None) -> list[str]:
        fields = ["pool", "num_logical_experts", "placement"]
        details = ["version", "is_active", "activated_at", "created_by_label", "rationale"]
        return fields if obj is None else [*fields, *details]

    def has_change_permission(self, request: HttpRequest, obj: EPLayout | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: EPLayout | None = None) -> bool:
        return False

    def save_model(self, request: HttpRequest, obj: EPLayout, form, change: bool) -> None:
        created = ep_layout_create(
            pool=obj.pool, num_logical_experts=obj.num_logical_experts, placement=obj.placement, actor=request.user
        )
        obj.pk, obj.version = created.pk, created.version

    @admin.action(description="Activate the selected layout (and push it to the pool)", permissions=["apply"])
    def activate(self, request: HttpRequest, queryset: QuerySet[EPLayout]) -> None:
        if queryset.count() != 1:
            self.message_user(request, "Select exactly one layout to activate.", messages.WARNING)
            return
        try:
            layout = ep_layout_activate(layout=queryset.get(), actor=request.user, reason="admin: activate")
        except (ConflictError, DomainValidationError) as error:
            self.message_user(request, str(error), messages.ERROR)
            return
        self.message_user(request, f"Activated {layout}.", messages.SUCCESS)

    def has_apply_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("policies.apply_eplayout")


@admin.register(EPRebalancePolicy)
class EPRebalancePolicyAdmin(admin.ModelAdmin):
    """Per MoE pool: off, propose (activate the proposed layout above) or auto."""

    list_display = ["pool", "mode", "interval_s", "window_s", "target_balance", "last_run_at"]
    list_filter = ["mode"]
    fields = ["pool", "mode", "interval_s", "window_s", "target_balance", "min_window_tokens", "last_run_at"]
    readonly_fields = ["last_run_at"]
