"""The cluster dashboard as one Dash app (django-plotly-dash, stateless).

Live updates: a clientside callback opens a websocket to TelemetryConsumer (/ws/telemetry/) once per page
and writes every snapshot the collector broadcasts into the "snapshot" store. From there the time-series
figures are extended in the browser (extendData: no round trip), and one server callback re-renders the
parts that also need the database (pools, scaling events) or are cheaper to draw in Python.
"""

from datetime import timedelta

from dash import Input, Output, State, dcc, html
from django.utils import timezone
from django_plotly_dash import DjangoDash

from controlplane.telemetry.live import current_snapshot
from controlplane.telemetry.selectors import rollup_series
from controlplane.topology.models import PoolKind
from controlplane.topology.selectors import pool_list, scaling_event_list
from dashboard import figures

APP_NAME = "sluice-telemetry"
SOCKET_PATH = "/ws/telemetry/"
SEED_MINUTES = 60
SCALING_WINDOW = timedelta(hours=24)
SCALING_EVENTS_SHOWN = 200
# Live points kept per trace: an hour at the collector's one snapshot a second.
LIVE_POINTS = 3600

# The engine's steps over the last 60 s: their mean time, and tokens per step (and steps/s per worker).
ENGINE_COLUMNS = ("step mean", "tokens/step")
POOL_COLUMNS = (
    "cluster",
    "pool",
    "kind",
    "model",
    "precision",
    "instances",
    "ready/seen",
    "running",
    "waiting",
    "KV usage",
    *ENGINE_COLUMNS,
)
WORKER_COLUMNS = (
    "worker",
    "pool",
    "role",
    "state",
    "weights",
    "KV cache",
    "running",
    "waiting",
    "KV usage",
    "steps/s",
    *ENGINE_COLUMNS,
)
# Vision encoders: image patches held now and encoded over the last 60 s, one encoder's measured
# capacity, and the embedding cache.
ENCODE_POOL_COLUMNS = (
    "cluster",
    "pool",
    "model",
    "instances",
    "ready/seen",
    "patches in flight",
    "patches/s",
    "capacity/encoder (patches/s)",
    "embedding cache hit rate",
    "embedding cache",
)
ENCODER_COLUMNS = (
    "encoder",
    "pool",
    "state",
    "patches in flight",
    "patches encoded",
    "patches/s",
    "capacity (patches/s)",
    "cache hit rate",
    "cache hits/misses",
    "cache size",
)
HANDOFF_COLUMNS = ("backend", "direction", "handoffs", "throughput", "mean per handoff")

# Per figure, the snapshot fields (dotted paths) its traces show, in trace order.
SERIES_PATHS = {graph: [path for path, _, _ in traces] for graph, traces in figures.SERIES.items()}

app = DjangoDash(APP_NAME, serve_locally=True)


def _graph(graph_id: str) -> dcc.Graph:
    # Traces exist from the start, so live points can extend them before the rollups arrive.
    return dcc.Graph(id=graph_id, figure=figures.series_figure(graph_id, []))


app.layout = html.Div(
    [
        dcc.Store(id="socket-path", data=SOCKET_PATH),
        dcc.Store(id="socket-state", data="connecting"),
        dcc.Store(id="snapshot"),
        dcc.Store(id="seed-minutes", data=SEED_MINUTES),
        dcc.Store(
            id="series-paths", data={graph: [path for path, _, _ in traces] for graph, traces in figures.SERIES.items()}
        ),
        html.Div(id="no-data", style={"display": "none"}),
        html.P(
            [
                "Cache hit rate (last 60 s): ",
                html.Strong("no data", id="hit-rate-value"),
                " · live feed: ",
                html.Span("connecting", id="socket-status"),
            ]
        ),
        html.H3("Pools"),
        html.Div(id="pools"),
        html.H3("Instances"),
        html.Div(id="instances"),
        html.H3("Vision encoders"),
        html.Div(id="encoders"),
        dcc.Graph(id="encoders-graph"),
        html.H3("KV handoff (last 60 s)"),
        html.Div(id="kv-handoff"),
        *(_graph(graph_id) for graph_id in figures.SERIES),
        dcc.Graph(id="kv-store-graph"),
        dcc.Graph(id="swa-graph"),
        dcc.Graph(id="scaling-graph"),
        html.H3("Expert load"),
        html.Div(id="expert-load"),
    ],
    style={"fontFamily": "sans-serif", "padding": "0 1rem"},
)

# Reconnects after a close (a restarted gateway), so a page left open keeps following the cluster.
app.clientside_callback(
    """
    function (path) {
        const url = (window.location.protocol === "https:" ? "wss://" : "ws://") + window.location.host + path;
        const connect = () => {
            const socket = new WebSocket(url);
            socket.onopen = () => dash_clientside.set_props("socket-state", {data: "live"});
            socket.onmessage = (event) => {
                dash_clientside.set_props("snapshot", {data: JSON.parse(event.data).snapshot});
            };
            socket.onclose = () => {
                dash_clientside.set_props("socket-state", {data: "disconnected, reconnecting"});
                setTimeout(connect, 2000);
            };
        };
        connect();
        return "connecting";
    }
    """,
    Output("socket-state", "data"),
    Input("socket-path", "data"),
)

app.clientside_callback(
    "function (state) { return state; }",
    Output("socket-status", "children"),
    Input("socket-state", "data"),
)

app.clientside_callback(
    f"""
    function (snapshot, paths) {{
        const skip = dash_clientside.no_update;
        if (!snapshot) {{
            return [skip, skip, skip, skip, skip, skip];
        }}
        const pick = (path) => path.split(".").reduce((value, key) => (value == null ? null : value[key]), snapshot);
        const extend = (graph) => [
            {{x: paths[graph].map(() => [snapshot.at]), y: paths[graph].map((path) => [pick(path)])}},
            paths[graph].map((_, index) => index),
            {LIVE_POINTS},
        ];
        const rate = snapshot.cache_hit_rate;
        return [
            extend("hit-rate-graph"),
            extend("latency-graph"),
            extend("tokens-graph"),
            extend("serving-time-graph"),
            extend("spec-decode-graph"),
            rate == null ? "no data" : (rate * 100).toFixed(2) + "%",
        ];
    }}
    """,
    Output("hit-rate-graph", "extendData"),
    Output("latency-graph", "extendData"),
    Output("tokens-graph", "extendData"),
    Output("serving-time-graph", "extendData"),
    Output("spec-decode-graph", "extendData"),
    Output("hit-rate-value", "children"),
    Input("snapshot", "data"),
    State("series-paths", "data"),
)


@app.callback(
    Output("hit-rate-graph", "figure"),
    Output("latency-graph", "figure"),
    Output("tokens-graph", "figure"),
    Output("serving-time-graph", "figure"),
    Output("spec-decode-graph", "figure"),
    Input("seed-minutes", "data"),
)
def seed_series(minutes: int):
    rollups = rollup_series(minutes=int(minutes))
    return tuple(figures.series_figure(graph_id, rollups) for graph_id in figures.SERIES)


@app.callback(
    Output("no-data", "children"),
    Output("no-data", "style"),
    Output("pools", "children"),
    Output("instances", "children"),
    Output("kv-handoff", "children"),
    Output("kv-store-graph", "figure"),
    Output("swa-graph", "figure"),
    Output("scaling-graph", "figure"),
    Output("expert-load", "children"),
    Input("snapshot", "data"),
)
def render_live(snapshot: dict | None):
    # Before the first websocket message (page load) draw the collector's latest snapshot.
    snapshot = snapshot or current_snapshot()
    banner, banner_style = figures.no_data_banner(snapshot)
    recent = scaling_event_list(since=timezone.now() - SCALING_WINDOW).order_by("-created_at")
    events = list(recent[:SCALING_EVENTS_SHOWN])[::-1]
    return (
        banner,
        banner_style,
        figures.table("pools-table", POOL_COLUMNS, figures.pool_rows(pool_list(), snapshot), empty="no pools"),
        figures.table("instances-table", WORKER_COLUMNS, figures.worker_rows(snapshot), empty="no instances"),
        figures.table(
            "kv-handoff-table",
            HANDOFF_COLUMNS,
            figures.handoff_rows(snapshot["kv_handoff"]),
            empty="no KV handoffs in the last 60 s",
        ),
        figures.kv_store_figure(snapshot["kv_store"]),
        figures.swa_figure(snapshot["swa"]),
        figures.scaling_timeline(events),
        figures.expert_heatmaps(snapshot["expert_load"]),
    )


@app.callback(
    Output("encoders", "children"),
    Output("encoders-graph", "figure"),
    Input("snapshot", "data"),
)
def render_encoders(snapshot: dict | None):
    """The encode pools (configured ones, with what the snapshot saw of them) and their encoders."""
    snapshot = snapshot or current_snapshot()
    pools = figures.encode_pool_rows(pool_list(kind=PoolKind.ENCODE), snapshot)
    return (
        [
            figures.table("encode-pools-table", ENCODE_POOL_COLUMNS, pools, empty="no encode pool"),
            figures.table("encoders-table", ENCODER_COLUMNS, figures.encoder_rows(snapshot), empty=figures.NO_ENCODERS),
        ],
        figures.encoder_figure(snapshot),
    )
