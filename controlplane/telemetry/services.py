from datetime import datetime

from django.db import transaction

from controlplane.telemetry.latency_histogram import Histogram
from controlplane.telemetry.models import ExpertLoadRollup, TelemetryRollup


@transaction.atomic
def rollup_upsert(
    *,
    minute: datetime,
    collector: str,
    requests: int,
    prompt_tokens: int,
    cached_tokens: int,
    generation_tokens: int,
    ttft_histogram: Histogram,
    itl_histogram: Histogram,
    kv_store_bytes: int | None,
) -> TelemetryRollup:
    """Writes the collector's row of the minute, replacing one it wrote before (a retried write is
    harmless); other collectors' rows of the minute stay, to be merged by the selectors."""
    rollup, _ = TelemetryRollup.objects.update_or_create(
        minute=minute,
        collector=collector,
        defaults={
            "requests": requests,
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
            "generation_tokens": generation_tokens,
            "ttft_histogram": ttft_histogram,
            "itl_histogram": itl_histogram,
            "kv_store_bytes": kv_store_bytes,
        },
    )
    return rollup


@transaction.atomic
def rollups_delete_before(*, cutoff: datetime) -> int:
    """Deletes the rows of minutes that start before `cutoff`; returns how many."""
    deleted, _ = TelemetryRollup.objects.filter(minute__lt=cutoff).delete()
    expert_deleted, _ = ExpertLoadRollup.objects.filter(minute__lt=cutoff).delete()
    return deleted + expert_deleted


@transaction.atomic
def expert_load_rollup_upsert(
    *, pool: str, layout_version: int, minute: datetime, slot_loads: list[list[int]]
) -> ExpertLoadRollup:
    """Writes a pool's expert loads of one minute under one layout, replacing one written before."""
    rollup, _ = ExpertLoadRollup.objects.update_or_create(
        pool=pool, layout_version=layout_version, minute=minute, defaults={"slot_loads": slot_loads}
    )
    return rollup
