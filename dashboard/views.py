from django.shortcuts import render

from controlplane.topology.models import LIVE_STATES
from controlplane.topology.selectors import instance_list, pool_list

# Registers the Dash app with django-plotly-dash before its template tag looks it up.
from dashboard import telemetry_app
from dashboard.access import viewer_required
from dashboard.controls import DRAIN_PERMISSION, SCALE_PERMISSION


@viewer_required
def dashboard(request):
    """The Dash app, and the operator controls above it (disabled for users without the permission)."""
    context = {
        "app_name": telemetry_app.APP_NAME,
        "pools": pool_list(),
        "instances": instance_list().filter(state__in=LIVE_STATES),
        "can_scale": request.user.has_perm(SCALE_PERMISSION),
        "can_drain": request.user.has_perm(DRAIN_PERMISSION),
    }
    return render(request, "dashboard/index.html", context)
