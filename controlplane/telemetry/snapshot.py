"""The live snapshot the collector broadcasts: the workers' latest heartbeats, the window's request
figures and what the workers' counters say of the window (engine steps, KV handoffs, image patches
encoded), as a JSON-ready dict (its shape is the dashboard's contract). Encode workers and pools carry
an "encoder" part (patches in flight, patches encoded, the embedding cache); others have None there."""

from collections import defaultdict
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from controlplane.telemetry.encode_loads import ENCODE_ROLE, measured_capacity
from controlplane.telemetry.windows import Totals, percentiles
from controlplane.telemetry.worker_counters import CounterSums, summed
from workers.protocol.messages import SwaTotals, WorkerHeartbeat

if TYPE_CHECKING:
    from controlplane.telemetry.models import KVStoreGC


def pool_of(heartbeat: WorkerHeartbeat) -> str:
    """The pool a worker reports, or its role for one started outside any pool (tests, tiny setups)."""
    return heartbeat.pool or heartbeat.role


def empty_snapshot(at: datetime, window_s: float) -> dict:
    return build_snapshot(at=at, window_s=window_s, workers=[], totals=Totals(), elapsed_s=window_s)


def build_snapshot(
    *,
    at: datetime,
    window_s: float,
    workers: list[WorkerHeartbeat],
    totals: Totals,
    elapsed_s: float,
    expert_load: dict[str, list[list[int]]] | None = None,
    store_gcs: Sequence["KVStoreGC"] = (),
    counters: dict[str, CounterSums] | None = None,
) -> dict:
    """`totals` are the window's requests; rates divide by `elapsed_s`, the part of the window the
    collector has been running (a collector started 10 s ago has seen 10 s of traffic, not 60).
    `expert_load`: per MoE pool, tokens routed to each [layer][physical slot] in the window.
    `store_gcs`: the KV store GC processes reporting now (selectors.kv_store_gcs_reporting).
    `counters`: by worker id, what its heartbeats' counters grew by in the window (worker_counters);
    the cluster's figures count workers gone since, a pool's only those it has now."""
    seconds = max(min(elapsed_s, window_s), 1.0)
    counters = counters or {}
    cluster = summed(counters.values())
    return {
        "at": at.isoformat(),
        "window_s": window_s,
        "workers": [_worker(heartbeat, counters, seconds) for heartbeat in workers],
        "pools": _pools(workers, counters, seconds),
        "requests": totals.requests,
        "prompt_tokens_per_s": totals.prompt_tokens / seconds,
        "generation_tokens_per_s": totals.generation_tokens / seconds,
        "cache_hit_rate": totals.cache_hit_rate,
        "ttft_s": percentiles(totals.ttft_s),
        "itl_s": percentiles(totals.inter_token_s),
        "kv_store": kv_store(workers, store_gcs),
        "swa": swa_state(workers),
        "expert_load": expert_load or {},
        "engine": cluster.engine(seconds),
        "kv_handoff": cluster.kv_handoff(seconds),
        "spec_decode": cluster.spec.summary(),
    }


def kv_store(workers: list[WorkerHeartbeat], store_gcs: Sequence["KVStoreGC"] = ()) -> dict | None:
    """The global store as the workers see it: usage from any that has one (they share its index),
    capacity and watermarks from whatever runs its GC, a worker or a GC process of its own (which also
    gives the usage when no worker has a store). None when neither is there."""
    with_store = [heartbeat for heartbeat in workers if heartbeat.kv_block_tokens]
    if not with_store and not store_gcs:
        return None
    collector = next((heartbeat for heartbeat in with_store if heartbeat.kv_store_capacity_bytes), None)
    gc = store_gcs[0] if store_gcs else None
    if with_store:
        usage = max(with_store, key=lambda heartbeat: heartbeat.sent_at)
        size = {"bytes": usage.kv_store_bytes, "blocks": usage.kv_store_blocks}
    else:
        size = {"bytes": gc.num_bytes, "blocks": gc.num_blocks}
    if collector is not None:
        limits = (
            collector.kv_store_capacity_bytes,
            collector.kv_store_low_watermark,
            collector.kv_store_high_watermark,
        )
    elif gc is not None:
        limits = (gc.capacity_bytes, gc.low_watermark, gc.high_watermark)
    else:
        limits = (None, None, None)
    return {**size, "capacity_bytes": limits[0], "low_watermark": limits[1], "high_watermark": limits[2]}


def swa_state(workers: list[WorkerHeartbeat]) -> dict | None:
    """The SWA state of the workers serving sliding-window models, summed since each started; None when
    none does."""
    reporting = [heartbeat.swa for heartbeat in workers if heartbeat.swa is not None]
    if not reporting:
        return None
    return {field: sum(getattr(totals, field) for totals in reporting) for field in SwaTotals.__struct_fields__}


def _worker(heartbeat: WorkerHeartbeat, counters: dict[str, CounterSums], seconds: float) -> dict:
    return {
        "worker_id": heartbeat.worker_id,
        "role": heartbeat.role,
        "pool": pool_of(heartbeat),
        "state": heartbeat.state,
        "num_running": heartbeat.num_running,
        "num_waiting": heartbeat.num_waiting,
        "kv_usage": heartbeat.kv_usage,
        "weight_dtype": heartbeat.weight_dtype,
        "kv_cache_dtype": heartbeat.kv_cache_dtype,
        "engine": counters.get(heartbeat.worker_id, CounterSums()).engine(seconds),
        "encoder": _encoder([heartbeat], counters, seconds),
    }


def _pools(workers: list[WorkerHeartbeat], counters: dict[str, CounterSums], seconds: float) -> list[dict]:
    by_pool: dict[str, list[WorkerHeartbeat]] = defaultdict(list)
    for heartbeat in workers:
        by_pool[pool_of(heartbeat)].append(heartbeat)
    return [
        {
            "pool": pool,
            "role": members[0].role,
            "instances": len(members),
            "ready": sum(heartbeat.state == "ready" for heartbeat in members),
            "num_running": sum(heartbeat.num_running for heartbeat in members),
            "num_waiting": sum(heartbeat.num_waiting for heartbeat in members),
            "kv_usage_mean": sum(heartbeat.kv_usage for heartbeat in members) / len(members),
            "engine": _engine(members, counters, seconds),
            "encoder": _encoder(members, counters, seconds),
        }
        for pool, members in sorted(by_pool.items())
    ]


def _engine(members: list[WorkerHeartbeat], counters: dict[str, CounterSums], seconds: float) -> dict:
    """The members' engine steps in the window, together."""
    return summed(counters[member.worker_id] for member in members if member.worker_id in counters).engine(seconds)


def embedding_cache_hit_rate(hits: int, misses: int) -> float | None:
    """Lookups that found the image's embeddings cached, as a fraction; None without a lookup."""
    lookups = hits + misses
    return hits / lookups if lookups else None


def _encoder(members: list[WorkerHeartbeat], counters: dict[str, CounterSums], seconds: float) -> dict | None:
    """Encode workers' figures together (one worker's, or a pool's): patches held now, encoded since
    each started and per second over the window, one encoder's measured patches per second (the mean
    of those that measured it; 0: none has), and their embedding caches. None for other roles."""
    if members[0].role != ENCODE_ROLE:
        return None
    hits = sum(member.embedding_cache_hits for member in members)
    misses = sum(member.embedding_cache_misses for member in members)
    encoded = summed(counters[m.worker_id] for m in members if m.worker_id in counters).patches
    return {
        "patches_in_flight": sum(member.patches_in_flight for member in members),
        "patches_encoded": sum(member.num_patches_encoded for member in members),
        "patches_per_s": encoded / seconds,
        "capacity_patches_per_s": measured_capacity(members),
        "embedding_cache": {
            "hits": hits,
            "misses": misses,
            "bytes": sum(member.embedding_cache_bytes for member in members),
            "hit_rate": embedding_cache_hit_rate(hits, misses),
        },
    }
