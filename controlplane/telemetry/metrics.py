"""The gateway's Prometheus metrics, under vLLM's names where vLLM has one and `sluice:` otherwise.

Request metrics are measured by the gateway as generations end, so they count every worker's work
once. Per-worker figures come from the workers' latest heartbeats at scrape time, so a stopped
worker's series disappear with it; the KV store's figures also come from the store's GC process when
it runs on its own (its latest report, labelled worker=<its gc id>), gone too once it stops
reporting. A dedicated registry keeps the process's default collectors and anything a library
registers globally out of the exposition.
"""

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from controlplane.telemetry import live
from controlplane.telemetry.encode_loads import ENCODE_ROLE
from controlplane.telemetry.serving_time_metrics import serving_time_families
from controlplane.telemetry.snapshot import embedding_cache_hit_rate, pool_of
from controlplane.telemetry.spec_decode_metrics import spec_decode_families
from controlplane.telemetry.windows import RequestSample
from workers.protocol.messages import WorkerHeartbeat

if TYPE_CHECKING:
    from controlplane.telemetry.models import KVStoreGC

REQUEST_REGISTRY = CollectorRegistry()

_TTFT = Histogram(
    "vllm:time_to_first_token_seconds",
    "Time from the gateway handing a request to the engine to its first token.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.5, 3.0, 6.0, 12.0, 30.0, 60.0, 120.0),
    registry=REQUEST_REGISTRY,
)
# Per-token times: a step's output gap, and a request's mean time per token after its first.
TOKEN_TIME_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0, 5.0)
_ITL = Histogram(
    "vllm:inter_token_latency_seconds",
    "Time between consecutive outputs of one request (one per engine step).",
    buckets=TOKEN_TIME_BUCKETS,
    registry=REQUEST_REGISTRY,
)
# vLLM's current name for the per-request TPOT; its older vllm:time_per_output_token_seconds was
# per step, which is vllm:inter_token_latency_seconds now.
_TPOT = Histogram(
    "vllm:request_time_per_output_token_seconds",
    "Per finished choice: time from its first token to its last, over its tokens after the first.",
    buckets=TOKEN_TIME_BUCKETS,
    registry=REQUEST_REGISTRY,
)
_PROMPT_TOKENS = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", registry=REQUEST_REGISTRY)
_GENERATION_TOKENS = Counter("vllm:generation_tokens", "Tokens generated.", registry=REQUEST_REGISTRY)
_PREFIX_QUERIES = Counter(
    "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", registry=REQUEST_REGISTRY
)
_PREFIX_HITS = Counter(
    "vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", registry=REQUEST_REGISTRY
)
# A request's whole time and its phases: milliseconds of queueing up to the longest requests.
REQUEST_PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5, 10, 30, 60, 120, 300, 1800, 7680)
_E2E = Histogram(
    "vllm:e2e_request_latency_seconds",
    "Time from the gateway handing a request to the engine to its last output (per choice).",
    buckets=REQUEST_PHASE_BUCKETS,
    registry=REQUEST_REGISTRY,
)
_QUEUE = Histogram(
    "vllm:request_queue_time_seconds",
    "Time a request waited on a worker before a step first computed it (each worker that queued it).",
    buckets=REQUEST_PHASE_BUCKETS,
    registry=REQUEST_REGISTRY,
)
_PREFILL = Histogram(
    "vllm:request_prefill_time_seconds",
    "Time from a request's first step on a worker to its first token there.",
    buckets=REQUEST_PHASE_BUCKETS,
    registry=REQUEST_REGISTRY,
)
_DECODE = Histogram(
    "vllm:request_decode_time_seconds",
    "Time from a request's first token (on a decode worker: its KV placed there) to its last.",
    buckets=REQUEST_PHASE_BUCKETS,
    registry=REQUEST_REGISTRY,
)
_REQUEST_SUCCESS = Counter(
    "vllm:request_success",
    "Finished requests (one per choice), by why they finished.",
    ["finished_reason"],
    registry=REQUEST_REGISTRY,
)


def observe_request(sample: RequestSample) -> None:
    if sample.ttft_s is not None:
        _TTFT.observe(sample.ttft_s)
    for latency in sample.inter_token_s:
        _ITL.observe(latency)
    _PROMPT_TOKENS.inc(sample.prompt_tokens)
    _GENERATION_TOKENS.inc(sample.generation_tokens)
    _PREFIX_QUERIES.inc(sample.prompt_tokens)
    _PREFIX_HITS.inc(sample.cached_tokens)
    for reason in sample.finish_reasons:
        _REQUEST_SUCCESS.labels(finished_reason=reason).inc()
    for histogram, values in (
        (_E2E, sample.e2e_s),
        (_TPOT, sample.tpot_s),
        (_QUEUE, sample.queue_s),
        (_PREFILL, sample.prefill_s),
        (_DECODE, sample.decode_s),
    ):
        for seconds in values:
            histogram.observe(seconds)


class _Scrape:
    """One scrape's collector: the request metrics, then families built from `workers` and `pools`."""

    def __init__(
        self,
        workers: list[WorkerHeartbeat],
        pools: list[dict],
        scaling_events: list[dict],
        expert_load: dict[str, list[list[int]]],
        store_gcs: Sequence["KVStoreGC"],
    ) -> None:
        self._workers = workers
        self._pools = pools
        self._scaling_events = scaling_events
        self._expert_load = expert_load
        self._store_gcs = store_gcs

    def collect(self) -> Iterable[Metric]:
        yield from REQUEST_REGISTRY.collect()
        yield from heartbeat_families(self._workers, self._expert_load, self._store_gcs)
        yield from serving_time_families(self._workers)
        yield from spec_decode_families(self._workers)
        yield from pool_families(self._pools, self._scaling_events)


def exposition(
    workers: list[WorkerHeartbeat],
    pools: list[dict] = (),
    store_gcs: Sequence["KVStoreGC"] = (),
    scaling_events: list[dict] = (),
) -> bytes:
    """The text exposition format; `workers` are the healthy workers' latest heartbeats, `pools` the
    topology's pools as controlplane.topology.selectors.pool_scaling_summary gives them, `store_gcs`
    the KV store GC processes reporting now (selectors.kv_store_gcs_reporting), `scaling_events` the
    audit trail's counts (topology selectors.scaling_event_counts), expert loads the window the
    collector summed (its latest snapshot)."""
    expert_load = live.current_snapshot()["expert_load"]
    return generate_latest(_Scrape(workers, list(pools), list(scaling_events), expert_load, store_gcs))


def pool_families(pools: list[dict], scaling_events: list[dict] = ()) -> list[Metric]:
    """What the autoscaler (or an operator) wants of each pool against what it has, and what was done
    to it (the ScalingEvent audit trail, counted from the database: every gateway shows the same)."""
    desired = GaugeMetricFamily(
        "sluice:pool_desired_instances", "The pool's target instance count (autoscaler or operator).", labels=["pool"]
    )
    instances = GaugeMetricFamily(
        "sluice:pool_instances", "The pool's engine instances by state.", labels=["pool", "state"]
    )
    paused = GaugeMetricFamily(
        "sluice:autoscaler_paused", "1 while the autoscaler leaves the pool alone.", labels=["pool"]
    )
    for pool in pools:
        desired.add_metric([pool["pool"]], pool["target_instances"])
        paused.add_metric([pool["pool"]], 1.0 if pool["autoscale_paused"] else 0.0)
        for state, count in sorted(pool["instances"].items()):
            instances.add_metric([pool["pool"], state], count)
    events = CounterMetricFamily(
        "sluice:scaling_events",
        "Scaling actions recorded in the audit trail, by pool and action (instance events under their pool).",
        labels=["pool", "action"],
    )
    for event in scaling_events:
        events.add_metric([event["pool"], event["action"]], event["count"])
    return [desired, instances, paused, events]


def heartbeat_families(
    workers: list[WorkerHeartbeat],
    expert_load: dict[str, list[list[int]]] | None = None,
    store_gcs: Sequence["KVStoreGC"] = (),
) -> list[Metric]:
    labels = ["worker", "pool"]
    running = GaugeMetricFamily("vllm:num_requests_running", "Requests in the worker's running batch.", labels=labels)
    waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests queued on the worker.", labels=labels)
    kv_usage = GaugeMetricFamily(
        "vllm:kv_cache_usage_perc", "Fraction of the worker's KV pages in use (0 to 1).", labels=labels
    )
    store_bytes = GaugeMetricFamily(
        "sluice:kv_store_bytes", "Bytes in the global KV store, as the worker's index reads it.", labels=["worker"]
    )
    store_blocks = GaugeMetricFamily(
        "sluice:kv_store_blocks", "Blocks in the global KV store, as the worker's index reads it.", labels=["worker"]
    )
    capacity = GaugeMetricFamily(
        "sluice:kv_store_capacity_bytes", "The store capacity the worker's GC keeps to.", labels=["worker"]
    )
    watermark = GaugeMetricFamily(
        "sluice:kv_store_watermark",
        "The GC's watermarks as fractions of capacity: it evicts above high, down to low.",
        labels=["worker", "level"],
    )
    evictions = CounterMetricFamily(
        "sluice:kv_store_gc_evictions",
        "Blocks the store GC removed since its process started (a worker's, or the GC's own), by reason.",
        labels=["worker", "reason"],
    )
    checkpoints_removed = CounterMetricFamily(
        "sluice:kv_store_gc_checkpoints_removed",
        "Checkpoint files the store's GC process deleted since it started: no request could resume from them.",
        labels=["worker"],
    )
    migrations = CounterMetricFamily(
        "sluice:migrations",
        "Requests a draining decode worker handed to others since it started, by outcome.",
        labels=["worker", "outcome"],
    )
    migrated_in = CounterMetricFamily(
        "sluice:migrated_in", "Requests the decode worker took over from draining ones.", labels=["worker"]
    )
    failovers = CounterMetricFamily(
        "sluice:failovers", "Requests of failed decode workers the worker resumed from checkpoints.", labels=["worker"]
    )
    recomputed = CounterMetricFamily(
        "sluice:failover_recomputed_tokens",
        "Tokens the worker recomputed for resumed requests (those the KV store did not hold).",
        labels=["worker"],
    )
    most_recomputed = GaugeMetricFamily(
        "sluice:failover_max_recomputed_tokens",
        "The most tokens the worker recomputed for one resumed request.",
        labels=["worker"],
    )
    recovery = CounterMetricFamily(
        "sluice:failover_recovery_seconds",
        "Seconds from each resume's arrival at the worker to its first new token, summed.",
        labels=["worker"],
    )
    pool_load: dict[str, int] = defaultdict(int)
    for heartbeat in workers:
        worker, pool = heartbeat.worker_id, pool_of(heartbeat)
        running.add_metric([worker, pool], heartbeat.num_running)
        waiting.add_metric([worker, pool], heartbeat.num_waiting)
        kv_usage.add_metric([worker, pool], heartbeat.kv_usage)
        pool_load[pool] += heartbeat.num_running + heartbeat.num_waiting
        if heartbeat.kv_block_tokens:
            store_bytes.add_metric([worker], heartbeat.kv_store_bytes)
            store_blocks.add_metric([worker], heartbeat.kv_store_blocks)
        if heartbeat.kv_store_capacity_bytes:
            capacity.add_metric([worker], heartbeat.kv_store_capacity_bytes)
            watermark.add_metric([worker, "low"], heartbeat.kv_store_low_watermark)
            watermark.add_metric([worker, "high"], heartbeat.kv_store_high_watermark)
            evictions.add_metric([worker, "expired"], heartbeat.kv_store_evicted_expired)
            evictions.add_metric([worker, "capacity"], heartbeat.kv_store_evicted_capacity)
        if heartbeat.role == "decode":
            migrations.add_metric([worker, "moved"], heartbeat.num_migrated_out)
            migrations.add_metric([worker, "failed"], heartbeat.num_migrations_failed)
            migrations.add_metric([worker, "declined"], heartbeat.num_migrations_declined)
            migrated_in.add_metric([worker], heartbeat.num_migrated_in)
            failovers.add_metric([worker], heartbeat.num_resumed)
            recomputed.add_metric([worker], heartbeat.num_recomputed_tokens)
            most_recomputed.add_metric([worker], heartbeat.max_recomputed_tokens)
            recovery.add_metric([worker], heartbeat.resume_seconds_total)
    for gc in store_gcs:
        store_bytes.add_metric([gc.gc_id], gc.num_bytes)
        store_blocks.add_metric([gc.gc_id], gc.num_blocks)
        capacity.add_metric([gc.gc_id], gc.capacity_bytes)
        watermark.add_metric([gc.gc_id, "low"], gc.low_watermark)
        watermark.add_metric([gc.gc_id, "high"], gc.high_watermark)
        evictions.add_metric([gc.gc_id, "expired"], gc.evicted_expired)
        evictions.add_metric([gc.gc_id, "capacity"], gc.evicted_capacity)
        checkpoints_removed.add_metric([gc.gc_id], gc.checkpoints_removed)
    load = GaugeMetricFamily("sluice:pool_load", "Requests running and waiting on the pool's workers.", labels=["pool"])
    for pool, value in sorted(pool_load.items()):
        load.add_metric([pool], value)
    # Per pool, MoE layer and physical slot (rank * slots_per_rank + slot), over the collector's window.
    slot_load = GaugeMetricFamily(
        "sluice:expert_load",
        "Tokens routed to each expert slot in the telemetry window (MoE pools only).",
        labels=["pool", "layer", "slot"],
    )
    for pool, layers in sorted((expert_load or {}).items()):
        for layer, slots in enumerate(layers):
            for slot, tokens in enumerate(slots):
                slot_load.add_metric([pool, str(layer), str(slot)], tokens)
    return [
        running,
        waiting,
        kv_usage,
        store_bytes,
        store_blocks,
        capacity,
        watermark,
        evictions,
        checkpoints_removed,
        migrations,
        migrated_in,
        failovers,
        recomputed,
        most_recomputed,
        recovery,
        load,
        slot_load,
        *swa_families(workers),
        *encoder_families(workers),
        dtype_family(workers),
    ]


def encoder_families(workers: list[WorkerHeartbeat]) -> list[Metric]:
    """The encode workers' image patches (held now, encoded since each started, and what one measured it
    encodes per second: the autoscaler's capacity of an encoder), and their embedding caches, each
    labelled with its pool; per pool, the patches its encoders hold (what the gateway balances on)."""
    labels = ["worker", "pool"]
    in_flight = GaugeMetricFamily(
        "sluice:encoder_patches_in_flight", "Image patches of the requests the encoder holds.", labels=labels
    )
    encoded = CounterMetricFamily(
        "sluice:encoder_patches_encoded", "Image patches the encoder's vision tower encoded.", labels=labels
    )
    capacity = GaugeMetricFamily(
        "sluice:encoder_capacity_patches_per_second",
        "Patches per second the encoder measured its vision tower encodes at its largest batch (0: not yet).",
        labels=labels,
    )
    hits = CounterMetricFamily(
        "sluice:embedding_cache_hits", "Images whose embeddings the encoder's cache held.", labels=labels
    )
    misses = CounterMetricFamily(
        "sluice:embedding_cache_misses", "Images the encoder's cache did not hold: encoded.", labels=labels
    )
    cache_bytes = GaugeMetricFamily(
        "sluice:embedding_cache_bytes", "Bytes of embeddings in the encoder's cache.", labels=labels
    )
    hit_rate = GaugeMetricFamily(
        "sluice:embedding_cache_hit_rate",
        "Hits over lookups of the encoder's embedding cache since it started (absent before a lookup).",
        labels=labels,
    )
    pool_in_flight: dict[str, int] = defaultdict(int)
    for heartbeat in workers:
        if heartbeat.role != ENCODE_ROLE:
            continue
        names = [heartbeat.worker_id, pool_of(heartbeat)]
        in_flight.add_metric(names, heartbeat.patches_in_flight)
        encoded.add_metric(names, heartbeat.num_patches_encoded)
        capacity.add_metric(names, heartbeat.patches_per_second)
        hits.add_metric(names, heartbeat.embedding_cache_hits)
        misses.add_metric(names, heartbeat.embedding_cache_misses)
        cache_bytes.add_metric(names, heartbeat.embedding_cache_bytes)
        rate = embedding_cache_hit_rate(heartbeat.embedding_cache_hits, heartbeat.embedding_cache_misses)
        if rate is not None:
            hit_rate.add_metric(names, rate)
        pool_in_flight[pool_of(heartbeat)] += heartbeat.patches_in_flight
    pool_patches = GaugeMetricFamily(
        "sluice:pool_patches_in_flight", "Image patches the pool's encoders hold.", labels=["pool"]
    )
    for pool, value in sorted(pool_in_flight.items()):
        pool_patches.add_metric([pool], value)
    return [in_flight, encoded, capacity, hits, misses, cache_bytes, hit_rate, pool_patches]


def dtype_family(workers: list[WorkerHeartbeat]) -> Metric:
    """Each worker's precision as an info metric (value 1, the dtypes in labels), for joins such as
    `vllm:num_requests_running * on(worker) group_left(kv_cache) sluice:worker_dtypes`."""
    dtypes = GaugeMetricFamily(
        "sluice:worker_dtypes",
        "The dtypes the worker holds its weights and KV cache in (fp8_e4m3: FP8 with scales); always 1.",
        labels=["worker", "pool", "weights", "kv_cache"],
    )
    for heartbeat in workers:
        if heartbeat.weight_dtype or heartbeat.kv_cache_dtype:
            dtypes.add_metric(
                [heartbeat.worker_id, pool_of(heartbeat), heartbeat.weight_dtype, heartbeat.kv_cache_dtype], 1
            )
    return dtypes


def swa_families(workers: list[WorkerHeartbeat]) -> list[Metric]:
    """The SWA state of the workers serving a model with sliding-window layers (workers.engine.kv.spec):
    where each prefix hit's state came from, what the replays of missing ones recomputed, and the
    bytes the store did not write."""
    state = CounterMetricFamily(
        "sluice:swa_state_lookups",
        "Prefix hits of a sliding-window model by where their SWA state came from: this worker's host "
        "cache (hit), the worker holding it (fetched), or nowhere (missed: replayed).",
        labels=["worker", "outcome"],
    )
    replays = CounterMetricFamily(
        "sluice:swa_replays", "Bounded replays of a missing SWA state the worker ran.", labels=["worker"]
    )
    replayed = CounterMetricFamily(
        "sluice:swa_replayed_tokens", "Tokens the worker recomputed in bounded replays.", labels=["worker"]
    )
    not_written = CounterMetricFamily(
        "sluice:kv_store_bytes_not_written",
        "Bytes of sliding-window layers' KV the worker kept out of the global store.",
        labels=["worker"],
    )
    for heartbeat in workers:
        swa = heartbeat.swa
        if swa is None:
            continue
        worker = heartbeat.worker_id
        state.add_metric([worker, "hit"], swa.state_hits)
        state.add_metric([worker, "fetched"], swa.state_fetches)
        state.add_metric([worker, "missed"], swa.state_misses)
        replays.add_metric([worker], swa.replays)
        replayed.add_metric([worker], swa.replayed_tokens)
        not_written.add_metric([worker], swa.store_bytes_not_written)
    return [state, replays, replayed, not_written]
