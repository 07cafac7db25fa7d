from django.apps import AppConfig
from django.db.models.signals import post_migrate


class AccessConfig(AppConfig):
    name = "controlplane.access"
    label = "access"
    verbose_name = "Roles"

    def ready(self) -> None:
        from controlplane.access.roles import sync_role_groups

        # Permissions only exist after post_migrate, so the groups cannot come from a data migration.
        post_migrate.connect(sync_role_groups, sender=self, dispatch_uid="controlplane.access.sync_role_groups")
