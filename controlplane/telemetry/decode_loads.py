"""Decode load peaks in the telemetry collector: at each tick, per pool, the requests in flight
(running and waiting) and KV tokens in use of its decode and mixed workers together, and the most of
each over the minute in progress, written as a DecodeLoadRollup when it ends. The autoscaler's quota
guard reads the look-back's peak from those rows, as prefill demand comes from TelemetryRollup."""

from collections.abc import Sequence
from dataclasses import dataclass

from workers.protocol.messages import WorkerHeartbeat

DECODE_ROLES = ("decode", "mixed")


@dataclass(frozen=True, slots=True)
class DecodePeak:
    requests_in_flight: int
    kv_tokens: int

    def max(self, other: "DecodePeak") -> "DecodePeak":
        return DecodePeak(max(self.requests_in_flight, other.requests_in_flight), max(self.kv_tokens, other.kv_tokens))


def decode_loads(workers: Sequence[WorkerHeartbeat]) -> dict[str, DecodePeak]:
    """{pool: its decode workers' load now}; workers of no pool are not counted."""
    loads: dict[str, DecodePeak] = {}
    for beat in workers:
        if beat.role not in DECODE_ROLES or not beat.pool:
            continue
        load = DecodePeak(beat.num_running + beat.num_waiting, round(beat.kv_usage * beat.kv_capacity_tokens))
        previous = loads.get(beat.pool, DecodePeak(0, 0))
        loads[beat.pool] = DecodePeak(
            previous.requests_in_flight + load.requests_in_flight, previous.kv_tokens + load.kv_tokens
        )
    return loads


class DecodeLoadPeaks:
    """The highest per-pool decode load seen at any tick of the minute in progress."""

    def __init__(self) -> None:
        self.minute: dict[str, DecodePeak] = {}

    def add(self, workers: Sequence[WorkerHeartbeat]) -> None:
        for pool, load in decode_loads(workers).items():
            self.minute[pool] = load.max(self.minute.get(pool, load))

    def end_minute(self) -> dict[str, DecodePeak]:
        ended, self.minute = self.minute, {}
        return ended
