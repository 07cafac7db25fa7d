"""Database connections of code that runs outside requests (a supervisor's timer, a reaper thread)."""

from django.db import connections


def close_stale_connections() -> None:
    """What Django does around each request: drop this thread's connections that broke or outlived
    CONN_MAX_AGE. A connection inside a transaction is someone else's (a test's) and is left alone."""
    for connection in connections.all(initialized_only=True):
        if not connection.in_atomic_block:
            connection.close_if_unusable_or_obsolete()
