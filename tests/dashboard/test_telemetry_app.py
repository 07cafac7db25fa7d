"""The dashboard's live parts, rendered through django-plotly-dash's callback endpoint as a browser asks."""

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.telemetry.services import rollup_upsert
from controlplane.topology.selectors import pool_list
from controlplane.topology.services import pool_set_precision
from dashboard import figures
from dashboard.telemetry_app import APP_NAME, POOL_COLUMNS, WORKER_COLUMNS

UPDATE_URL = f"/django_plotly_dash/app/{APP_NAME}/_dash-update-component"
LIVE_OUTPUTS = [
    ("no-data", "children"),
    ("no-data", "style"),
    ("pools", "children"),
    ("instances", "children"),
    ("kv-handoff", "children"),
    ("kv-store-graph", "figure"),
    ("swa-graph", "figure"),
    ("scaling-graph", "figure"),
    ("expert-load", "children"),
]


def _callback(client, outputs: list[tuple[str, str]], component: str, prop: str, value) -> dict:
    """A server callback's outputs by "id.property", for this value of its one input."""
    body = {
        "output": "...".join(f"{output}.{output_prop}" for output, output_prop in outputs).join(["..", ".."]),
        "outputs": [{"id": output, "property": output_prop} for output, output_prop in outputs],
        "inputs": [{"id": component, "property": prop, "value": value}],
        "changedPropIds": [f"{component}.{prop}"],
        "state": [],
    }
    response = client.post(UPDATE_URL, json.dumps(body), content_type="application/json")
    assert response.status_code == 200
    return {
        f"{output}.{output_prop}": rendered
        for output, props in response.json()["response"].items()
        for output_prop, rendered in props.items()
    }


def _render_live(client, snapshot: dict | None) -> dict:
    """The render_live callback's outputs, for this value of the snapshot store."""
    return _callback(client, LIVE_OUTPUTS, "snapshot", "data", snapshot)


NO_STEPS = {"steps_per_s": 0.0, "step_time_mean_s": None, "tokens_per_step": None}


def _snapshot(**fields) -> dict:
    base = {
        "at": "2026-11-30T12:00:00+00:00",
        "window_s": 60,
        "workers": [],
        "pools": [],
        "requests": 0,
        "prompt_tokens_per_s": 0.0,
        "generation_tokens_per_s": 0.0,
        "cache_hit_rate": None,
        "ttft_s": None,
        "itl_s": None,
        "kv_store": None,
        "swa": None,
        "expert_load": {},
        "engine": NO_STEPS,
        "kv_handoff": {"received_mean_s": None, "by_backend": []},
    }
    return {**base, **fields}


@pytest.mark.django_db
def test_no_worker_running_renders_an_explicit_no_data_state(client_as, no_collector):
    # Given no collector has seen a worker (the page's first render asks with an empty store)
    client = client_as("operator")

    # When the live part renders
    rendered = _render_live(client, None)

    # Then it says so, instead of drawing zeros as if they were measured
    assert rendered["no-data.children"] == figures.NO_WORKERS
    assert rendered["no-data.style"]["display"] == "block"
    assert rendered["instances.children"]["props"]["children"] == "no instances"
    assert rendered["expert-load.children"][0]["props"]["children"] == figures.DENSE_MODEL


@pytest.mark.django_db
def test_a_snapshot_with_workers_fills_the_overview(client_as, make_pool):
    client = client_as("operator")
    make_pool("decode", kind="decode")
    worker = {
        "worker_id": "decode-0",
        "role": "decode",
        "pool": "decode",
        "state": "ready",
        "num_running": 3,
        "num_waiting": 1,
        "kv_usage": 0.25,
        "weight_dtype": "fp8_e4m3",
        "kv_cache_dtype": "fp8_e4m3",
        "engine": NO_STEPS,
    }
    pool = {
        "pool": "decode",
        "role": "decode",
        "instances": 1,
        "ready": 1,
        "num_running": 3,
        "num_waiting": 1,
        "kv_usage_mean": 0.25,
        "engine": NO_STEPS,
    }
    kv_store = {"bytes": 50, "blocks": 5, "capacity_bytes": 100, "low_watermark": 0.8, "high_watermark": 0.95}
    snapshot = _snapshot(workers=[worker], pools=[pool], kv_store=kv_store, expert_load={"decode": [[1, 2], [3, 4]]})

    rendered = _render_live(client, snapshot)

    assert rendered["no-data.style"] == {"display": "none"}
    assert "decode-0" in json.dumps(rendered["instances.children"])
    assert "25.00%" in json.dumps(rendered["pools.children"])
    assert rendered["kv-store-graph.figure"]["data"][0]["x"] == [0.5]
    assert rendered["swa-graph.figure"]["data"] == []  # no sliding-window model
    assert rendered["expert-load.children"][0]["props"]["figure"]["data"][0]["z"] == [[1, 2], [3, 4]]


@pytest.mark.django_db
def test_engine_steps_per_worker_and_pool_and_kv_handoffs_by_backend_are_shown(client_as, make_pool):
    client = client_as("operator")
    make_pool("prefill", kind="prefill")
    engine = {"steps_per_s": 4.5, "step_time_mean_s": 0.0125, "tokens_per_step": 96.0}
    worker = {
        "worker_id": "prefill-0",
        "role": "prefill",
        "pool": "prefill",
        "state": "ready",
        "num_running": 1,
        "num_waiting": 0,
        "kv_usage": 0.1,
        "weight_dtype": "",
        "kv_cache_dtype": "",
        "engine": engine,
    }
    pool = {
        "pool": "prefill",
        "role": "prefill",
        "instances": 1,
        "ready": 1,
        "num_running": 1,
        "num_waiting": 0,
        "kv_usage_mean": 0.1,
        "engine": engine,
    }
    kv_handoff = {
        "received_mean_s": 0.004,
        "by_backend": [
            {"backend": "cuda_ipc", "direction": "sent", "transfers": 0, "bytes_per_s": 0.0, "mean_s": None},
            {"backend": "zmq", "direction": "received", "transfers": 6, "bytes_per_s": 2_500_000.0, "mean_s": 0.004},
        ],
    }
    snapshot = _snapshot(workers=[worker], pools=[pool], engine=engine, kv_handoff=kv_handoff)

    rendered = _render_live(client, snapshot)

    instances, pools = json.dumps(rendered["instances.children"]), json.dumps(rendered["pools.children"])
    assert all(text in instances for text in ('"4.5"', '"12.50 ms"', '"96.0"'))
    assert all(text in pools for text in ('"12.50 ms"', '"96.0"'))
    rows = rendered["kv-handoff.children"]["props"]["children"][1]["props"]["children"]
    cells = [[cell["props"]["children"] for cell in row["props"]["children"]] for row in rows]
    assert cells == [
        ["cuda_ipc", "sent", 0, "0.00 MB/s", "no data"],
        ["zmq", "received", 6, "2.50 MB/s", "4.00 ms"],
    ]


@pytest.mark.django_db
def test_without_handoffs_the_handoff_panel_says_so(client_as, no_collector):
    rendered = _render_live(client_as("operator"), None)

    assert rendered["kv-handoff.children"]["props"]["children"] == "no KV handoffs in the last 60 s"


@pytest.mark.django_db
def test_the_step_and_handoff_times_are_seeded_from_the_minutes_rollups(client_as):
    minute = timezone.now().replace(second=0, microsecond=0)
    rollup_upsert(
        minute=minute,
        collector="gateway-a",
        requests=0,
        prompt_tokens=0,
        cached_tokens=0,
        generation_tokens=0,
        ttft_histogram={},
        itl_histogram={},
        kv_store_bytes=None,
        engine_steps=200,
        engine_step_seconds=2.0,
        kv_handoffs=4,
        kv_handoff_seconds=0.2,
    )
    outputs = [(graph, "figure") for graph in figures.SERIES]

    seeded = _callback(client_as("operator"), outputs, "seed-minutes", "data", 60)

    traces = seeded["serving-time-graph.figure"]["data"]
    assert [trace["name"] for trace in traces] == ["engine step mean", "KV handoff mean (until usable)"]
    assert [trace["y"] for trace in traces] == [[0.01], [0.05]]


@pytest.mark.django_db
def test_speculative_decoding_s_acceptance_length_and_budget_are_seeded_from_the_minutes_rollups(client_as):
    minute = timezone.now().replace(second=0, microsecond=0)
    empty = dict(requests=0, prompt_tokens=0, cached_tokens=0, generation_tokens=0, ttft_histogram={}, itl_histogram={})
    rollup_upsert(
        minute=minute - timedelta(minutes=1), collector="gateway-a", kv_store_bytes=None, **empty
    )  # before speculation
    rollup_upsert(
        minute=minute,
        collector="gateway-a",
        kv_store_bytes=None,
        spec_drafts=50,
        spec_draft_tokens=200,
        spec_accepted_tokens=110,
        spec_steps=10,
        spec_budget_tokens=200.0,
        **empty,
    )
    outputs = [(graph, "figure") for graph in figures.SERIES]

    seeded = _callback(client_as("operator"), outputs, "seed-minutes", "data", 60)

    traces = seeded["spec-decode-graph.figure"]["data"]
    assert [trace["name"] for trace in traces] == [
        "mean accepted length",
        "draft tokens verified per request",
        "budget: draft tokens verified per step",
    ]
    assert [trace["y"] for trace in traces] == [[None, 3.2], [None, 4.0], [None, 20.0]]


@pytest.mark.django_db
def test_the_swa_state_of_sliding_window_models_is_shown(client_as):
    client = client_as("operator")
    swa = {
        "state_hits": 7,
        "state_fetches": 3,
        "state_misses": 2,
        "replays": 2,
        "replayed_tokens": 256,
        "store_bytes_not_written": 4096,
    }

    figure = _render_live(client, _snapshot(swa=swa))["swa-graph.figure"]

    (bars,) = figure["data"]
    assert dict(zip(bars["y"], bars["x"])) == {"host cache": 7, "fetched": 3, "replayed": 2}
    axis = figure["layout"]["xaxis"]["title"]["text"]
    assert "256 tokens replayed in 2 replays" in axis and "4,096 bytes kept out of the store" in axis


@pytest.mark.django_db
def test_the_tables_show_each_worker_s_dtypes_and_each_pool_s_precision(make_pool):
    # given an FP8 pool and an unquantized one, and a worker of each, one not saying its dtypes
    pool_set_precision(pool=make_pool("decode"), quantization="fp8", kv_cache_dtype="fp8")
    make_pool("prefill", kind="prefill")
    fp8 = {"weight_dtype": "fp8_e4m3", "kv_cache_dtype": "fp8_e4m3"}
    unsaid = {"weight_dtype": "", "kv_cache_dtype": ""}
    workers = [
        {"worker_id": worker_id, "pool": pool, "role": pool, "state": "ready", "num_running": 0, "num_waiting": 0}
        | {"kv_usage": 0.0, "engine": NO_STEPS}
        | dtypes
        for worker_id, pool, dtypes in [("decode-0", "decode", fp8), ("prefill-0", "prefill", unsaid)]
    ]

    # when the tables' rows are made
    snapshot = _snapshot(workers=workers)
    worker_rows = [dict(zip(WORKER_COLUMNS, row, strict=True)) for row in figures.worker_rows(snapshot)]
    pool_rows = [dict(zip(POOL_COLUMNS, row, strict=True)) for row in figures.pool_rows(pool_list(), snapshot)]

    # then
    assert [(row["worker"], row["weights"], row["KV cache"]) for row in worker_rows] == [
        ("decode-0", "fp8_e4m3", "fp8_e4m3"),
        ("prefill-0", figures.NOT_REPORTED, figures.NOT_REPORTED),
    ]
    assert [(row["pool"], row["precision"]) for row in pool_rows] == [
        ("decode", "weights fp8, KV fp8"),
        ("prefill", "weights as stored, KV auto"),
    ]
