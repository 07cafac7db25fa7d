"""The collector's arithmetic, free of clocks and I/O: request samples, percentiles, the rolling
window behind the live snapshot and the totals of the minute being rolled up."""

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from controlplane.telemetry import latency_histogram
from controlplane.telemetry.latency_histogram import Histogram
from controlplane.telemetry.worker_counters import CounterSums, SpecSums

# Requests whose latencies the live window keeps at most: the percentiles of a busy window are then
# those of its last this-many requests, and the memory stays bounded.
MAX_SAMPLES = 10_000


@dataclass(frozen=True, slots=True)
class RequestSample:
    """One finished API call, as the gateway measured it."""

    ttft_s: float | None  # None when no token came (an error, or a client gone early)
    inter_token_s: tuple[float, ...]
    prompt_tokens: int
    cached_tokens: int
    generation_tokens: int
    finish_reasons: tuple[str, ...] = ()  # one per choice that finished
    e2e_s: tuple[float, ...] = ()  # one per choice that finished
    tpot_s: tuple[float, ...] = ()  # one per choice that finished with more than one token
    # As the workers timed them, one per worker and choice (controlplane.gateway.usage).
    queue_s: tuple[float, ...] = ()
    prefill_s: tuple[float, ...] = ()
    decode_s: tuple[float, ...] = ()


def percentile(ordered: Sequence[float], fraction: float) -> float:
    """Nearest rank: the smallest value with at least `fraction` of the values at or below it."""
    return ordered[max(math.ceil(fraction * len(ordered)) - 1, 0)]


def percentiles(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)
    return {"p50": percentile(ordered, 0.5), "p90": percentile(ordered, 0.9), "p99": percentile(ordered, 0.99)}


@dataclass(slots=True)
class Totals:
    """Counts and latency samples of a set of requests."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    inter_token_s: list[float] = field(default_factory=list)

    def add(self, sample: RequestSample) -> None:
        self.requests += 1
        self.prompt_tokens += sample.prompt_tokens
        self.cached_tokens += sample.cached_tokens
        self.generation_tokens += sample.generation_tokens
        if sample.ttft_s is not None:
            self.ttft_s.append(sample.ttft_s)
        self.inter_token_s.extend(sample.inter_token_s)

    @property
    def cache_hit_rate(self) -> float | None:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None


class RequestWindow:
    """The requests that finished in the last `span_s` seconds (at most MAX_SAMPLES of them)."""

    def __init__(self, span_s: float) -> None:
        self.span_s = span_s
        self._samples: deque[tuple[float, RequestSample]] = deque(maxlen=MAX_SAMPLES)

    def add(self, at: float, sample: RequestSample) -> None:
        self._samples.append((at, sample))

    def totals(self, now: float) -> Totals:
        while self._samples and self._samples[0][0] <= now - self.span_s:
            self._samples.popleft()
        totals = Totals()
        for _, sample in self._samples:
            totals.add(sample)
        return totals


def minute_start(at: float) -> float:
    return at - at % 60


@dataclass(slots=True)
class MinuteTotals:
    """The minute starting at `start` (epoch seconds) as one collector saw it: what its rollup row
    will hold. Latencies go into fixed-bucket histograms, which rollups of the same minute from other
    gateways add to (controlplane.telemetry.latency_histogram), so every request of the minute counts."""

    start: float
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    ttft_histogram: Histogram = field(default_factory=dict)
    itl_histogram: Histogram = field(default_factory=dict)
    kv_store_bytes: int | None = None  # the last the heartbeats reported in the minute
    # From the workers' counters (worker_counters): engine steps and their seconds, and the KV
    # handoffs received and their seconds (each until its KV was usable), over every worker.
    engine_steps: int = 0
    engine_step_seconds: float = 0.0
    kv_handoffs: int = 0
    kv_handoff_seconds: float = 0.0
    # Speculative decoding over every worker (worker_counters.SpecSums).
    spec: SpecSums = field(default_factory=SpecSums)

    def add(self, sample: RequestSample) -> None:
        self.requests += 1
        self.prompt_tokens += sample.prompt_tokens
        self.cached_tokens += sample.cached_tokens
        self.generation_tokens += sample.generation_tokens
        if sample.ttft_s is not None:
            latency_histogram.add(self.ttft_histogram, (sample.ttft_s,))
        latency_histogram.add(self.itl_histogram, sample.inter_token_s)

    def add_counts(self, counts: CounterSums) -> None:
        received = counts.received()
        self.engine_steps += counts.steps
        self.engine_step_seconds += counts.step_seconds
        self.kv_handoffs += received.transfers
        self.kv_handoff_seconds += received.seconds
        self.spec.add(counts.spec)

    def rollup_fields(self, collector: str) -> dict:
        """The keyword arguments of services.rollup_upsert, for the collector named `collector`."""
        return {
            "minute": datetime.fromtimestamp(self.start, UTC),
            "collector": collector,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "generation_tokens": self.generation_tokens,
            "ttft_histogram": self.ttft_histogram,
            "itl_histogram": self.itl_histogram,
            "kv_store_bytes": self.kv_store_bytes,
            "engine_steps": self.engine_steps,
            "engine_step_seconds": self.engine_step_seconds,
            "kv_handoffs": self.kv_handoffs,
            "kv_handoff_seconds": self.kv_handoff_seconds,
            "spec_drafts": self.spec.drafts,
            "spec_draft_tokens": self.spec.draft_tokens,
            "spec_accepted_tokens": self.spec.accepted_tokens,
            "spec_steps": self.spec.steps,
            "spec_budget_tokens": self.spec.budget_tokens,
        }
