"""The embedded default's developer API key, kept in var/ so `make run` prints the same key each time."""

import os
from pathlib import Path

from django.conf import settings

from controlplane.tenants.services import api_key_authenticate, api_key_create, tenant_get_or_create

DEV_TENANT = "dev"


def dev_api_key(path: Path | None = None) -> str:
    """Reuse the stored key while it still authenticates (not revoked); otherwise make a new one."""
    path = path or Path(settings.VAR_DIR) / "dev-api-key"
    if path.exists():
        raw_key = path.read_text().strip()
        if api_key_authenticate(raw_key=raw_key) is not None:
            return raw_key
    _, raw_key = api_key_create(tenant=tenant_get_or_create(name=DEV_TENANT))
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written owner-only: the raw key exists nowhere else (the database keeps its hash).
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(raw_key + "\n")
    return raw_key
