from controlplane.common.migrated import MigratedDatabaseCommand
from controlplane.tenants.services import api_key_create, tenant_get_or_create


class Command(MigratedDatabaseCommand):
    help = "Create an API key for a tenant (created if needed). The raw key is printed last and shown only once."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--tenant", required=True, help="tenant name")

    def handle(self, *args, tenant: str, **options) -> None:
        api_key, raw_key = api_key_create(tenant=tenant_get_or_create(name=tenant))
        self.stdout.write(f"Created key {api_key.prefix}… for tenant {tenant!r}; store it now, it is not kept.")
        # Last line, alone, so scripts can take it with `tail -n 1`.
        self.stdout.write(raw_key)
