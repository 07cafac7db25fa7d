"""/metrics through the real ASGI application: Prometheus's text format (as prometheus_client's own
parser reads it), open to a scraper without a key, counters that move as requests are served, and
per-worker gauges that exist only while the worker sends heartbeats."""

import asyncio

import pytest

pytest.importorskip("recipe.api")  # the gateway's views need it

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from controlplane.telemetry.metrics import exposition  # noqa: E402
from tests.controlplane.gateway.helpers import key_headers, three_token_script, valid_body  # noqa: E402
from workers.engine.spec.stats import SpecDecodeStats  # noqa: E402
from workers.protocol.messages import (  # noqa: E402
    GenerateOutput,
    HandoffTotals,
    HistogramCounts,
    RequestPhaseTimes,
    SwaTotals,
)
from workers.worker.heartbeats import spec_decode_totals  # noqa: E402

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str) -> Samples:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(api) -> Samples:
    response = api.request("GET", "/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return samples(response.text)


def test_counters_move_when_requests_are_served(api, make_api_key, fake_engine):
    key = make_api_key("acme")
    engine = fake_engine(three_token_script(cached=16))
    before = scrape(api)

    for _ in range(2):
        response = api.post("chat.completions", valid_body("chat.completions", max_tokens=3), headers=key_headers(key))
        assert response.status_code == 200, response.text
    after = scrape(api)

    def moved(name: str, **labels: str) -> float:
        sample = (name, tuple(sorted(labels.items())))
        return after[sample] - before.get(sample, 0.0)

    prompt_tokens = len(engine.requests[0].prompt_token_ids)
    assert moved("vllm:prompt_tokens_total") == 2 * prompt_tokens
    assert moved("vllm:generation_tokens_total") == 6
    assert moved("vllm:prefix_cache_queries_total") == 2 * prompt_tokens
    assert moved("vllm:prefix_cache_hits_total") == 32
    assert moved("vllm:request_success_total", finished_reason="length") == 2
    assert moved("vllm:time_to_first_token_seconds_count") == 2
    assert moved("vllm:inter_token_latency_seconds_count") == 4  # two gaps between three outputs, twice
    assert moved("vllm:time_to_first_token_seconds_bucket", le="+Inf") == 2


def test_metrics_need_no_key_even_when_keys_exist(api, make_api_key, fake_engine):
    make_api_key("acme")
    fake_engine(three_token_script(cached=0))

    response = api.request("GET", "/metrics")

    assert response.status_code == 200
    assert "# TYPE vllm:prompt_tokens_total counter" in response.text


def test_worker_gauges_follow_the_heartbeats(make_heartbeat):
    prefill = make_heartbeat("p0", role="prefill", pool="prefill", num_running=2, num_waiting=1, kv_usage=0.5)
    store_gc = make_heartbeat(
        "d0",
        role="decode",
        pool="decode",
        num_running=4,
        kv_block_tokens=64,
        kv_store_bytes=4096,
        kv_store_blocks=4,
        kv_store_capacity_bytes=8192,
        kv_store_low_watermark=0.8,
        kv_store_high_watermark=0.95,
        kv_store_evicted_expired=5,
        kv_store_evicted_capacity=7,
    )

    running = samples(exposition([prefill, store_gc]).decode())
    stopped = samples(exposition([]).decode())

    assert running[("vllm:num_requests_running", (("pool", "prefill"), ("worker", "p0")))] == 2
    assert running[("vllm:num_requests_waiting", (("pool", "prefill"), ("worker", "p0")))] == 1
    assert running[("vllm:kv_cache_usage_perc", (("pool", "prefill"), ("worker", "p0")))] == 0.5
    assert running[("sluice:pool_load", (("pool", "prefill"),))] == 3
    assert running[("sluice:pool_load", (("pool", "decode"),))] == 4
    assert running[("sluice:kv_store_bytes", (("worker", "d0"),))] == 4096
    assert running[("sluice:kv_store_blocks", (("worker", "d0"),))] == 4
    assert running[("sluice:kv_store_gc_evictions_total", (("reason", "expired"), ("worker", "d0")))] == 5
    assert running[("sluice:kv_store_gc_evictions_total", (("reason", "capacity"), ("worker", "d0")))] == 7
    assert ("sluice:kv_store_bytes", (("worker", "p0"),)) not in running  # p0 has no store
    assert not any(name.startswith(("vllm:num_requests", "vllm:kv_cache", "sluice:")) for name, _ in stopped)


def test_decode_workers_report_migrations_failovers_recomputed_tokens_and_recovery_time(make_heartbeat):
    drained = make_heartbeat(
        "d0", role="decode", pool="decode", num_migrated_out=6, num_migrations_failed=1, num_migrations_declined=2
    )
    survivor = make_heartbeat(
        "d1",
        role="decode",
        pool="decode",
        num_migrated_in=6,
        num_resumed=3,
        num_recomputed_tokens=40,
        max_recomputed_tokens=16,
        resume_seconds_total=1.5,
    )
    prefill = make_heartbeat("p0", role="prefill", pool="prefill")

    running = samples(exposition([drained, survivor, prefill]).decode())

    assert running[("sluice:migrations_total", (("outcome", "moved"), ("worker", "d0")))] == 6
    assert running[("sluice:migrations_total", (("outcome", "failed"), ("worker", "d0")))] == 1
    assert running[("sluice:migrations_total", (("outcome", "declined"), ("worker", "d0")))] == 2
    assert running[("sluice:migrated_in_total", (("worker", "d1"),))] == 6
    assert running[("sluice:failovers_total", (("worker", "d1"),))] == 3
    assert running[("sluice:failover_recomputed_tokens_total", (("worker", "d1"),))] == 40
    assert running[("sluice:failover_max_recomputed_tokens", (("worker", "d1"),))] == 16
    assert running[("sluice:failover_recovery_seconds_total", (("worker", "d1"),))] == 1.5
    assert ("sluice:failovers_total", (("worker", "p0"),)) not in running  # only decode workers move requests


def test_sliding_window_workers_report_their_swa_state_and_others_none(make_heartbeat):
    swa = SwaTotals(
        state_hits=5, state_fetches=2, state_misses=1, replays=1, replayed_tokens=128, store_bytes_not_written=9000
    )
    hybrid = make_heartbeat("p0", role="prefill", pool="prefill", swa=swa)
    dense = make_heartbeat("p1", role="prefill", pool="prefill")

    running = samples(exposition([hybrid, dense]).decode())

    lookups = "sluice:swa_state_lookups_total"
    assert running[(lookups, (("outcome", "hit"), ("worker", "p0")))] == 5
    assert running[(lookups, (("outcome", "fetched"), ("worker", "p0")))] == 2
    assert running[(lookups, (("outcome", "missed"), ("worker", "p0")))] == 1
    assert running[("sluice:swa_replays_total", (("worker", "p0"),))] == 1
    assert running[("sluice:swa_replayed_tokens_total", (("worker", "p0"),))] == 128
    assert running[("sluice:kv_store_bytes_not_written_total", (("worker", "p0"),))] == 9000
    assert not any(dict(labels).get("worker") == "p1" for name, labels in running if "swa" in name)


def test_speculating_workers_report_drafts_acceptance_per_position_and_budget_and_others_none(make_heartbeat):
    stats = SpecDecodeStats("ngram", max_draft_tokens=3)
    stats.record_step(verified=[3, 2, 0], accepted=[2, 0, 0])  # a step verifying 5 draft tokens
    stats.record_step(verified=[3], accepted=[3])
    stats.calibration_error = 0.125
    speculating = make_heartbeat("d0", role="decode", pool="decode", spec_decode=spec_decode_totals(stats))
    plain = make_heartbeat("d1", role="decode", pool="decode")

    running = samples(exposition([speculating, plain]).decode())

    worker = (("method", "ngram"), ("pool", "decode"), ("worker", "d0"))
    assert running[("vllm:spec_decode_num_drafts_total", worker)] == 3
    assert running[("vllm:spec_decode_num_draft_tokens_total", worker)] == 8
    assert running[("vllm:spec_decode_num_accepted_tokens_total", worker)] == 5
    per_position = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert [running[(per_position, tuple(sorted((*worker, ("position", str(p))))))] for p in range(3)] == [2, 2, 1]
    budget = "sluice:spec_decode_budget_tokens"
    assert running[(f"{budget}_count", worker)] == 2 and running[(f"{budget}_sum", worker)] == 8
    assert running[(f"{budget}_bucket", tuple(sorted((*worker, ("le", "4.0")))))] == 1  # the step of 3
    assert running[(f"{budget}_bucket", tuple(sorted((*worker, ("le", "8.0")))))] == 2  # and the step of 5
    assert running[("sluice:spec_decode_calibration_error", worker)] == 0.125
    assert not any(dict(labels).get("worker") == "d1" for name, labels in running if "spec_decode" in name)


def test_each_worker_s_weight_and_kv_dtypes_are_an_info_metric(make_heartbeat):
    fp8 = make_heartbeat("d0", role="decode", pool="decode", weight_dtype="fp8_e4m3", kv_cache_dtype="fp8_e4m3")
    plain = make_heartbeat("p0", role="prefill", pool="prefill", weight_dtype="bfloat16", kv_cache_dtype="bfloat16")
    silent = make_heartbeat("old", role="prefill", pool="prefill")  # a worker that does not say

    running = samples(exposition([fp8, plain, silent]).decode())

    dtypes = {labels: value for (name, labels), value in running.items() if name == "sluice:worker_dtypes"}
    assert dtypes == {
        (("kv_cache", "fp8_e4m3"), ("pool", "decode"), ("weights", "fp8_e4m3"), ("worker", "d0")): 1.0,
        (("kv_cache", "bfloat16"), ("pool", "prefill"), ("weights", "bfloat16"), ("worker", "p0")): 1.0,
    }


def test_expert_load_is_declared_and_empty_for_dense_models(make_heartbeat):
    families = {
        family.name: family for family in text_string_to_metric_families(exposition([make_heartbeat()]).decode())
    }

    assert families["sluice:expert_load"].type == "gauge"
    assert families["sluice:expert_load"].samples == []


def test_engine_steps_handoffs_and_store_fetches_follow_the_heartbeats(make_heartbeat):
    prefill = make_heartbeat(
        "p0",
        role="prefill",
        pool="prefill",
        step_seconds=HistogramCounts(bounds=(0.01, 0.1), counts=(3, 1, 1), total=0.5),
        step_tokens=HistogramCounts(bounds=(1, 8), counts=(0, 2, 3), total=300.0),
        handoff_sent={"zmq": HandoffTotals(num_transfers=4, num_bytes=4096, seconds=0.02)},
        kv_block_tokens=64,
        num_store_fetches=2,
        store_fetch_bytes=8192,
        store_fetch_seconds=0.01,
    )
    decode = make_heartbeat(
        "d0",
        role="decode",
        pool="decode",
        handoff_received={
            "zmq": HandoffTotals(num_transfers=3, num_bytes=3072, seconds=0.03),
            "cuda_ipc": HandoffTotals(num_transfers=1, num_bytes=1024, seconds=0.001),
        },
    )

    running = samples(exposition([prefill, decode]).decode())

    p0 = (("pool", "prefill"), ("worker", "p0"))
    assert running[("sluice:engine_step_seconds_bucket", (("le", "0.01"), *p0))] == 3
    assert running[("sluice:engine_step_seconds_bucket", (("le", "0.1"), *p0))] == 4
    assert running[("sluice:engine_step_seconds_bucket", (("le", "+Inf"), *p0))] == 5
    assert running[("sluice:engine_step_seconds_count", p0)] == 5
    assert running[("sluice:engine_step_seconds_sum", p0)] == 0.5
    assert running[("vllm:iteration_tokens_total_bucket", (("le", "8.0"), *p0))] == 2
    assert running[("vllm:iteration_tokens_total_sum", p0)] == 300

    def handoff(name: str, worker: str, pool: str, direction: str, backend: str) -> float:
        labels = (("backend", backend), ("direction", direction), ("pool", pool), ("worker", worker))
        return running[(f"sluice:kv_handoff_{name}_total", labels)]

    assert handoff("transfers", "p0", "prefill", "sent", "zmq") == 4
    assert handoff("bytes", "p0", "prefill", "sent", "zmq") == 4096
    assert handoff("seconds", "p0", "prefill", "sent", "zmq") == 0.02
    assert handoff("transfers", "d0", "decode", "received", "zmq") == 3
    assert handoff("bytes", "d0", "decode", "received", "cuda_ipc") == 1024
    assert handoff("seconds", "d0", "decode", "received", "cuda_ipc") == 0.001
    assert running[("sluice:kv_store_fetches_total", p0)] == 2
    assert running[("sluice:kv_store_fetch_bytes_total", p0)] == 8192
    assert running[("sluice:kv_store_fetch_seconds_total", p0)] == 0.01
    # d0 sends no step histograms (as an older worker would not) and has no store.
    of_d0 = {name for name, labels in running if ("worker", "d0") in labels}
    assert not {name for name in of_d0 if name.startswith(("sluice:engine_step", "vllm:iteration", "sluice:kv_store"))}


def test_request_phases_and_whole_times_are_observed_from_the_outputs(api, make_api_key, fake_engine):
    key = make_api_key("acme")

    async def split(request):
        # A prefill worker's first token with its queue and prefill, then a decode worker's two tokens.
        common = {"request_id": request.request_id, "text": "a", "num_prompt_tokens": len(request.prompt_token_ids)}
        yield GenerateOutput(token_ids=[28], phase_times=RequestPhaseTimes(queue_s=0.002, prefill_s=0.03), **common)
        yield GenerateOutput(token_ids=[29], **common)
        yield GenerateOutput(
            token_ids=[30], finish_reason="length", phase_times=RequestPhaseTimes(decode_s=0.2), **common
        )

    fake_engine(split)
    before = scrape(api)

    response = api.post("chat.completions", valid_body("chat.completions", max_tokens=3), headers=key_headers(key))
    assert response.status_code == 200, response.text
    after = scrape(api)

    def moved(name: str) -> float:
        return after[(name, ())] - before.get((name, ()), 0.0)

    assert moved("vllm:request_queue_time_seconds_count") == 1
    assert moved("vllm:request_queue_time_seconds_sum") == pytest.approx(0.002)
    assert moved("vllm:request_prefill_time_seconds_sum") == pytest.approx(0.03)
    assert moved("vllm:request_decode_time_seconds_count") == 1
    assert moved("vllm:request_decode_time_seconds_sum") == pytest.approx(0.2)
    assert moved("vllm:e2e_request_latency_seconds_count") == 1
    assert moved("vllm:e2e_request_latency_seconds_sum") >= 0.0


def test_time_per_output_token_is_one_per_choice_over_its_tokens_after_the_first(api, make_api_key, fake_engine):
    key = make_api_key("acme")

    async def spread(request):
        # Three tokens, the last two ~20 ms apart each: ~20 ms per token after the first.
        common = {"request_id": request.request_id, "text": "a", "num_prompt_tokens": len(request.prompt_token_ids)}
        yield GenerateOutput(token_ids=[28], **common)
        await asyncio.sleep(0.02)
        yield GenerateOutput(token_ids=[29], **common)
        await asyncio.sleep(0.02)
        yield GenerateOutput(token_ids=[30], finish_reason="length", **common)

    fake_engine(spread)
    before = scrape(api)

    response = api.post("chat.completions", valid_body("chat.completions", max_tokens=3), headers=key_headers(key))
    assert response.status_code == 200, response.text
    after = scrape(api)

    def moved(name: str, **labels: str) -> float:
        sample = (name, tuple(sorted(labels.items())))
        return after[sample] - before.get(sample, 0.0)

    assert moved("vllm:request_time_per_output_token_seconds_count") == 1
    assert 0.02 <= moved("vllm:request_time_per_output_token_seconds_sum") < 0.2
    assert moved("vllm:request_time_per_output_token_seconds_bucket", le="0.01") == 0


def test_a_choice_of_one_token_has_no_time_per_output_token(api, make_api_key, fake_engine):
    key = make_api_key("acme")

    async def single(request):
        yield GenerateOutput(
            request_id=request.request_id,
            token_ids=[28],
            text="a",
            finish_reason="length",
            num_prompt_tokens=len(request.prompt_token_ids),
        )

    fake_engine(single)
    before = scrape(api)

    response = api.post("chat.completions", valid_body("chat.completions", max_tokens=1), headers=key_headers(key))
    assert response.status_code == 200, response.text
    after = scrape(api)

    tpot, e2e = ("vllm:request_time_per_output_token_seconds_count", ()), ("vllm:e2e_request_latency_seconds_count", ())
    assert after[tpot] == before.get(tpot, 0.0)
    assert after[e2e] == before.get(e2e, 0.0) + 1
