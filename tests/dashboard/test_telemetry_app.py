"""The dashboard's live parts, rendered through django-plotly-dash's callback endpoint as a browser asks."""

import json

import pytest

from dashboard import figures
from dashboard.telemetry_app import APP_NAME

UPDATE_URL = f"/django_plotly_dash/app/{APP_NAME}/_dash-update-component"
LIVE_OUTPUTS = [
    ("no-data", "children"),
    ("no-data", "style"),
    ("pools", "children"),
    ("instances", "children"),
    ("kv-store-graph", "figure"),
    ("scaling-graph", "figure"),
    ("expert-load", "children"),
]


def _render_live(client, snapshot: dict | None) -> dict:
    """The render_live callback's outputs by "id.property", for this value of the snapshot store."""
    outputs = [{"id": component, "property": prop} for component, prop in LIVE_OUTPUTS]
    body = {
        "output": "...".join(f"{component}.{prop}" for component, prop in LIVE_OUTPUTS).join(["..", ".."]),
        "outputs": outputs,
        "inputs": [{"id": "snapshot", "property": "data", "value": snapshot}],
        "changedPropIds": ["snapshot.data"],
        "state": [],
    }
    response = client.post(UPDATE_URL, json.dumps(body), content_type="application/json")
    assert response.status_code == 200
    return {
        f"{component}.{prop}": value
        for component, props in response.json()["response"].items()
        for prop, value in props.items()
    }


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
        "expert_load": {},
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
    }
    pool = {
        "pool": "decode",
        "role": "decode",
        "instances": 1,
        "ready": 1,
        "num_running": 3,
        "num_waiting": 1,
        "kv_usage_mean": 0.25,
    }
    kv_store = {"bytes": 50, "blocks": 5, "capacity_bytes": 100, "low_watermark": 0.8, "high_watermark": 0.95}
    snapshot = _snapshot(workers=[worker], pools=[pool], kv_store=kv_store, expert_load={"decode": [[1, 2], [3, 4]]})

    rendered = _render_live(client, snapshot)

    assert rendered["no-data.style"] == {"display": "none"}
    assert "decode-0" in json.dumps(rendered["instances.children"])
    assert "25.00%" in json.dumps(rendered["pools.children"])
    assert rendered["kv-store-graph.figure"]["data"][0]["x"] == [0.5]
    assert rendered["expert-load.children"][0]["props"]["figure"]["data"][0]["z"] == [[1, 2], [3, 4]]
