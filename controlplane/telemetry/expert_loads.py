"""Expert loads in the telemetry collector: the per-slot token counts the engine client summed from
MoE workers' heartbeats, summed per pool over the live window for the heatmap and /metrics, and per
pool and EP layout version over each minute for the EPLB job (ExpertLoadRollup)."""

from collections import deque

from workers.eplb.expert_loads import SlotLoads, add_slot_loads


class ExpertLoadWindow:
    """Per-pool slot loads of the last `window_s` seconds, and of the minute in progress per layout."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._recent: deque[tuple[float, str, SlotLoads]] = deque()
        self.minute: dict[tuple[str, int], SlotLoads] = {}

    def add(self, now: float, counts: dict[tuple[str, int], SlotLoads]) -> None:
        for (pool, version), loads in counts.items():
            self._recent.append((now, pool, loads))
            self.minute[(pool, version)] = add_slot_loads(self.minute.get((pool, version)), loads)

    def end_minute(self) -> dict[tuple[str, int], SlotLoads]:
        ended, self.minute = self.minute, {}
        return ended

    def by_pool(self, now: float) -> dict[str, SlotLoads]:
        """{pool: [layer][slot]} tokens routed in the window."""
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()
        totals: dict[str, SlotLoads] = {}
        for _, pool, loads in self._recent:
            totals[pool] = add_slot_loads(totals.get(pool), loads)
        return totals
