"""The counters the workers' heartbeats carry since each worker started (engine steps, KV handoffs,
image patches encoded, speculative decoding's drafts), as what happened lately. At each collector
tick a worker counts what its counters grew by since the heartbeat read at the tick before: nothing
for a worker first heard (its past is not this window's), everything for one that restarted (a new
started_at). The ticks' counts are summed over the live window per worker (the snapshot sums them
per pool and over the cluster) and, by the collector, over the minute in progress for its rollup."""

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from workers.protocol.messages import HandoffTotals, HistogramCounts, SpecDecodeTotals, WorkerHeartbeat

DIRECTIONS = ("sent", "received")
NO_HANDOFFS = HandoffTotals(num_transfers=0, num_bytes=0, seconds=0.0)


@dataclass(slots=True)
class HandoffSums:
    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class SpecSums:
    """Speculative decoding's counters (workers.engine.spec.stats): drafts (one per request and verify
    step), their draft tokens verified and accepted, and the verify steps and the draft tokens they
    verified in all (the budget)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0
    budget_tokens: float = 0.0

    def add(self, other: "SpecSums") -> None:
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self.steps += other.steps
        self.budget_tokens += other.budget_tokens

    def summary(self) -> dict:
        """The mean accepted length (tokens a request gains per verifying step, its bonus token
        included), draft tokens verified per draft, and the budget per verify step; None without them."""
        return {
            "acceptance_length": 1 + self.accepted_tokens / self.drafts if self.drafts else None,
            "verified_per_draft": self.draft_tokens / self.drafts if self.drafts else None,
            "budget_per_step": self.budget_tokens / self.steps if self.steps else None,
        }


@dataclass(slots=True)
class CounterSums:
    steps: int = 0
    step_seconds: float = 0.0
    step_tokens: float = 0.0
    handoffs: dict[tuple[str, str], HandoffSums] = field(default_factory=dict)  # by (direction, backend)
    patches: int = 0  # image patches an encode worker encoded
    spec: SpecSums = field(default_factory=SpecSums)  # speculative decoding

    def add(self, other: "CounterSums") -> None:
        self.steps += other.steps
        self.step_seconds += other.step_seconds
        self.step_tokens += other.step_tokens
        self.patches += other.patches
        self.spec.add(other.spec)
        for key, sums in other.handoffs.items():
            mine = self.handoffs.setdefault(key, HandoffSums())
            mine.transfers += sums.transfers
            mine.bytes += sums.bytes
            mine.seconds += sums.seconds

    def received(self) -> HandoffSums:
        """The handoffs received over every backend: each timed until its KV was usable."""
        total = HandoffSums()
        for (direction, _), sums in self.handoffs.items():
            if direction == "received":
                total.transfers += sums.transfers
                total.seconds += sums.seconds
        return total

    def engine(self, seconds: float) -> dict:
        """Steps per second over `seconds`, the mean step time and tokens per step (None without steps)."""
        return {
            "steps_per_s": self.steps / seconds,
            "step_time_mean_s": self.step_seconds / self.steps if self.steps else None,
            "tokens_per_step": self.step_tokens / self.steps if self.steps else None,
        }

    def kv_handoff(self, seconds: float) -> dict:
        """The mean seconds per handoff received, and per backend and direction the transfers, bytes per
        second over `seconds` and mean seconds per transfer (None without one)."""
        received = self.received()
        return {
            "received_mean_s": received.seconds / received.transfers if received.transfers else None,
            "by_backend": [
                {
                    "backend": backend,
                    "direction": direction,
                    "transfers": sums.transfers,
                    "bytes_per_s": sums.bytes / seconds,
                    "mean_s": sums.seconds / sums.transfers if sums.transfers else None,
                }
                for (direction, backend), sums in sorted(self.handoffs.items(), key=_by_backend)
            ],
        }


def _by_backend(item: tuple[tuple[str, str], HandoffSums]) -> tuple[str, str]:
    (direction, backend), _ = item
    return backend, direction


def summed(parts: Iterable[CounterSums]) -> CounterSums:
    total = CounterSums()
    for part in parts:
        total.add(part)
    return total


def counts_since(before: WorkerHeartbeat | None, now: WorkerHeartbeat) -> CounterSums:
    """What `now`'s counters grew by since `before` (None: since the worker started)."""
    steps = _grown(before.step_seconds if before else None, now.step_seconds)
    tokens = _grown(before.step_tokens if before else None, now.step_tokens)
    patches = now.num_patches_encoded - (before.num_patches_encoded if before else 0)
    sums = CounterSums(steps=steps[0], step_seconds=steps[1], step_tokens=tokens[1], patches=patches)
    sums.spec = _spec_grown(before.spec_decode if before else None, now.spec_decode)
    for direction in DIRECTIONS:
        earlier = getattr(before, f"handoff_{direction}") if before else {}
        for backend, totals in getattr(now, f"handoff_{direction}").items():
            previous = earlier.get(backend, NO_HANDOFFS)
            sums.handoffs[(direction, backend)] = HandoffSums(
                totals.num_transfers - previous.num_transfers,
                totals.num_bytes - previous.num_bytes,
                totals.seconds - previous.seconds,
            )
    return sums


def _spec_grown(before: SpecDecodeTotals | None, now: SpecDecodeTotals | None) -> SpecSums:
    if now is None:
        return SpecSums()
    budget = _grown(before.budget if before else None, now.budget)
    return SpecSums(
        drafts=now.num_drafts - (before.num_drafts if before else 0),
        draft_tokens=now.num_draft_tokens - (before.num_draft_tokens if before else 0),
        accepted_tokens=now.num_accepted_tokens - (before.num_accepted_tokens if before else 0),
        steps=budget[0],
        budget_tokens=budget[1],
    )


def _grown(before: HistogramCounts | None, now: HistogramCounts | None) -> tuple[int, float]:
    """(observations, their sum) added to a histogram since `before`."""
    if now is None:
        return 0, 0.0
    if before is None:
        return sum(now.counts), now.total
    return sum(now.counts) - sum(before.counts), now.total - before.total


class WorkerCounterWindow:
    """Each worker's counts of the last `window_s` seconds of ticks."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._last: dict[str, WorkerHeartbeat] = {}  # the heartbeat read at the previous tick, by worker
        self._recent: deque[tuple[float, str, CounterSums]] = deque()

    def add(self, now: float, workers: Iterable[WorkerHeartbeat]) -> CounterSums:
        """Count this tick's heartbeats; returns the tick's counts summed over the cluster."""
        last, self._last = self._last, {}
        tick = CounterSums()
        for heartbeat in workers:
            self._last[heartbeat.worker_id] = heartbeat
            before = last.get(heartbeat.worker_id)
            if before is None:
                continue
            counts = counts_since(before if before.started_at == heartbeat.started_at else None, heartbeat)
            self._recent.append((now, heartbeat.worker_id, counts))
            tick.add(counts)
        return tick

    def by_worker(self, now: float) -> dict[str, CounterSums]:
        while self._recent and self._recent[0][0] <= now - self.window_s:
            self._recent.popleft()
        totals: dict[str, CounterSums] = {}
        for _, worker_id, counts in self._recent:
            totals.setdefault(worker_id, CounterSums()).add(counts)
        return totals
