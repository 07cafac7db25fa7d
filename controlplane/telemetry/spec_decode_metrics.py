"""Speculative decoding in /metrics, from the workers' latest heartbeats (counters since each worker
started). Names: vLLM's spec_decode counters (drafts, draft tokens, accepted tokens, and accepted
tokens per draft position); vLLM has no budget or calibration figure, so those are under sluice's
names: the draft tokens each verify step verified over its batch (the DSpark budget), and the
drafter's recent expected calibration error."""

from collections.abc import Iterable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from controlplane.telemetry.serving_time_metrics import histogram_buckets
from controlplane.telemetry.snapshot import pool_of
from workers.protocol.messages import WorkerHeartbeat


def spec_decode_families(workers: Iterable[WorkerHeartbeat]) -> list[Metric]:
    labels = ["worker", "pool", "method"]
    drafts = CounterMetricFamily(
        "vllm:spec_decode_num_drafts", "Requests' drafts verified, one per request and verify step.", labels=labels
    )
    draft_tokens = CounterMetricFamily(
        "vllm:spec_decode_num_draft_tokens", "Draft tokens verified by the target model.", labels=labels
    )
    accepted = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens", "Draft tokens the target model accepted.", labels=labels
    )
    per_position = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted at each draft position (0: the first draft token).",
        labels=[*labels, "position"],
    )
    budget = HistogramMetricFamily(
        "sluice:spec_decode_budget_tokens",
        "Draft tokens a verify step verified over its whole batch (0: speculation off for the step).",
        labels=labels,
    )
    calibration = GaugeMetricFamily(
        "sluice:spec_decode_calibration_error",
        "Expected calibration error of the drafter's acceptance estimates lately (0: not measured).",
        labels=labels,
    )
    for heartbeat in workers:
        spec = heartbeat.spec_decode
        if spec is None:
            continue
        worker = [heartbeat.worker_id, pool_of(heartbeat), spec.method]
        drafts.add_metric(worker, spec.num_drafts)
        draft_tokens.add_metric(worker, spec.num_draft_tokens)
        accepted.add_metric(worker, spec.num_accepted_tokens)
        for position, count in enumerate(spec.accepted_per_position):
            per_position.add_metric([*worker, str(position)], count)
        budget.add_metric(worker, *histogram_buckets(spec.budget))
        calibration.add_metric(worker, spec.calibration_error)
    return [drafts, draft_tokens, accepted, per_position, budget, calibration]
