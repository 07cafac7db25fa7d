"""Where the workers' serving time goes, in /metrics from their latest heartbeats (counters since each
worker started): engine steps, seconds and tokens per step; KV handoffs by transfer backend, on the
side that sent them and the side that received them; fetches from the global KV store.

Names: vLLM's iteration_tokens_total for tokens per step. vLLM has no step time; its KV transfer
metrics are its NIXL connector's (histograms per transfer, named after NIXL) and its offload loads
(kv_offload_load_*) time the copy onto the GPU as well, unlike a store fetch here, which ends in host
memory; so those figures are under sluice's names.
"""

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from controlplane.telemetry.snapshot import pool_of
from workers.protocol.messages import HistogramCounts, WorkerHeartbeat

HANDOFF_LABELS = ["worker", "pool", "direction", "backend"]


def serving_time_families(workers: Iterable[WorkerHeartbeat]) -> list[Metric]:
    labels = ["worker", "pool"]
    step_seconds = HistogramMetricFamily(
        "sluice:engine_step_seconds",
        "Seconds from launching an engine step to reading its result; with async scheduling this also "
        "covers the next step's host work, so it bounds the step's device time from above.",
        labels=labels,
    )
    step_tokens = HistogramMetricFamily("vllm:iteration_tokens_total", "Tokens computed per step.", labels=labels)
    handoffs = CounterMetricFamily(
        "sluice:kv_handoff_transfers", "KV handoffs completed, by direction and backend.", labels=HANDOFF_LABELS
    )
    handoff_bytes = CounterMetricFamily(
        "sluice:kv_handoff_bytes", "Bytes of KV in the completed handoffs.", labels=HANDOFF_LABELS
    )
    handoff_seconds = CounterMetricFamily(
        "sluice:kv_handoff_seconds",
        "Seconds the completed handoffs took, summed: from a transfer's start to its KV usable on the "
        "receiver, or handed to the wire on the sender.",
        labels=HANDOFF_LABELS,
    )
    fetches = CounterMetricFamily("sluice:kv_store_fetches", "Fetches from the global KV store.", labels=labels)
    fetch_bytes = CounterMetricFamily(
        "sluice:kv_store_fetch_bytes", "Bytes read from the global KV store into host memory.", labels=labels
    )
    fetch_seconds = CounterMetricFamily(
        "sluice:kv_store_fetch_seconds", "Seconds the fetches from the global KV store took, summed.", labels=labels
    )
    for heartbeat in workers:
        worker = [heartbeat.worker_id, pool_of(heartbeat)]
        if heartbeat.step_seconds is not None:
            step_seconds.add_metric(worker, *histogram_buckets(heartbeat.step_seconds))
        if heartbeat.step_tokens is not None:
            step_tokens.add_metric(worker, *histogram_buckets(heartbeat.step_tokens))
        for direction, by_backend in (("sent", heartbeat.handoff_sent), ("received", heartbeat.handoff_received)):
            for backend, totals in sorted(by_backend.items()):
                handoff = [*worker, direction, backend]
                handoffs.add_metric(handoff, totals.num_transfers)
                handoff_bytes.add_metric(handoff, totals.num_bytes)
                handoff_seconds.add_metric(handoff, totals.seconds)
        if heartbeat.kv_block_tokens:
            fetches.add_metric(worker, heartbeat.num_store_fetches)
            fetch_bytes.add_metric(worker, heartbeat.store_fetch_bytes)
            fetch_seconds.add_metric(worker, heartbeat.store_fetch_seconds)
    return [step_seconds, step_tokens, handoffs, handoff_bytes, handoff_seconds, fetches, fetch_bytes, fetch_seconds]


def histogram_buckets(histogram: HistogramCounts) -> tuple[list[tuple[str, float]], float]:
    """Cumulative `le` buckets ending with +Inf, and the sum: HistogramMetricFamily.add_metric's."""
    cumulative, seen = [], 0
    for bound, count in zip((*histogram.bounds, float("inf")), histogram.counts, strict=True):
        seen += count
        cumulative.append((floatToGoString(bound), seen))
    return cumulative, histogram.total
