"""Who may watch the cluster: operators, admins (superusers count as admins) and auditors; tenants may not."""

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied

from controlplane.access.principals import role_of

VIEWER_ROLES = frozenset({"admin", "operator", "auditor"})


def can_view_dashboard(user: Any) -> bool:
    return role_of(user) in VIEWER_ROLES


def viewer_required(view: Callable) -> Callable:
    """Anonymous users go to the login page; signed-in users without a viewer role get a 403."""

    @wraps(view)
    def guarded(request, *args, **kwargs):
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        if not can_view_dashboard(request.user):
            raise PermissionDenied
        return view(request, *args, **kwargs)

    return guarded


def dash_view_decorator(view: Callable, **_: Any) -> Callable:
    """PLOTLY_DASH["view_decorator"]: django-plotly-dash's own endpoints (layout, callbacks, scripts)
    answer only viewers too, or the callbacks would hand topology data to anyone."""
    return viewer_required(view)
