"""The data plane's CURVE keypair (workers.curve): a new version per rotation, and its export to a
host's key file. Both are audited; the secret key is never written to an event."""

import socket
from pathlib import Path
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Max

from controlplane.common.errors import DomainValidationError
from controlplane.topology import selectors
from controlplane.topology.models import DataPlaneKey, ScalingAction
from controlplane.topology.services.events import scaling_event_record
from workers.curve import CurveKey, generate_key, write_key_file


@transaction.atomic
def data_plane_key_create(*, actor: Any = None) -> DataPlaneKey:
    """A new version of the keypair, after the latest: the one exports write from now on. Running
    processes keep the version they started with (see DataPlaneKey)."""
    latest = DataPlaneKey.objects.aggregate(latest=Max("version"))["latest"] or 0
    key = generate_key(latest + 1)
    row = DataPlaneKey.objects.create(
        version=key.version, public_key=key.public_key.decode(), secret_key=key.secret_key.decode()
    )
    scaling_event_record(
        action=ScalingAction.DATA_PLANE_KEY_CREATED,
        actor=actor,
        reason=f"data-plane CURVE key version {row.version} created",
        before={"version": latest or None},
        after={"version": row.version, "public_key": row.public_key},
    )
    return row


def data_plane_key_ensure(*, actor: Any = None) -> DataPlaneKey:
    """The latest version, or version 1 created now when there is none (a first deployment's setup,
    which may run twice at once: one creates it, the other reads it)."""
    if (row := selectors.data_plane_key_latest()) is not None:
        return row
    try:
        return data_plane_key_create(actor=actor)
    except IntegrityError:  # another process created version 1 first
        return selectors.data_plane_key_latest()


@transaction.atomic
def data_plane_key_export(
    *, path: str | Path, version: int | None = None, overwrite: bool = False, actor: Any = None
) -> CurveKey:
    """Write a version (default: the latest) to the key file at `path` (mode 0600; an existing file
    raises FileExistsError unless `overwrite`), recording on which host and where."""
    row = selectors.data_plane_key_latest() if version is None else selectors.data_plane_key_by_version(version)
    if row is None:
        which = "no data-plane key exists yet" if version is None else f"no data-plane key version {version}"
        raise DomainValidationError(f"{which}: create one with `manage.py create_data_plane_key`")
    key = CurveKey(version=row.version, public_key=row.public_key.encode(), secret_key=row.secret_key.encode())
    destination = f"{socket.gethostname()}:{Path(path).resolve()}"
    scaling_event_record(
        action=ScalingAction.DATA_PLANE_KEY_EXPORTED,
        actor=actor,
        reason=f"data-plane CURVE key version {row.version} written to {destination}",
        after={"version": row.version, "destination": destination},
    )
    write_key_file(path, key, overwrite=overwrite)  # last: a failed write leaves no event
    return key
