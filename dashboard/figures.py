"""Snapshot and rollup dicts → Dash components and Plotly figures. Presentation only: every number shown
here was computed by the telemetry collector or read by a controlplane selector."""

from collections.abc import Iterable, Sequence

import plotly.graph_objects as go
from dash import dcc, html

NO_WORKERS = "No data: no engine worker is running"
DENSE_MODEL = "dense model: no experts"
NOT_REPORTED = "not reported"
NO_ENCODERS = "no vision encoder is running"

# Traces of each time-series figure: (snapshot path, rollup field, legend name). The live extension
# (a clientside callback in telemetry_app) appends to the same traces in the same order.
SERIES: dict[str, list[tuple[str, str, str]]] = {
    "hit-rate-graph": [("cache_hit_rate", "cache_hit_rate", "cache hit rate")],
    "latency-graph": [
        ("ttft_s.p50", "ttft_p50_s", "TTFT p50"),
        ("ttft_s.p99", "ttft_p99_s", "TTFT p99"),
        ("itl_s.p50", "itl_p50_s", "ITL p50"),
        ("itl_s.p99", "itl_p99_s", "ITL p99"),
    ],
    "tokens-graph": [
        ("prompt_tokens_per_s", "prompt_tokens", "prompt tokens/s"),
        ("generation_tokens_per_s", "generation_tokens", "generation tokens/s"),
    ],
    "serving-time-graph": [
        ("engine.step_time_mean_s", "step_time_mean_s", "engine step mean"),
        ("kv_handoff.received_mean_s", "kv_handoff_mean_s", "KV handoff mean (until usable)"),
    ],
    "spec-decode-graph": [
        ("spec_decode.acceptance_length", "spec_acceptance_length", "mean accepted length"),
        ("spec_decode.verified_per_draft", "spec_verified_per_draft", "draft tokens verified per request"),
        ("spec_decode.budget_per_step", "spec_budget_per_step", "budget: draft tokens verified per step"),
    ],
}
SERIES_TITLES = {
    "hit-rate-graph": ("Prefix-cache hit rate", "fraction of prompt tokens"),
    "latency-graph": ("Latency percentiles", "seconds"),
    "tokens-graph": ("Throughput", "tokens/s"),
    "serving-time-graph": ("Engine step and KV handoff time, all workers", "seconds"),
    "spec-decode-graph": ("Speculative decoding, all workers", "tokens"),
}
PER_MINUTE_FIELDS = {"prompt_tokens", "generation_tokens"}


def _layout(figure: go.Figure, title: str, yaxis: str = "") -> go.Figure:
    figure.update_layout(title=title, yaxis_title=yaxis, height=300, margin={"l": 60, "r": 20, "t": 40, "b": 40})
    return figure


def _empty_figure(title: str, message: str) -> go.Figure:
    figure = _layout(go.Figure(), title)
    figure.add_annotation(text=message, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    figure.update_xaxes(visible=False)
    figure.update_yaxes(visible=False)
    return figure


def no_data_banner(snapshot: dict) -> tuple[str, dict]:
    """(text, style) of the banner that says the numbers below are not coming from any worker."""
    if snapshot["workers"]:
        return "", {"display": "none"}
    return NO_WORKERS, {"display": "block", "padding": "1rem", "background": "#fff3cd", "fontWeight": "bold"}


def percent(value: float | None) -> str:
    return "no data" if value is None else f"{value * 100:.2f}%"


def milliseconds(seconds: float | None) -> str:
    return "no data" if seconds is None else f"{seconds * 1000:.2f} ms"


def one_decimal(value: float | None) -> str:
    return "no data" if value is None else f"{value:.1f}"


def table(table_id: str, columns: Sequence[str], rows: Iterable[Sequence], *, empty: str) -> html.Table | html.P:
    rows = list(rows)
    if not rows:
        return html.P(empty, id=f"{table_id}-empty")
    head = html.Thead(html.Tr([html.Th(column) for column in columns]))
    body = html.Tbody([html.Tr([html.Td(cell) for cell in row]) for row in rows])
    return html.Table([head, body], id=table_id, style={"borderSpacing": "1rem 0.2rem"})


def pool_rows(pools: Iterable, snapshot: dict) -> list[tuple]:
    """Configured pools (topology models) with what the snapshot saw of them."""
    live = {pool["pool"]: pool for pool in snapshot["pools"]}
    rows = []
    for pool in pools:
        seen = live.get(pool.name, {})
        kv = seen.get("kv_usage_mean")
        engine = seen.get("engine", {})
        rows.append(
            (
                pool.cluster.name,
                pool.name,
                pool.kind,
                pool.model,
                pool_precision(pool),
                f"{pool.min_instances}..{pool.max_instances} (target {pool.target_instances})",
                f"{seen.get('ready', 0)}/{seen.get('instances', 0)}",
                seen.get("num_running", 0),
                seen.get("num_waiting", 0),
                percent(kv),
                milliseconds(engine.get("step_time_mean_s")),
                one_decimal(engine.get("tokens_per_step")),
            )
        )
    return rows


def pool_precision(pool) -> str:
    """What the pool asks of the workers it starts: weight quantization and KV cache storage."""
    return f"weights {pool.quantization or 'as stored'}, KV {pool.kv_cache_dtype}"


def worker_rows(snapshot: dict) -> list[tuple]:
    """Workers as their heartbeats report them, with the dtypes they hold weights and KV cache in."""
    return [
        (
            worker["worker_id"],
            worker["pool"],
            worker["role"],
            worker["state"],
            worker["weight_dtype"] or NOT_REPORTED,
            worker["kv_cache_dtype"] or NOT_REPORTED,
            worker["num_running"],
            worker["num_waiting"],
            percent(worker["kv_usage"]),
            one_decimal(worker["engine"]["steps_per_s"]),
            milliseconds(worker["engine"]["step_time_mean_s"]),
            one_decimal(worker["engine"]["tokens_per_step"]),
        )
        for worker in snapshot["workers"]
    ]


def encode_pool_rows(pools: Iterable, snapshot: dict) -> list[tuple]:
    """Configured encode pools (topology models) with what the snapshot saw of their encoders."""
    live = {pool["pool"]: pool for pool in snapshot["pools"]}
    rows = []
    for pool in pools:
        seen = live.get(pool.name, {})
        encoder = seen.get("encoder") or {}
        cache = encoder.get("embedding_cache", {})
        rows.append(
            (
                pool.cluster.name,
                pool.name,
                pool.model,
                f"{pool.min_instances}..{pool.max_instances} (target {pool.target_instances})",
                f"{seen.get('ready', 0)}/{seen.get('instances', 0)}",
                encoder.get("patches_in_flight", 0),
                one_decimal(encoder.get("patches_per_s")),
                capacity(encoder.get("capacity_patches_per_s")),
                percent(cache.get("hit_rate")),
                megabytes(cache.get("bytes")),
            )
        )
    return rows


def encoder_rows(snapshot: dict) -> list[tuple]:
    """The encode workers as their heartbeats report them: patches held and encoded, their measured
    capacity, and their embedding caches."""
    rows = []
    for worker in snapshot["workers"]:
        encoder = worker.get("encoder")
        if encoder is None:
            continue
        cache = encoder["embedding_cache"]
        rows.append(
            (
                worker["worker_id"],
                worker["pool"],
                worker["state"],
                encoder["patches_in_flight"],
                encoder["patches_encoded"],
                one_decimal(encoder["patches_per_s"]),
                capacity(encoder["capacity_patches_per_s"]),
                percent(cache["hit_rate"]),
                f"{cache['hits']}/{cache['misses']}",
                megabytes(cache["bytes"]),
            )
        )
    return rows


def capacity(patches_per_s: float | None) -> str:
    """An encoder's measured patches per second (0: not measured yet)."""
    return "not measured" if not patches_per_s else f"{patches_per_s:.1f}"


def megabytes(num_bytes: int | None) -> str:
    return "no data" if num_bytes is None else f"{num_bytes / 1e6:.2f} MB"


def encoder_figure(snapshot: dict) -> go.Figure:
    """Patches each encoder holds now (what the gateway balances on), its cache hit rate as the label."""
    title = "Vision encoders: patches in flight"
    encoders = [worker for worker in snapshot["workers"] if worker.get("encoder") is not None]
    if not encoders:
        return _empty_figure(title, NO_ENCODERS)
    figure = _layout(
        go.Figure(
            go.Bar(
                x=[worker["encoder"]["patches_in_flight"] for worker in encoders],
                y=[worker["worker_id"] for worker in encoders],
                orientation="h",
                text=[
                    f"cache hit rate {percent(worker['encoder']['embedding_cache']['hit_rate'])}" for worker in encoders
                ],
                name="patches in flight",
            )
        ),
        title,
    )
    figure.update_layout(height=220)
    figure.update_xaxes(title="patches in flight")
    return figure


def handoff_rows(kv_handoff: dict) -> list[tuple]:
    """Per transfer backend and direction: the window's handoffs, bytes per second and mean time each."""
    return [
        (
            row["backend"],
            row["direction"],
            row["transfers"],
            f"{row['bytes_per_s'] / 1e6:.2f} MB/s",
            milliseconds(row["mean_s"]),
        )
        for row in kv_handoff["by_backend"]
    ]


def series_figure(graph_id: str, rollups: Sequence[dict]) -> go.Figure:
    """One time-series figure seeded from the per-minute rollups; per-minute token counts become rates."""
    title, yaxis = SERIES_TITLES[graph_id]
    figure = _layout(go.Figure(), title, yaxis)
    for _, field, name in SERIES[graph_id]:
        scale = 1 / 60 if field in PER_MINUTE_FIELDS else 1
        values = [None if row[field] is None else row[field] * scale for row in rollups]
        figure.add_trace(go.Scatter(x=[row["minute"] for row in rollups], y=values, name=name, mode="lines+markers"))
    if graph_id == "hit-rate-graph":
        figure.update_yaxes(range=[0, 1.05])
    return figure


def kv_store_figure(kv_store: dict | None) -> go.Figure:
    """Usage as a fraction of capacity against the GC's watermarks (fractions too); in bytes when no
    worker that runs the store's GC has reported its capacity."""
    title = "KV block store usage"
    if kv_store is None:
        return _empty_figure(title, "no KV block store reported")
    capacity = kv_store["capacity_bytes"]
    label = f"{kv_store['bytes']:,} bytes in {kv_store['blocks']:,} blocks"
    used = kv_store["bytes"] / capacity if capacity else kv_store["bytes"]
    figure = _layout(go.Figure(go.Bar(x=[used], y=["store"], orientation="h", text=[label], name="used")), title)
    figure.update_layout(height=220)
    if not capacity:
        figure.update_xaxes(title="bytes (capacity not reported)")
        return figure
    for name, fraction, color in (
        ("low watermark", kv_store["low_watermark"], "orange"),
        ("high watermark", kv_store["high_watermark"], "red"),
    ):
        if fraction is not None:
            figure.add_vline(x=fraction, line_color=color, line_dash="dash", annotation_text=name)
    figure.update_xaxes(range=[0, 1], title="fraction of capacity", tickformat=".0%")
    return figure


def swa_figure(swa: dict | None) -> go.Figure:
    """Where sliding-window models' prefix hits found their SWA state since each worker started, with
    what the replays of missing states recomputed and the bytes kept out of the store."""
    title = "SWA state of prefix hits"
    if swa is None:
        return _empty_figure(title, "no sliding-window model served")
    outcomes = {
        "host cache": swa["state_hits"],
        "fetched": swa["state_fetches"],
        "replayed": swa["state_misses"],
    }
    figure = _layout(
        go.Figure(go.Bar(x=list(outcomes.values()), y=list(outcomes), orientation="h", text=list(outcomes.values()))),
        title,
    )
    figure.update_layout(height=220)
    figure.update_xaxes(
        title=f"prefix hits · {swa['replayed_tokens']:,} tokens replayed in {swa['replays']:,} replays · "
        f"{swa['store_bytes_not_written']:,} bytes kept out of the store"
    )
    return figure


def scaling_timeline(events: Sequence) -> go.Figure:
    """ScalingEvents over time, one row per pool, one trace per action; the hover text says who acted
    and why, with the autoscaler's rule and its main figures."""
    title = "Scaling timeline"
    if not events:
        return _empty_figure(title, "no scaling events in this period")
    figure = _layout(go.Figure(), title, "pool")
    by_action: dict[str, list] = {}
    for event in events:
        by_action.setdefault(event.action, []).append(event)
    for action, group in by_action.items():
        figure.add_trace(
            go.Scatter(
                name=action,
                x=[event.created_at for event in group],
                y=[event.pool.name if event.pool else "-" for event in group],
                mode="markers",
                marker={"size": 12},
                text=[scaling_event_text(event) for event in group],
                hoverinfo="text+x",
            )
        )
    return figure


def scaling_event_text(event) -> str:
    text = f"{event.action} by {event.actor_label}: {event.reason}"
    if event.before.get("target_instances") is not None and "target_instances" in event.after:
        text += f"<br>target {event.before['target_instances']} → {event.after['target_instances']}"
    why = event.why or {}
    if why.get("rule"):
        inputs = why.get("inputs", {})
        figures = [f"rule {why['rule']}", f"wanted {why.get('wanted')}"]
        figures += [f"{name} {inputs[name]}" for name in ("utilization", "quota_use_after") if name in inputs]
        figures += [f"{name} {demand['mean']:.1f}" for name, demand in inputs.get("demands", {}).items()]
        text += "<br>" + ", ".join(figures)
    return text


def expert_heatmaps(expert_load: dict[str, list[list[float]]]) -> list:
    """One heatmap per MoE pool: tokens per [layer][physical slot] over the telemetry window."""
    if not expert_load:
        return [html.P(DENSE_MODEL, id="expert-load-empty")]
    return [
        dcc.Graph(
            figure=_layout(
                go.Figure(go.Heatmap(z=loads, colorscale="Viridis", colorbar={"title": "load"})),
                f"Expert load: pool {pool}",
                "MoE layer",
            ).update_xaxes(title="expert slot (rank x slots per rank + slot)")
        )
        for pool, loads in sorted(expert_load.items())
    ]
