"""This process's CURVE key for the data plane (workers.curve), from SLUICE_CURVE_KEY_FILE: loaded on
first use and kept, so a process goes on with the key it started with until it restarts."""

from functools import cache

from django.conf import settings

from workers.curve import CurveKey, load_key_file


def data_plane_key() -> CurveKey | None:
    """The key, or None when no key file is configured; curve.CurveError naming a bad file."""
    path = settings.SLUICE_CURVE_KEY_FILE
    return _load(path) if path else None


@cache
def _load(path: str) -> CurveKey:
    return load_key_file(path)
