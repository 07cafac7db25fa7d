"""The four roles as Django groups, and the permissions each holds.

Patterns are "<app_label>.<codename>" with shell wildcards, matched against the permissions that exist
(Django's add/change/delete/view per model plus each model's Meta.permissions), so a new model's
permissions join the roles at the next migrate without editing this table.
"""

from fnmatch import fnmatchcase
from typing import Any

from django.apps import apps as global_apps
from django.contrib.auth.management import create_permissions
from django.db import DEFAULT_DB_ALIAS

MANAGED_APPS = ("topology", "policies", "tenants")

ROLE_PERMISSIONS: dict[str, frozenset[str]] = {
    "admin": frozenset({"topology.*", "policies.*", "tenants.*"}),
    "operator": frozenset(
        {
            "topology.view_*",
            "policies.view_*",
            "topology.scale_pool",
            "topology.change_pool",
            "topology.drain_engineinstance",
            "topology.stop_engineinstance",
        }
    ),
    "auditor": frozenset({"topology.view_*", "policies.view_*", "tenants.view_*"}),
    # Tenants reach their own rows through their API keys, never through Django permissions.
    "tenant": frozenset(),
}


def matches_role(role: str, app_label: str, codename: str) -> bool:
    return any(fnmatchcase(f"{app_label}.{codename}", pattern) for pattern in ROLE_PERMISSIONS[role])


def sync_role_groups(*, using: str = DEFAULT_DB_ALIAS, apps: Any = global_apps, verbosity: int = 0, **_: Any) -> None:
    """Creates the role groups and sets exactly their permissions; safe to run again (post_migrate)."""
    if not {"auth", "contenttypes"} <= {config.label for config in apps.get_app_configs()}:
        return
    # post_migrate runs per app in INSTALLED_APPS order; make sure the permissions we assign exist now.
    for label in MANAGED_APPS:
        create_permissions(global_apps.get_app_config(label), verbosity=verbosity, using=using, apps=apps)
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    candidates = list(
        Permission.objects.using(using)
        .filter(content_type__app_label__in=MANAGED_APPS)
        .values_list("pk", "content_type__app_label", "codename")
    )
    for role in ROLE_PERMISSIONS:
        group, _ = Group.objects.using(using).get_or_create(name=role)
        group.permissions.set([pk for pk, app_label, codename in candidates if matches_role(role, app_label, codename)])
