"""Encode pools' load in the telemetry collector: at each tick, per pool, the image patches asked of
its encoders since the tick before (those they finished plus the growth of those they hold), the
patches they hold together, and the patches per second one of them encodes (their measured capacity);
over the minute in progress the patches asked, the most held at once and the latest capacity, written
as an EncodeLoadRollup when it ends. The autoscaler sizes encode pools from those rows, as prefill
demand comes from TelemetryRollup."""

from collections.abc import Iterable
from dataclasses import dataclass

from workers.protocol.messages import WorkerHeartbeat

ENCODE_ROLE = "encode"


@dataclass(frozen=True, slots=True)
class EncodeMinute:
    patches_demanded: int
    peak_patches_in_flight: int
    # The mean of what the pool's encoders that measured it report (0: none has yet).
    patches_per_second: float


def patches_demanded(before: WorkerHeartbeat | None, now: WorkerHeartbeat) -> int:
    """Patches that came to an encoder between two of its heartbeats: those it finished plus the growth
    of those it holds. `before` None, or from before a restart (another started_at): since it started."""
    if before is None or before.started_at != now.started_at:
        return now.num_patches_encoded + now.patches_in_flight
    finished = now.num_patches_encoded - before.num_patches_encoded
    return max(finished + now.patches_in_flight - before.patches_in_flight, 0)


def measured_capacity(encoders: Iterable[WorkerHeartbeat]) -> float:
    """Patches per second one encoder encodes: the mean over those that measured it; 0 when none has."""
    measured = [beat.patches_per_second for beat in encoders if beat.patches_per_second > 0]
    return sum(measured) / len(measured) if measured else 0.0


class EncodeLoads:
    """Per encode pool, the minute in progress. A worker first heard counts nothing of its past (it is
    not this minute's); one that restarted counts everything since its start."""

    def __init__(self) -> None:
        self._last: dict[str, WorkerHeartbeat] = {}  # each encoder's heartbeat read at the tick before
        self.minute: dict[str, EncodeMinute] = {}

    def add(self, workers: Iterable[WorkerHeartbeat]) -> None:
        last, self._last = self._last, {}
        by_pool: dict[str, list[WorkerHeartbeat]] = {}
        demanded: dict[str, int] = {}
        for beat in workers:
            if beat.role != ENCODE_ROLE or not beat.pool:
                continue
            self._last[beat.worker_id] = beat
            by_pool.setdefault(beat.pool, []).append(beat)
            before = last.get(beat.worker_id)
            grown = 0 if before is None else patches_demanded(before, beat)
            demanded[beat.pool] = demanded.get(beat.pool, 0) + grown
        for pool, encoders in by_pool.items():
            so_far = self.minute.get(pool, EncodeMinute(0, 0, 0.0))
            capacity = measured_capacity(encoders)
            self.minute[pool] = EncodeMinute(
                patches_demanded=so_far.patches_demanded + demanded[pool],
                peak_patches_in_flight=max(so_far.peak_patches_in_flight, sum(b.patches_in_flight for b in encoders)),
                patches_per_second=capacity or so_far.patches_per_second,
            )

    def end_minute(self) -> dict[str, EncodeMinute]:
        ended, self.minute = self.minute, {}
        return ended
