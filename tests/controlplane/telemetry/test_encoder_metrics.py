"""/metrics and the live snapshot carry the encode workers' figures from their heartbeats: patches in
flight and encoded, their measured capacity, and their embedding caches' hits, misses, bytes and hit
rate, per encoder and per pool; other workers have none of them."""

from asgiref.sync import async_to_sync
from prometheus_client.parser import text_string_to_metric_families

from controlplane.telemetry.collector import TelemetryCollector
from controlplane.telemetry.metrics import exposition


def samples(text: str) -> dict:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def encoders(make_heartbeat):
    return [
        make_heartbeat(
            "encode-0",
            role="encode",
            pool="encode",
            patches_in_flight=340,
            num_patches_encoded=12_000,
            patches_per_second=2500.0,
            embedding_cache_hits=3,
            embedding_cache_misses=1,
            embedding_cache_bytes=1_048_576,
        ),
        make_heartbeat("encode-1", role="encode", pool="encode", patches_in_flight=60),  # no lookup yet
    ]


def test_metrics_carry_each_encoder_s_patches_and_embedding_cache(make_heartbeat):
    prefill = make_heartbeat("prefill-0", role="prefill", pool="prefill", num_running=1)

    text = exposition([*encoders(make_heartbeat), prefill]).decode()
    scraped = samples(text)

    def value(name: str, worker: str = "encode-0"):
        return scraped.get((name, (("pool", "encode"), ("worker", worker))))

    assert value("sluice:encoder_patches_in_flight") == 340
    assert value("sluice:encoder_patches_encoded_total") == 12_000
    assert value("sluice:encoder_capacity_patches_per_second") == 2500.0
    assert value("sluice:embedding_cache_hits_total") == 3
    assert value("sluice:embedding_cache_misses_total") == 1
    assert value("sluice:embedding_cache_bytes") == 1_048_576
    assert value("sluice:embedding_cache_hit_rate") == 0.75
    # an encoder that looked nothing up has no hit rate, rather than a made-up 0
    assert value("sluice:embedding_cache_hit_rate", "encode-1") is None
    assert value("sluice:encoder_patches_in_flight", "encode-1") == 60
    assert scraped[("sluice:pool_patches_in_flight", (("pool", "encode"),))] == 400
    # a prefill worker has no encoder series
    assert not any(
        dict(labels).get("worker") == "prefill-0"
        for name, labels in scraped
        if "patches" in name or "embedding" in name
    )
    # and the families are declared in the exposition's own style (HELP, TYPE)
    assert "# TYPE sluice:encoder_patches_encoded_total counter" in text
    assert "# TYPE sluice:embedding_cache_hit_rate gauge" in text


def test_the_snapshot_gives_each_encoder_and_its_pool_patches_and_the_cache_hit_rate(make_heartbeat):
    now = [1_800_000_000.0]
    workers = [*encoders(make_heartbeat), make_heartbeat("prefill-0", role="prefill", pool="prefill")]

    async def heartbeats():
        return workers

    async def no_store_gcs():
        return []

    collector = TelemetryCollector(
        heartbeats, store_gcs=no_store_gcs, clock=lambda: now[0], window_s=60, collector_id="test"
    )
    async_to_sync(collector.tick)()
    # 10 s later encode-0 has encoded 5,000 patches more
    workers[0] = make_heartbeat(
        "encode-0",
        role="encode",
        pool="encode",
        patches_in_flight=340,
        num_patches_encoded=17_000,
        patches_per_second=2500.0,
        embedding_cache_hits=3,
        embedding_cache_misses=1,
        embedding_cache_bytes=1_048_576,
    )
    now[0] += 10
    snapshot = async_to_sync(collector.tick)()

    pool, prefill = snapshot["pools"]
    assert prefill["encoder"] is None
    assert pool["encoder"]["patches_in_flight"] == 400
    assert pool["encoder"]["patches_per_s"] == 500.0  # 5,000 over the 10 s the collector has run
    assert pool["encoder"]["capacity_patches_per_s"] == 2500.0  # only encode-0 measured it
    assert pool["encoder"]["embedding_cache"] == {"hits": 3, "misses": 1, "bytes": 1_048_576, "hit_rate": 0.75}
    by_id = {worker["worker_id"]: worker for worker in snapshot["workers"]}
    assert by_id["encode-1"]["encoder"]["embedding_cache"]["hit_rate"] is None
    assert by_id["prefill-0"]["encoder"] is None
    assert by_id["encode-0"]["encoder"]["patches_encoded"] == 17_000
