"""The embedded default's developer API key, kept in var/ so `make run` prints the same key each time.

One file per database: stacks started from one checkout with different DATABASE_URLs would otherwise
overwrite each other's file and print keys their own database does not hold.
"""

import hashlib
import os
from pathlib import Path

from django.conf import settings
from django.db import connection

from controlplane.tenants.services import api_key_authenticate, api_key_create, tenant_get_or_create

DEV_TENANT = "dev"


def dev_api_key() -> str:
    """Reuse this database's stored key while it still authenticates (not revoked, and the database
    was not reset since); otherwise make a new one."""
    path = dev_api_key_path()
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


def dev_api_key_path() -> Path:
    """var/dev-api-key-<hash of the database's identity>: engine, host, port and name (a SQLite file
    by its absolute path), never the credentials."""
    database = connection.settings_dict
    name = database["NAME"]
    if database["ENGINE"].endswith("sqlite3"):
        name = os.path.abspath(name)
    identity = "\0".join(str(part) for part in (database["ENGINE"], database["HOST"], database["PORT"], name))
    return Path(settings.VAR_DIR) / f"dev-api-key-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"
