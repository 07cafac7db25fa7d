"""`python manage.py create_data_plane_key`: a new version of the cluster's CURVE keypair.

The first run creates version 1; each later run rotates (version N+1). Export it to every host with
`export_data_plane_key FILE`, then restart the data plane's processes: a process keeps the version
it loaded at start, and processes on different versions cannot talk to each other."""

from django.core.management.base import BaseCommand

from controlplane.topology.services import data_plane_key_create


class Command(BaseCommand):
    help = "Create a new version of the data plane's CURVE keypair (the first, or a rotation)."

    def handle(self, *args, **options) -> None:
        row = data_plane_key_create()
        self.stdout.write(f"data-plane key version {row.version} created (public key {row.public_key})")
