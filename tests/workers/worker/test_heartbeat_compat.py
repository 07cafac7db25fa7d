"""Heartbeats with the serving-time counters (step histograms, KV handoff totals, store fetches) cross
the wire whole, and peers of either age read each other's: a heartbeat without them decodes with
their defaults, and one with them decodes where they are unknown."""

import msgspec

from workers.protocol.messages import HandoffTotals, HistogramCounts, WorkerHeartbeat

SERVING_TIME_FIELDS = {
    "step_seconds",
    "step_tokens",
    "handoff_sent",
    "handoff_received",
    "num_store_fetches",
    "store_fetch_bytes",
    "store_fetch_seconds",
}
BASE = dict(
    worker_id="p0",
    role="prefill",
    model="tiny",
    request_endpoint="ipc:///tmp/p0.req",
    max_model_len=256,
    num_running=1,
    num_waiting=0,
    kv_usage=0.25,
    num_free_pages=10,
    num_prompt_tokens=40,
    num_cached_prompt_tokens=0,
    num_preemptions=0,
    sent_at=1_800_000_000.0,
)


def heartbeat_before_the_counters() -> type:
    """WorkerHeartbeat as a peer without the serving-time counters declares it."""
    fields = []
    for field in msgspec.structs.fields(WorkerHeartbeat):
        if field.name in SERVING_TIME_FIELDS:
            continue
        if field.required:
            fields.append((field.name, field.type))
        elif field.default is not msgspec.NODEFAULT:
            fields.append((field.name, field.type, field.default))
        else:
            fields.append((field.name, field.type, msgspec.field(default_factory=field.default_factory)))
    return msgspec.defstruct("WorkerHeartbeat", fields, tag="heartbeat", frozen=True)


def test_the_counters_round_trip():
    heartbeat = WorkerHeartbeat(
        **BASE,
        step_seconds=HistogramCounts(bounds=(0.01, 0.1), counts=(3, 1, 0), total=0.12),
        step_tokens=HistogramCounts(bounds=(1, 8), counts=(2, 1, 1), total=52.0),
        handoff_sent={"zmq": HandoffTotals(num_transfers=2, num_bytes=61440, seconds=0.004)},
        handoff_received={"cuda_ipc": HandoffTotals(num_transfers=1, num_bytes=30720, seconds=0.001)},
        num_store_fetches=3,
        store_fetch_bytes=98304,
        store_fetch_seconds=0.02,
    )

    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(heartbeat), type=WorkerHeartbeat)

    assert decoded == heartbeat


def test_a_heartbeat_without_the_counters_decodes_with_their_defaults():
    old = heartbeat_before_the_counters()(**BASE)

    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=WorkerHeartbeat)

    assert decoded == WorkerHeartbeat(**BASE)
    assert decoded.step_seconds is None and decoded.step_tokens is None
    assert decoded.handoff_sent == {} and decoded.handoff_received == {}
    assert (decoded.num_store_fetches, decoded.store_fetch_bytes, decoded.store_fetch_seconds) == (0, 0, 0.0)


def test_a_peer_without_the_counters_reads_a_heartbeat_that_has_them():
    heartbeat = WorkerHeartbeat(
        **BASE,
        step_seconds=HistogramCounts(bounds=(0.01,), counts=(1, 0), total=0.005),
        handoff_sent={"zmq": HandoffTotals(num_transfers=1, num_bytes=768, seconds=0.001)},
    )

    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(heartbeat), type=heartbeat_before_the_counters())

    assert decoded.worker_id == "p0" and decoded.num_prompt_tokens == 40
