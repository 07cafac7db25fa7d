"""The latest snapshot of this process's collector, for whoever renders live figures (the dashboard)."""

import time
from datetime import UTC, datetime

from controlplane.telemetry.snapshot import empty_snapshot

WINDOW_S = 60
# A snapshot older than this is from a collector that stopped: showing it would pass old figures off
# as live ones.
STALE_AFTER_S = 5.0

_latest: tuple[float, dict] | None = None  # (time.monotonic() when published, snapshot)


def publish(snapshot: dict) -> None:
    global _latest
    _latest = (time.monotonic(), snapshot)


def forget() -> None:
    global _latest
    _latest = None


def current_snapshot() -> dict:
    """The latest snapshot, or an empty one (no workers, every rate and percentile None or zero)
    when the collector has not published one lately."""
    if _latest is not None and time.monotonic() - _latest[0] <= STALE_AFTER_S:
        return _latest[1]
    return empty_snapshot(datetime.now(UTC), WINDOW_S)
