"""The checks `sluice` makes before it starts anything: each problem is one line for the user, not a
traceback from deep inside a child process minutes later."""

import os
import socket

from django.db import DEFAULT_DB_ALIAS, DatabaseError, connections

from controlplane.cli.bad_input import BadInput
from workers.engine.weights import resolve_model
from workers.protocol.errors import ModelLoadError, UnknownModelError

# An unreachable host would otherwise keep libpq waiting for the kernel's TCP timeout (minutes).
DATABASE_CONNECT_TIMEOUT_S = 5


def check_database() -> None:
    """The database DATABASE_URL names (else the SQLite file in the data directory) takes a connection."""
    connection = connections[DEFAULT_DB_ALIAS]
    try:
        if connection.vendor == "postgresql":
            params = {**connection.get_connection_params(), "connect_timeout": DATABASE_CONNECT_TIMEOUT_S}
            connection.get_new_connection(params).close()
        else:
            connection.ensure_connection()
            connection.close()
    # A connection made outside ensure_connection raises the driver's own errors, not Django's.
    except (DatabaseError, connection.Database.Error) as error:
        raise BadInput(f"cannot connect to the database (DATABASE_URL): {_first_line(error)}") from None


def check_port_free(host: str, port: int) -> None:
    """Nothing listens on host:port yet (binding with SO_REUSEADDR, as the gateway's uvicorn does)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as error:
        raise BadInput(f"cannot resolve the host {host!r}: {error.strerror}") from None
    try:
        with socket.create_server((host, port), family=family):
            pass
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise BadInput(f"cannot listen on {host}:{port}: {reason}") from None


def check_model(model: str) -> None:
    """`model` resolves as serve's workers will resolve it; a packaged model is converted here, once."""
    try:
        resolve_model(model, progress=True)
    except (UnknownModelError, ModelLoadError) as error:
        raise BadInput(_first_line(error)) from None


def _first_line(error: Exception) -> str:
    """Drivers' messages run on with hints on further lines."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
