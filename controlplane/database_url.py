"""DATABASE_URL → Django DATABASES entry (PostgreSQL or SQLite)."""

from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlsplit


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
        return {"ENGINE": "django.db.backends.sqlite3", "NAME": str(Path(path))}
    raise DatabaseUrlError(f"DATABASE_URL scheme {parts.scheme!r} is not supported; use postgres:// or sqlite://")
