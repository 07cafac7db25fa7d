"""`python manage.py export_data_plane_key FILE [--key-version N] [--overwrite] [--create-if-none]`

Writes the cluster's CURVE key (the latest version unless --key-version names one) to FILE, mode 0600,
for the processes of one host: `--curve-key-file FILE` for workers, SLUICE_CURVE_KEY_FILE for every
process (workers, gateways, the registry, Celery workers, node agents). An existing FILE is left
alone unless --overwrite. --create-if-none creates version 1 first when the database holds no key (a
first deployment's one-shot setup)."""

from django.core.management.base import BaseCommand, CommandError

from controlplane.common.errors import DomainValidationError
from controlplane.topology.services import data_plane_key_ensure, data_plane_key_export


class Command(BaseCommand):
    help = "Write the data plane's CURVE key to a key file (mode 0600) for one host's processes."

    def add_arguments(self, parser) -> None:
        parser.add_argument("file", help="where to write the key file")
        parser.add_argument("--key-version", type=int, help="the version to export (default: the latest)")
        parser.add_argument("--overwrite", action="store_true", help="replace FILE if it exists")
        parser.add_argument(
            "--create-if-none", action="store_true", help="create version 1 first when no key exists yet"
        )

    def handle(self, *args, file: str, key_version: int | None, overwrite: bool, create_if_none: bool, **options):
        if create_if_none:
            data_plane_key_ensure()
        try:
            key = data_plane_key_export(path=file, version=key_version, overwrite=overwrite)
        except DomainValidationError as error:
            raise CommandError(error.message) from None
        except FileExistsError:
            raise CommandError(f"{file} exists; pass --overwrite to replace it") from None
        except OSError as error:
            raise CommandError(f"cannot write {file}: {error.strerror}") from None
        self.stdout.write(f"data-plane key version {key.version} written to {file} (mode 0600)")
