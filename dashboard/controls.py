"""The dashboard's operator controls: drain and resume an instance, scale a pool, pause or resume its
autoscaler. Each is a POST that calls the control plane's service as the signed-in user, after the same
permission the API asks for; the page shows the outcome (or the refusal) as a message."""

from collections.abc import Callable
from functools import wraps

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.shortcuts import get_object_or_404, redirect
from django.views.decorators.http import require_POST

from controlplane.common.errors import ConflictError, DomainValidationError
from controlplane.topology import services
from controlplane.topology.models import EngineInstance, Pool
from dashboard.access import viewer_required

SCALE_PERMISSION = "topology.scale_pool"
DRAIN_PERMISSION = "topology.drain_engineinstance"
REASON_MAX_CHARS = 2000


def control(permission: str) -> Callable:
    """A POST-only view for viewers who also hold `permission` (403 otherwise); a refusal by the
    service becomes an error message, and every outcome goes back to the dashboard."""

    def decorate(view: Callable) -> Callable:
        @viewer_required
        @require_POST
        @wraps(view)
        def guarded(request, *args, **kwargs):
            if not request.user.has_perm(permission):
                raise PermissionDenied
            try:
                messages.success(request, view(request, *args, **kwargs))
            except (DomainValidationError, ConflictError) as error:
                messages.error(request, str(error))
            return redirect("dashboard")

        return guarded

    return decorate


def _reason(request) -> str:
    return request.POST.get("reason", "")[:REASON_MAX_CHARS] or "from the dashboard"


@control(SCALE_PERMISSION)
def pool_scale(request, pool_id: int) -> str:
    pool = get_object_or_404(Pool, pk=pool_id)
    raw = request.POST.get("target_instances", "")
    if not raw.isdigit():
        raise DomainValidationError(fields={"target_instances": [f"must be a whole number, got {raw[:20]!r}"]})
    pool = services.pool_scale(pool=pool, target_instances=int(raw), actor=request.user, reason=_reason(request))
    return f"pool {pool} scaled to {pool.target_instances}"


@control(SCALE_PERMISSION)
def pool_autoscale(request, pool_id: int) -> str:
    paused = request.POST.get("paused") == "1"
    pool = services.pool_autoscale_pause(
        pool=get_object_or_404(Pool, pk=pool_id), paused=paused, actor=request.user, reason=_reason(request)
    )
    return f"autoscaler {'paused' if pool.autoscale_paused else 'resumed'} on pool {pool}"


@control(DRAIN_PERMISSION)
def instance_drain(request, instance_id: int) -> str:
    instance = services.instance_drain(
        instance=get_object_or_404(EngineInstance, pk=instance_id), actor=request.user, reason=_reason(request)
    )
    return f"instance {instance} is draining"


@control(DRAIN_PERMISSION)
def instance_resume(request, instance_id: int) -> str:
    instance = services.instance_resume(
        instance=get_object_or_404(EngineInstance, pk=instance_id), actor=request.user, reason=_reason(request)
    )
    return f"instance {instance} resumed"
