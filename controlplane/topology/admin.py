from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from controlplane.common.errors import ConflictError, DomainValidationError
from controlplane.topology.models import Cluster, DataPlaneKey, EngineInstance, Node, Pool, ScalingEvent
from controlplane.topology.services import (
    instance_drain,
    instance_stop,
    pool_create,
    pool_set_precision,
    pool_update_bounds,
)


@admin.register(Cluster)
class ClusterAdmin(admin.ModelAdmin):
    list_display = ["name", "created_at"]
    search_fields = ["name"]


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ["hostname", "cluster", "accelerator_kind", "num_accelerators"]
    list_filter = ["cluster", "accelerator_kind"]
    search_fields = ["hostname"]


@admin.register(Pool)
class PoolAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "cluster",
        "kind",
        "model",
        "quantization",
        "kv_cache_dtype",
        "min_instances",
        "target_instances",
        "max_instances",
    ]
    list_filter = ["cluster", "kind"]
    search_fields = ["name", "model"]
    readonly_fields = ["created_at", "updated_at"]

    def get_readonly_fields(self, request: HttpRequest, obj: Pool | None = None) -> list[str]:
        # The target changes only by scaling (audited, rate limited): through the API, not this form.
        fixed = ["cluster", "name", "kind", "target_instances"] if obj is not None else []
        return [*self.readonly_fields, *fixed]

    def save_model(self, request: HttpRequest, obj: Pool, form, change: bool) -> None:
        if change:
            pool_update_bounds(
                pool=obj,
                min_instances=obj.min_instances,
                max_instances=obj.max_instances,
                scale_up_max_per_window=obj.scale_up_max_per_window,
                scale_down_max_per_window=obj.scale_down_max_per_window,
                scale_window_s=obj.scale_window_s,
            )
            pool_set_precision(pool=obj, quantization=obj.quantization, kv_cache_dtype=obj.kv_cache_dtype)
            # Fields without a service to change them (model, experts) are plain configuration.
            Pool.objects.filter(pk=obj.pk).update(
                model=obj.model, num_experts=obj.num_experts, expert_slots_per_rank=obj.expert_slots_per_rank
            )
            return
        created = pool_create(
            **{name: getattr(obj, name) for name in form.cleaned_data if name != "id"},
        )
        obj.pk = created.pk


@admin.register(EngineInstance)
class EngineInstanceAdmin(admin.ModelAdmin):
    list_display = ["worker_id", "pool", "state", "num_running", "num_waiting", "kv_usage", "last_heartbeat_at"]
    list_filter = ["state", "pool"]
    list_select_related = ["pool", "pool__cluster"]
    search_fields = ["worker_id"]
    actions = ["drain", "stop"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # workers register themselves

    def has_change_permission(self, request: HttpRequest, obj: EngineInstance | None = None) -> bool:
        return False  # the state changes through the actions, the rest is what the worker reports

    def _apply(self, request: HttpRequest, queryset: QuerySet[EngineInstance], service, verb: str) -> None:
        done = 0
        for instance in queryset:
            try:
                service(instance=instance, actor=request.user, reason=f"admin: {verb}")
                done += 1
            except (ConflictError, DomainValidationError) as error:
                self.message_user(request, str(error), messages.WARNING)
        self.message_user(request, f"{verb.capitalize()} requested for {done} instance(s).", messages.SUCCESS)

    @admin.action(description="Drain selected instances", permissions=["drain"])
    def drain(self, request: HttpRequest, queryset: QuerySet[EngineInstance]) -> None:
        self._apply(request, queryset, instance_drain, "drain")

    @admin.action(description="Stop selected instances", permissions=["stop"])
    def stop(self, request: HttpRequest, queryset: QuerySet[EngineInstance]) -> None:
        self._apply(request, queryset, instance_stop, "stop")

    def has_drain_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("topology.drain_engineinstance")

    def has_stop_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("topology.stop_engineinstance")


@admin.register(ScalingEvent)
class ScalingEventAdmin(admin.ModelAdmin):
    list_display = ["created_at", "action", "actor_label", "pool", "instance", "reason"]
    list_filter = ["action", "pool"]
    list_select_related = ["pool", "pool__cluster", "instance"]
    search_fields = ["actor_label", "reason", "instance__worker_id"]
    date_hierarchy = "created_at"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: ScalingEvent | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: ScalingEvent | None = None) -> bool:
        return False


@admin.register(DataPlaneKey)
class DataPlaneKeyAdmin(admin.ModelAdmin):
    """Which key versions exist and their public halves; keys are made by `create_data_plane_key` and
    the secret half never reaches a page."""

    list_display = ["version", "public_key", "created_at"]
    fields = ["version", "public_key", "created_at"]
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: DataPlaneKey | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: DataPlaneKey | None = None) -> bool:
        return False
