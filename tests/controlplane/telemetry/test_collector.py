"""The collector's live snapshot: window figures under a fake clock, pools and the KV store from
heartbeats, the empty snapshot without workers, and the broadcast to the Channels group."""

import json

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from pytest import approx

from controlplane.gateway.engine import close_engine_client, gateway_expert_loads, gateway_heartbeats
from controlplane.telemetry import live
from controlplane.telemetry.collector import (
    GROUP,
    TelemetryCollector,
    close_telemetry_collector,
    record_finished_request,
    telemetry_collector,
)
from controlplane.telemetry.windows import RequestSample
from workers.protocol.messages import HandoffTotals, HistogramCounts, SpecDecodeTotals, SwaTotals

SNAPSHOT_KEYS = {
    "at",
    "window_s",
    "workers",
    "pools",
    "requests",
    "prompt_tokens_per_s",
    "generation_tokens_per_s",
    "cache_hit_rate",
    "ttft_s",
    "itl_s",
    "kv_store",
    "swa",
    "expert_load",
    "engine",
    "kv_handoff",
    "spec_decode",
}
NO_SPECULATION = {"acceptance_length": None, "verified_per_draft": None, "budget_per_step": None}
NO_STEPS = {"steps_per_s": 0.0, "step_time_mean_s": None, "tokens_per_step": None}


def sample(ttft_s: float | None = 0.1, *, itl=(), prompt: int = 100, cached: int = 0, generated: int = 10):
    return RequestSample(ttft_s, tuple(itl), prompt, cached, generated, ("stop",))


@pytest.fixture
def collector(clock, heartbeats, db) -> TelemetryCollector:
    return TelemetryCollector(heartbeats, clock=clock)


def tick(collector: TelemetryCollector) -> dict:
    return async_to_sync(collector.tick)()


def test_the_window_gives_percentiles_hit_rate_and_token_rates(collector, clock):
    # given: 100 requests over 30 s with TTFTs of 0.01 .. 1.00 s, each 100 prompt tokens, 40 of them cached
    for n in range(1, 101):
        collector.record_request(sample(n / 100, itl=(n / 1000,), prompt=100, cached=40, generated=6))
    clock.now += 30

    # when
    snapshot = tick(collector)

    # then: nearest-rank percentiles; rates over the 30 s the collector has run
    assert snapshot["requests"] == 100
    assert snapshot["ttft_s"] == {"p50": 0.5, "p90": 0.9, "p99": 0.99}
    assert snapshot["itl_s"] == {"p50": 0.05, "p90": 0.09, "p99": 0.099}
    assert snapshot["cache_hit_rate"] == pytest.approx(0.4)
    assert snapshot["prompt_tokens_per_s"] == pytest.approx(100 * 100 / 30)
    assert snapshot["generation_tokens_per_s"] == pytest.approx(100 * 6 / 30)
    assert snapshot["window_s"] == 60


def test_requests_leave_the_window_after_a_minute(collector, clock):
    collector.record_request(sample(5.0, prompt=1000, cached=1000))
    clock.now += 50
    collector.record_request(sample(0.2, prompt=100, cached=0))
    clock.now += 20  # the first request is 70 s old, the second 20 s

    snapshot = tick(collector)

    assert snapshot["requests"] == 1
    assert snapshot["ttft_s"]["p99"] == 0.2
    assert snapshot["cache_hit_rate"] == 0.0
    assert snapshot["prompt_tokens_per_s"] == pytest.approx(100 / 60)


def test_a_request_without_tokens_counts_but_has_no_latency(collector, clock):
    collector.record_request(sample(None, prompt=0, generated=0))

    snapshot = tick(collector)

    assert snapshot["requests"] == 1
    assert snapshot["ttft_s"] is None and snapshot["itl_s"] is None and snapshot["cache_hit_rate"] is None


def test_pools_and_the_kv_store_come_from_the_heartbeats(collector, heartbeats, make_heartbeat):
    store = {"kv_block_tokens": 64, "kv_store_bytes": 4096, "kv_store_blocks": 4}
    heartbeats.workers = [
        make_heartbeat("p0", role="prefill", pool="prefill", num_running=2, kv_usage=0.5, **store),
        make_heartbeat(
            "p1",
            role="prefill",
            pool="prefill",
            num_waiting=3,
            kv_usage=0.25,
            state="draining",
            weight_dtype="fp8_e4m3",
            kv_cache_dtype="bfloat16",
            **store,
        ),
        make_heartbeat(
            "d0",
            role="decode",
            pool="decode",
            num_running=1,
            kv_store_capacity_bytes=1 << 20,
            kv_store_low_watermark=0.8,
            kv_store_high_watermark=0.95,
            **store,
        ),
    ]

    snapshot = tick(collector)

    assert [worker["worker_id"] for worker in snapshot["workers"]] == ["p0", "p1", "d0"]
    assert snapshot["workers"][1] == {
        "worker_id": "p1",
        "role": "prefill",
        "pool": "prefill",
        "state": "draining",
        "num_running": 0,
        "num_waiting": 3,
        "kv_usage": 0.25,
        "weight_dtype": "fp8_e4m3",
        "kv_cache_dtype": "bfloat16",
        "engine": NO_STEPS,
        "encoder": None,
    }
    assert snapshot["pools"] == [
        {
            "pool": "decode",
            "role": "decode",
            "instances": 1,
            "ready": 1,
            "num_running": 1,
            "num_waiting": 0,
            "kv_usage_mean": 0.0,
            "engine": NO_STEPS,
            "encoder": None,
        },
        {
            "pool": "prefill",
            "role": "prefill",
            "instances": 2,
            "ready": 1,
            "num_running": 2,
            "num_waiting": 3,
            "kv_usage_mean": 0.375,
            "engine": NO_STEPS,
            "encoder": None,
        },
    ]
    assert snapshot["kv_store"] == {
        "bytes": 4096,
        "blocks": 4,
        "capacity_bytes": 1 << 20,
        "low_watermark": 0.8,
        "high_watermark": 0.95,
    }


def steps(count: int, seconds: float, tokens: float) -> dict:
    """A heartbeat's step histograms: `count` steps in the first bucket, summing to these."""
    return {
        "step_seconds": HistogramCounts(bounds=(1.0,), counts=(count, 0), total=seconds),
        "step_tokens": HistogramCounts(bounds=(1.0,), counts=(count, 0), total=tokens),
    }


def handoffs(transfers: int, num_bytes: int, seconds: float) -> dict[str, HandoffTotals]:
    return {"zmq": HandoffTotals(num_transfers=transfers, num_bytes=num_bytes, seconds=seconds)}


def test_steps_and_handoffs_count_what_the_counters_grew_by_in_the_window(collector, clock, heartbeats, make_heartbeat):
    # given: counters from before the collector heard of the workers, then 30 s of work
    def beat(worker_id: str, pool: str, *, started_at: float = 1.0, **fields):
        return make_heartbeat(worker_id, role=pool, pool=pool, started_at=started_at, **fields)

    heartbeats.workers = [
        beat("p0", "prefill", **steps(100, 50.0, 9000), handoff_sent=handoffs(90, 10**6, 9.0)),
        beat("d0", "decode", **steps(500, 5.0, 500), handoff_received=handoffs(90, 10**6, 20.0)),
        beat("d1", "decode", **steps(10, 1.0, 10)),
    ]
    tick(collector)
    clock.now += 30
    heartbeats.workers = [
        beat("p0", "prefill", **steps(104, 50.4, 9800), handoff_sent=handoffs(94, 10**6 + 6000, 9.08)),
        beat("d0", "decode", **steps(800, 8.0, 800), handoff_received=handoffs(94, 10**6 + 6000, 20.2)),
        # d1 restarted: everything it counted since counts
        beat("d1", "decode", started_at=2.0, **steps(200, 2.0, 200)),
    ]

    # when
    snapshot = tick(collector)

    # then: per worker over the 30 s the collector has run
    by_worker = {worker["worker_id"]: worker["engine"] for worker in snapshot["workers"]}
    assert by_worker["p0"] == {
        "steps_per_s": pytest.approx(4 / 30),
        "step_time_mean_s": pytest.approx(0.1),
        "tokens_per_step": pytest.approx(200),
    }
    assert by_worker["d1"]["steps_per_s"] == pytest.approx(200 / 30)
    decode = next(pool for pool in snapshot["pools"] if pool["pool"] == "decode")
    assert decode["engine"]["step_time_mean_s"] == pytest.approx((3.0 + 2.0) / 500)
    assert decode["engine"]["tokens_per_step"] == pytest.approx(1.0)
    assert snapshot["engine"]["step_time_mean_s"] == pytest.approx((0.4 + 3.0 + 2.0) / 504)
    assert snapshot["kv_handoff"]["received_mean_s"] == pytest.approx(0.05)
    assert snapshot["kv_handoff"]["by_backend"] == [
        {"backend": "zmq", "direction": "received", "transfers": 4, "bytes_per_s": 200.0, "mean_s": approx(0.05)},
        {"backend": "zmq", "direction": "sent", "transfers": 4, "bytes_per_s": 200.0, "mean_s": approx(0.02)},
    ]


def spec_totals(drafts: int, draft_tokens: int, accepted: int, steps: int, budget: float) -> SpecDecodeTotals:
    return SpecDecodeTotals(
        method="ngram",
        num_drafts=drafts,
        num_draft_tokens=draft_tokens,
        num_accepted_tokens=accepted,
        accepted_per_position=(accepted, 0, 0),
        budget=HistogramCounts(bounds=(8.0,), counts=(steps, 0), total=budget),
    )


def test_speculative_decoding_counts_what_the_drafts_grew_by_in_the_window(
    collector, clock, heartbeats, make_heartbeat
):
    # given two speculating decode workers heard before, then 30 s of work, and a worker without speculation
    heartbeats.workers = [
        make_heartbeat(
            "d0", role="decode", pool="decode", started_at=1.0, spec_decode=spec_totals(50, 200, 100, 20, 200)
        ),
        make_heartbeat("d1", role="decode", pool="decode", started_at=1.0, spec_decode=spec_totals(0, 0, 0, 0, 0)),
        make_heartbeat("d2", role="decode", pool="decode", started_at=1.0),
    ]
    tick(collector)
    clock.now += 30
    heartbeats.workers = [
        # d0: 10 more drafts of 4 tokens, 24 accepted, over 5 steps of 8
        make_heartbeat(
            "d0", role="decode", pool="decode", started_at=1.0, spec_decode=spec_totals(60, 240, 124, 25, 240)
        ),
        # d1: 10 drafts of 2 tokens, 6 accepted, over 5 steps; and one step the budget turned off
        make_heartbeat("d1", role="decode", pool="decode", started_at=1.0, spec_decode=spec_totals(10, 20, 6, 6, 20)),
        make_heartbeat("d2", role="decode", pool="decode", started_at=1.0),
    ]

    snapshot = tick(collector)

    assert snapshot["spec_decode"] == {
        "acceptance_length": approx(1 + 30 / 20),
        "verified_per_draft": approx(60 / 20),
        "budget_per_step": approx(60 / 11),
    }


def test_steps_leave_the_window_after_a_minute(collector, clock, heartbeats, make_heartbeat):
    heartbeats.workers = [make_heartbeat("w0", **steps(0, 0.0, 0))]
    tick(collector)
    clock.now += 1
    heartbeats.workers = [make_heartbeat("w0", **steps(10, 1.0, 10))]
    tick(collector)
    clock.now += 60

    snapshot = tick(collector)  # the same heartbeat: nothing new

    assert snapshot["workers"][0]["engine"] == NO_STEPS


def test_without_workers_the_snapshot_is_empty_but_complete(collector):
    snapshot = tick(collector)

    assert set(snapshot) == SNAPSHOT_KEYS
    assert snapshot["workers"] == [] and snapshot["pools"] == []
    assert snapshot["requests"] == 0 and snapshot["prompt_tokens_per_s"] == 0.0
    assert snapshot["cache_hit_rate"] is None and snapshot["ttft_s"] is None and snapshot["itl_s"] is None
    assert snapshot["kv_store"] is None and snapshot["swa"] is None and snapshot["expert_load"] == {}
    assert snapshot["engine"] == NO_STEPS and snapshot["kv_handoff"] == {"received_mean_s": None, "by_backend": []}
    assert snapshot["spec_decode"] == NO_SPECULATION
    assert json.loads(json.dumps(snapshot)) == snapshot


def test_current_snapshot_is_the_latest_tick_or_an_empty_one(collector, make_heartbeat, heartbeats):
    live.forget()
    assert set(live.current_snapshot()) == SNAPSHOT_KEYS
    assert live.current_snapshot()["workers"] == []

    heartbeats.workers = [make_heartbeat("w0")]
    snapshot = tick(collector)

    assert live.current_snapshot() == snapshot
    live.forget()


def test_each_tick_reaches_the_channels_group(collector, make_heartbeat, heartbeats):
    heartbeats.workers = [make_heartbeat("w0", num_running=1)]

    async def listen_to_a_tick() -> tuple[dict, dict]:
        layer = get_channel_layer()
        channel = await layer.new_channel()
        await layer.group_add(GROUP, channel)
        try:
            snapshot = await collector.tick()
            return snapshot, await layer.receive(channel)
        finally:
            await layer.group_discard(GROUP, channel)

    snapshot, message = async_to_sync(listen_to_a_tick)()

    assert message == {"type": "telemetry.update", "snapshot": snapshot}
    assert message["snapshot"]["workers"][0]["num_running"] == 1


def test_the_gateways_requests_reach_this_loops_collector(db, no_workers):
    async def record_then_tick() -> dict:
        collector = await telemetry_collector(gateway_heartbeats, expert_loads=gateway_expert_loads)
        try:
            record_finished_request(sample(0.3, prompt=10, cached=5, generated=2))
            return await collector.tick()
        finally:
            await close_telemetry_collector()
            await close_engine_client()

    snapshot = async_to_sync(record_then_tick)()

    assert snapshot["requests"] == 1 and snapshot["cache_hit_rate"] == 0.5


def test_the_swa_state_is_summed_over_the_workers_that_serve_sliding_window_models(
    collector, heartbeats, make_heartbeat
):
    heartbeats.workers = [
        make_heartbeat("p0", swa=SwaTotals(state_hits=3, state_misses=1, replays=1, replayed_tokens=100)),
        make_heartbeat("p1", swa=SwaTotals(state_hits=1, state_fetches=2, store_bytes_not_written=512)),
        make_heartbeat("p2"),  # a dense model's
    ]

    swa = tick(collector)["swa"]

    assert swa == {
        "state_hits": 4,
        "state_fetches": 2,
        "state_misses": 1,
        "replays": 1,
        "replayed_tokens": 100,
        "store_bytes_not_written": 512,
    }
