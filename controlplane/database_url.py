"""DATABASE_URL → Django DATABASES entry (PostgreSQL or SQLite)."""

from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit

SQLITE_BUSY_TIMEOUT_S = 20


class DatabaseUrlError(ValueError):
    pass


def parse_database_url(url: str) -> dict:
    parts = urlsplit(url)
    if parts.scheme in ("postgres", "postgresql"):
        if not parts.path.strip("/"):
            raise DatabaseUrlError(f"DATABASE_URL {url!r} names no database")
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": unquote(parts.path.lstrip("/")),
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": str(parts.port or ""),
            "OPTIONS": dict(parse_qsl(parts.query)),
        }
    if parts.scheme == "sqlite":
        # sqlite:///relative/path or sqlite:////absolute/path
        path = parts.path[1:] if parts.path.startswith("/") else parts.path
        if not path:
            raise DatabaseUrlError(f"DATABASE_URL {url!r} names no SQLite file")
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(Path(path)),
            # The embedded default has several processes writing (gateway, registry heartbeats, the
            # admin): WAL lets readers run beside the one writer, IMMEDIATE takes the write lock at
            # BEGIN so a transaction never fails half-way on an upgrade, and writers queue, not fail.
            "OPTIONS": {
                "timeout": SQLITE_BUSY_TIMEOUT_S,
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
        }
    raise DatabaseUrlError(f"DATABASE_URL scheme {parts.scheme!r} is not supported; use postgres:// or sqlite://")
