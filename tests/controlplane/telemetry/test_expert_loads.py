"""Expert loads from heartbeats: every heartbeat summed per pool and layout version, the live window
per pool in the snapshot and /metrics, each minute written for the EPLB job."""

from datetime import UTC, datetime

from asgiref.sync import async_to_sync
from prometheus_client.parser import text_string_to_metric_families

from controlplane.telemetry import live
from controlplane.telemetry.collector import TelemetryCollector
from controlplane.telemetry.metrics import exposition
from controlplane.telemetry.models import ExpertLoadRollup
from workers.eplb.expert_loads import ExpertLoadCounts


class FakeExpertLoads:
    """What the engine client summed since the collector's previous tick."""

    def __init__(self) -> None:
        self.pending: dict = {}

    async def __call__(self) -> dict:
        taken, self.pending = self.pending, {}
        return taken


def test_every_heartbeat_is_summed_per_pool_and_layout_version(make_heartbeat):
    counts = ExpertLoadCounts()

    for beat in [
        make_heartbeat("a", pool="moe", ep_layout_version=1, expert_load=[[1, 2], [3, 4]]),
        make_heartbeat("a", pool="moe", ep_layout_version=1, expert_load=[[10, 20], [30, 40]]),
        make_heartbeat("b", pool="moe", ep_layout_version=2, expert_load=[[5, 5], [5, 5]]),
        make_heartbeat("c", pool="dense"),
    ]:
        counts.add(beat)

    assert counts.take() == {("moe", 1): [[11, 22], [33, 44]], ("moe", 2): [[5, 5], [5, 5]]}
    assert counts.take() == {}


def test_the_collector_sums_the_window_and_writes_each_minute(clock, heartbeats, db):
    loads = FakeExpertLoads()
    collector = TelemetryCollector(heartbeats, clock=clock, expert_loads=loads, window_s=60)
    minute = datetime.fromtimestamp(clock.now, UTC)

    loads.pending = {("moe", 3): [[1, 2, 3]]}
    clock.now += 10
    async_to_sync(collector.tick)()
    loads.pending = {("moe", 3): [[10, 20, 30]], ("moe", 4): [[100, 0, 0]]}
    clock.now += 10
    snapshot = async_to_sync(collector.tick)()

    assert snapshot["expert_load"] == {"moe": [[111, 22, 33]]}
    assert not ExpertLoadRollup.objects.exists()  # the minute is still running

    clock.now += 45  # into the next minute
    later = async_to_sync(collector.tick)()

    rows = {row.layout_version: row for row in ExpertLoadRollup.objects.all()}
    assert set(rows) == {3, 4}
    assert (rows[3].pool, rows[3].minute, rows[3].slot_loads) == ("moe", minute, [[11, 22, 33]])
    assert rows[4].slot_loads == [[100, 0, 0]]
    assert later["expert_load"] == {"moe": [[111, 22, 33]]}  # both ticks are within the last 60 s

    clock.now += 120  # the window has passed
    assert async_to_sync(collector.tick)()["expert_load"] == {}


def test_metrics_show_the_window_per_pool_layer_and_slot(make_heartbeat, clock, heartbeats, db):
    loads = FakeExpertLoads()
    collector = TelemetryCollector(heartbeats, clock=clock, expert_loads=loads)
    loads.pending = {("moe", 1): [[7, 0], [1, 2]]}
    async_to_sync(collector.tick)()

    try:
        families = {f.name: f for f in text_string_to_metric_families(exposition([make_heartbeat()]).decode())}
    finally:
        live.forget()

    samples = {
        (s.labels["pool"], s.labels["layer"], s.labels["slot"]): s.value for s in families["sluice:expert_load"].samples
    }
    assert samples == {("moe", "0", "0"): 7, ("moe", "0", "1"): 0, ("moe", "1", "0"): 1, ("moe", "1", "1"): 2}
