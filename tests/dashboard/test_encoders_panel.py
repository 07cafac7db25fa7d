"""The dashboard's vision-encoder panel, rendered through django-plotly-dash's callback endpoint as a
browser asks: the encode pool with its encoders, their patches in flight and the embedding-cache hit
rate; an explicit empty state without encoders."""

import pytest

from dashboard import figures
from dashboard.telemetry_app import ENCODE_POOL_COLUMNS, ENCODER_COLUMNS
from tests.dashboard.test_telemetry_app import NO_STEPS, _callback, _snapshot

OUTPUTS = [("encoders", "children"), ("encoders-graph", "figure")]


def encoder_part(in_flight: int, encoded: int, hits: int, misses: int, hit_rate, capacity: float = 2500.0) -> dict:
    return {
        "patches_in_flight": in_flight,
        "patches_encoded": encoded,
        "patches_per_s": 120.0,
        "capacity_patches_per_s": capacity,
        "embedding_cache": {"hits": hits, "misses": misses, "bytes": 3_000_000, "hit_rate": hit_rate},
    }


def encode_worker(worker_id: str, encoder: dict) -> dict:
    return {
        "worker_id": worker_id,
        "role": "encode",
        "pool": "encode",
        "state": "ready",
        "num_running": 0,
        "num_waiting": 0,
        "kv_usage": 0.0,
        "weight_dtype": "",
        "kv_cache_dtype": "",
        "engine": NO_STEPS,
        "encoder": encoder,
    }


def rows(rendered_table: dict) -> list[list]:
    body = rendered_table["props"]["children"][1]["props"]["children"]
    return [[cell["props"]["children"] for cell in row["props"]["children"]] for row in body]


@pytest.mark.django_db
def test_the_encode_pool_its_encoders_patches_in_flight_and_cache_hit_rate_are_shown(client_as, make_pool):
    # given an encode pool and a prefill pool, and two encoders the collector heard
    make_pool("encode", kind="encode")
    make_pool("prefill", kind="prefill")
    workers = [
        encode_worker("encode-0", encoder_part(340, 12_000, 3, 1, 0.75)),
        encode_worker("encode-1", encoder_part(60, 800, 0, 0, None, capacity=0.0)),
    ]
    pool = {
        "pool": "encode",
        "role": "encode",
        "instances": 2,
        "ready": 2,
        "num_running": 0,
        "num_waiting": 0,
        "kv_usage_mean": 0.0,
        "engine": NO_STEPS,
        "encoder": encoder_part(400, 12_800, 3, 1, 0.75),
    }

    # when the panel renders the snapshot
    rendered = _callback(client_as("operator"), OUTPUTS, "snapshot", "data", _snapshot(workers=workers, pools=[pool]))

    # then the encode pool (not the prefill one) shows its patches in flight and hit rate
    pools_table, encoders_table = rendered["encoders.children"]
    (pool_row,) = [dict(zip(ENCODE_POOL_COLUMNS, row, strict=True)) for row in rows(pools_table)]
    assert (pool_row["pool"], pool_row["ready/seen"], pool_row["patches in flight"]) == ("encode", "2/2", 400)
    assert pool_row["embedding cache hit rate"] == "75.00%"
    assert pool_row["capacity/encoder (patches/s)"] == "2500.0"
    # and each encoder its own, one that looked nothing up and measured nothing saying so
    by_encoder = {row[0]: dict(zip(ENCODER_COLUMNS, row, strict=True)) for row in rows(encoders_table)}
    assert by_encoder["encode-0"]["patches in flight"] == 340
    assert by_encoder["encode-0"]["cache hit rate"] == "75.00%"
    assert by_encoder["encode-0"]["cache hits/misses"] == "3/1"
    assert by_encoder["encode-1"]["cache hit rate"] == "no data"
    assert by_encoder["encode-1"]["capacity (patches/s)"] == "not measured"
    (bars,) = rendered["encoders-graph.figure"]["data"]
    assert dict(zip(bars["y"], bars["x"])) == {"encode-0": 340, "encode-1": 60}
    assert bars["text"][0] == "cache hit rate 75.00%"


@pytest.mark.django_db
def test_without_encoders_the_panel_says_so(client_as, make_pool, no_collector):
    # given an encode pool none of whose encoders is running
    make_pool("encode", kind="encode")

    rendered = _callback(client_as("operator"), OUTPUTS, "snapshot", "data", None)

    pools_table, encoders_table = rendered["encoders.children"]
    (pool_row,) = [dict(zip(ENCODE_POOL_COLUMNS, row, strict=True)) for row in rows(pools_table)]
    assert (pool_row["ready/seen"], pool_row["patches in flight"], pool_row["embedding cache hit rate"]) == (
        "0/0",
        0,
        "no data",
    )
    assert encoders_table["props"]["children"] == figures.NO_ENCODERS
    annotation = rendered["encoders-graph.figure"]["layout"]["annotations"][0]["text"]
    assert annotation == figures.NO_ENCODERS
