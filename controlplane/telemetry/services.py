from datetime import datetime

from django.db import transaction

from controlplane.telemetry.models import DecodeLoadRollup, ExpertLoadRollup, TelemetryRollup


@transaction.atomic
def rollup_upsert(
    *,
    minute: datetime,
    requests: int,
    prompt_tokens: int,
    cached_tokens: int,
    generation_tokens: int,
    ttft_p50_s: float | None,
    ttft_p99_s: float | None,
    itl_p50_s: float | None,
    itl_p99_s: float | None,
    kv_store_bytes: int | None,
) -> TelemetryRollup:
    """Writes the minute's row, replacing one written before (a retried write is harmless)."""
    rollup, _ = TelemetryRollup.objects.update_or_create(
        minute=minute,
        defaults={
            "requests": requests,
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
            "generation_tokens": generation_tokens,
            "ttft_p50_s": ttft_p50_s,
            "ttft_p99_s": ttft_p99_s,
            "itl_p50_s": itl_p50_s,
            "itl_p99_s": itl_p99_s,
            "kv_store_bytes": kv_store_bytes,
        },
    )
    return rollup


@transaction.atomic
def rollups_delete_before(*, cutoff: datetime) -> int:
    """Deletes the rows of minutes that start before `cutoff`; returns how many."""
    deleted, _ = TelemetryRollup.objects.filter(minute__lt=cutoff).delete()
    expert_deleted, _ = ExpertLoadRollup.objects.filter(minute__lt=cutoff).delete()
    decode_deleted, _ = DecodeLoadRollup.objects.filter(minute__lt=cutoff).delete()
    return deleted + expert_deleted + decode_deleted


@transaction.atomic
def expert_load_rollup_upsert(
    *, pool: str, layout_version: int, minute: datetime, slot_loads: list[list[int]]
) -> ExpertLoadRollup:
    """Writes a pool's expert loads of one minute under one layout, replacing one written before."""
    rollup, _ = ExpertLoadRollup.objects.update_or_create(
        pool=pool, layout_version=layout_version, minute=minute, defaults={"slot_loads": slot_loads}
    )
    return rollup


@transaction.atomic
def decode_load_rollup_upsert(
    *, pool: str, minute: datetime, peak_requests_in_flight: int, peak_kv_tokens: int
) -> DecodeLoadRollup:
    """Writes a pool's decode load peaks of one minute, keeping the higher of each figure where a row
    was written before: every gateway's collector sees the same workers, at ticks of its own."""
    rollup, created = DecodeLoadRollup.objects.select_for_update().get_or_create(
        pool=pool,
        minute=minute,
        defaults={"peak_requests_in_flight": peak_requests_in_flight, "peak_kv_tokens": peak_kv_tokens},
    )
    if not created:
        rollup.peak_requests_in_flight = max(rollup.peak_requests_in_flight, peak_requests_in_flight)
        rollup.peak_kv_tokens = max(rollup.peak_kv_tokens, peak_kv_tokens)
        rollup.save(update_fields=["peak_requests_in_flight", "peak_kv_tokens"])
    return rollup
