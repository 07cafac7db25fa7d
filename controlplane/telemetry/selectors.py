from datetime import datetime, timedelta

from django.db.models import Max
from django.utils import timezone

from controlplane.telemetry.decode_loads import DecodePeak
from controlplane.telemetry.models import DecodeLoadRollup, ExpertLoadRollup, TelemetryRollup

ROLLUP_FIELDS = (
    "minute",
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "generation_tokens",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "kv_store_bytes",
)


def rollup_series(*, minutes: int = 60) -> list[dict]:
    """The rollups of the last `minutes` minutes, oldest first, each with its cache hit rate
    (cached prompt tokens / prompt tokens; None for a minute without prompt tokens)."""
    since = timezone.now() - timedelta(minutes=minutes)
    rows = TelemetryRollup.objects.filter(minute__gte=since).order_by("minute").values(*ROLLUP_FIELDS)
    return [
        {**row, "cache_hit_rate": row["cached_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else None}
        for row in rows
    ]


def expert_load_rollups(*, pool: str, since: datetime) -> list[ExpertLoadRollup]:
    """A pool's expert-load minutes from `since` on, oldest first."""
    return list(ExpertLoadRollup.objects.filter(pool=pool, minute__gte=since).order_by("minute"))


def decode_load_peak(*, pool: str, since: datetime, until: datetime) -> DecodePeak | None:
    """A pool's highest decode load over the minutes from `since` up to `until`; None: no row."""
    peaks = DecodeLoadRollup.objects.filter(pool=pool, minute__gte=since, minute__lt=until).aggregate(
        requests=Max("peak_requests_in_flight"), kv_tokens=Max("peak_kv_tokens")
    )
    if peaks["requests"] is None:
        return None
    return DecodePeak(peaks["requests"], peaks["kv_tokens"])
