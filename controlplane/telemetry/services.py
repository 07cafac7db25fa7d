from datetime import UTC, datetime

import msgspec
from django.db import transaction

from controlplane.telemetry.latency_histogram import Histogram
from controlplane.telemetry.models import (
    DecodeLoadRollup,
    EncodeLoadRollup,
    ExpertLoadRollup,
    KVStoreGC,
    TelemetryRollup,
)
from workers.kvstore.gc_process import StoreGCReport


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
    engine_steps: int = 0,
    engine_step_seconds: float = 0.0,
    kv_handoffs: int = 0,
    kv_handoff_seconds: float = 0.0,
    spec_drafts: int = 0,
    spec_draft_tokens: int = 0,
    spec_accepted_tokens: int = 0,
    spec_steps: int = 0,
    spec_budget_tokens: float = 0.0,
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
            "engine_steps": engine_steps,
            "engine_step_seconds": engine_step_seconds,
            "kv_handoffs": kv_handoffs,
            "kv_handoff_seconds": kv_handoff_seconds,
            "spec_drafts": spec_drafts,
            "spec_draft_tokens": spec_draft_tokens,
            "spec_accepted_tokens": spec_accepted_tokens,
            "spec_steps": spec_steps,
            "spec_budget_tokens": spec_budget_tokens,
        },
    )
    return rollup


@transaction.atomic
def rollups_delete_before(*, cutoff: datetime) -> int:
    """Deletes the rows of minutes that start before `cutoff`, and the reports of store GCs silent
    since then; returns how many."""
    deleted, _ = TelemetryRollup.objects.filter(minute__lt=cutoff).delete()
    expert_deleted, _ = ExpertLoadRollup.objects.filter(minute__lt=cutoff).delete()
    gc_deleted, _ = KVStoreGC.objects.filter(reported_at__lt=cutoff).delete()
    decode_deleted, _ = DecodeLoadRollup.objects.filter(minute__lt=cutoff).delete()
    return deleted + expert_deleted + gc_deleted + decode_deleted


@transaction.atomic
def kv_store_gc_record(*, report: StoreGCReport) -> KVStoreGC:
    """Writes a store GC's report of its latest run over its previous one."""
    fields = msgspec.structs.asdict(report)
    gc_id = fields.pop("gc_id")
    for name in ("started_at", "reported_at"):
        fields[name] = datetime.fromtimestamp(fields[name], UTC)
    gc, _ = KVStoreGC.objects.update_or_create(gc_id=gc_id, defaults=fields)
    return gc


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


@transaction.atomic
def encode_load_rollup_upsert(
    *, pool: str, minute: datetime, patches_demanded: int, peak_patches_in_flight: int, patches_per_second: float
) -> EncodeLoadRollup:
    """Writes an encode pool's load of one minute, keeping the higher of each figure where a row was
    written before: every gateway's collector hears the same encoders, at ticks of its own (one that
    started in the middle of the minute counted less of it)."""
    figures = {
        "patches_demanded": patches_demanded,
        "peak_patches_in_flight": peak_patches_in_flight,
        "patches_per_second": patches_per_second,
    }
    rollup, created = EncodeLoadRollup.objects.select_for_update().get_or_create(
        pool=pool, minute=minute, defaults=figures
    )
    if not created:
        for name, value in figures.items():
            setattr(rollup, name, max(getattr(rollup, name), value))
        rollup.save(update_fields=list(figures))
    return rollup
