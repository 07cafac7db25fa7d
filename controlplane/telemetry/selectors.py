from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.db.models import Max, Sum
from django.utils import timezone

from controlplane.telemetry import latency_histogram
from controlplane.telemetry.decode_loads import DecodePeak
from controlplane.telemetry.models import (
    DecodeLoadRollup,
    EncodeLoadRollup,
    ExpertLoadRollup,
    KVStoreGC,
    TelemetryRollup,
)
from controlplane.telemetry.worker_counters import SpecSums

COUNT_FIELDS = ("requests", "prompt_tokens", "cached_tokens", "generation_tokens")
# A store GC that missed this many of its runs' reports is taken for stopped.
GC_MISSED_REPORTS = 3
GC_REPORT_SLACK_S = 5.0


def rollup_series(*, minutes: int = 60) -> list[dict]:
    """The last `minutes` minutes, oldest first, each merged from every gateway's row of it: counts
    summed, TTFT and inter-token latency percentiles (p50, p99) from the summed histograms, the store's
    size as the largest any gateway saw (they read the same store), the cache hit rate (cached
    prompt tokens / prompt tokens; None for a minute without prompt tokens), and the mean engine step
    and KV handoff times and speculative decoding's mean accepted length, draft tokens verified per
    draft and budget per verify step (spec_*, worker_counters.SpecSums.summary) from the row that
    counted the most of them (every gateway hears the same workers; None for a minute without any)."""
    since = timezone.now() - timedelta(minutes=minutes)
    rows = TelemetryRollup.objects.filter(minute__gte=since).order_by("minute")
    by_minute: dict[datetime, list[TelemetryRollup]] = defaultdict(list)
    for row in rows:
        by_minute[row.minute].append(row)
    return [_merged(minute, parts) for minute, parts in by_minute.items()]


def rollup_token_totals(*, since: datetime, until: datetime) -> dict[datetime, tuple[int, int]]:
    """(prompt tokens, cached prompt tokens) of each minute in [since, until) that has rows, summed
    over every gateway's row of it."""
    totals = (
        TelemetryRollup.objects.filter(minute__gte=since, minute__lt=until)
        .values("minute")
        .annotate(prompt=Sum("prompt_tokens"), cached=Sum("cached_tokens"))
    )
    return {row["minute"]: (row["prompt"], row["cached"]) for row in totals}


def _merged(minute: datetime, parts: list[TelemetryRollup]) -> dict:
    counts = {name: sum(getattr(part, name) for part in parts) for name in COUNT_FIELDS}
    ttft = latency_histogram.merge(part.ttft_histogram for part in parts)
    itl = latency_histogram.merge(part.itl_histogram for part in parts)
    store_sizes = [part.kv_store_bytes for part in parts if part.kv_store_bytes is not None]
    steps = max(parts, key=lambda part: part.engine_steps)
    handoffs = max(parts, key=lambda part: part.kv_handoffs)
    spec = max(parts, key=lambda part: part.spec_steps)
    spec_sums = SpecSums(
        drafts=spec.spec_drafts,
        draft_tokens=spec.spec_draft_tokens,
        accepted_tokens=spec.spec_accepted_tokens,
        steps=spec.spec_steps,
        budget_tokens=spec.spec_budget_tokens,
    )
    return {
        "minute": minute,
        **counts,
        "ttft_p50_s": latency_histogram.percentile(ttft, 0.5),
        "ttft_p99_s": latency_histogram.percentile(ttft, 0.99),
        "itl_p50_s": latency_histogram.percentile(itl, 0.5),
        "itl_p99_s": latency_histogram.percentile(itl, 0.99),
        "kv_store_bytes": max(store_sizes) if store_sizes else None,
        "cache_hit_rate": counts["cached_tokens"] / counts["prompt_tokens"] if counts["prompt_tokens"] else None,
        "step_time_mean_s": steps.engine_step_seconds / steps.engine_steps if steps.engine_steps else None,
        "kv_handoff_mean_s": handoffs.kv_handoff_seconds / handoffs.kv_handoffs if handoffs.kv_handoffs else None,
        **{f"spec_{name}": value for name, value in spec_sums.summary().items()},
    }


def expert_load_rollups(*, pool: str, since: datetime) -> list[ExpertLoadRollup]:
    """A pool's expert-load minutes from `since` on, oldest first."""
    return list(ExpertLoadRollup.objects.filter(pool=pool, minute__gte=since).order_by("minute"))


def kv_store_gcs_reporting(*, now: datetime | None = None) -> list[KVStoreGC]:
    """The store GC processes whose last report is recent (within a few of their intervals): those
    running now. A stopped one's counters disappear from /metrics as a stopped worker's do."""
    now = now or timezone.now()
    return [
        gc
        for gc in KVStoreGC.objects.all()
        if (now - gc.reported_at).total_seconds() <= GC_MISSED_REPORTS * gc.interval_s + GC_REPORT_SLACK_S
    ]


def decode_load_peak(*, pool: str, since: datetime, until: datetime) -> DecodePeak | None:
    """A pool's highest decode load over the minutes from `since` up to `until`; None: no row."""
    peaks = DecodeLoadRollup.objects.filter(pool=pool, minute__gte=since, minute__lt=until).aggregate(
        requests=Max("peak_requests_in_flight"), kv_tokens=Max("peak_kv_tokens")
    )
    if peaks["requests"] is None:
        return None
    return DecodePeak(peaks["requests"], peaks["kv_tokens"])


@dataclass(frozen=True, slots=True)
class EncodeLoad:
    patches_per_s: list[float]  # asked of the pool in each minute, oldest first
    patches_per_s_per_encoder: float  # the latest capacity one encoder measured; 0: none did


def encode_load(*, pool: str, since: datetime, until: datetime) -> EncodeLoad:
    """An encode pool's patches per second asked in each whole minute from `since` up to `until`, and
    its latest measured capacity. No row in that time: no minutes (no collector heard its encoders);
    otherwise a minute without a row counts as none asked."""
    rows = list(EncodeLoadRollup.objects.filter(pool=pool, minute__gte=since, minute__lt=until).order_by("minute"))
    if not rows:
        return EncodeLoad(patches_per_s=[], patches_per_s_per_encoder=0.0)
    demanded = {row.minute: row.patches_demanded for row in rows}
    minutes = int((until - since).total_seconds() // 60)
    measured = [row.patches_per_second for row in rows if row.patches_per_second > 0]
    return EncodeLoad(
        patches_per_s=[demanded.get(since + timedelta(minutes=i), 0) / 60.0 for i in range(minutes)],
        patches_per_s_per_encoder=measured[-1] if measured else 0.0,
    )
