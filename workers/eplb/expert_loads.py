"""Sums of the per-slot expert loads MoE workers send in heartbeats (each the tokens routed since
that worker's previous heartbeat), kept per pool and EP layout version until someone takes them."""

from dataclasses import dataclass, field

from workers.protocol.messages import WorkerHeartbeat

SlotLoads = list[list[int]]  # [layer][rank * slots_per_rank + slot]


def add_slot_loads(total: SlotLoads | None, more: SlotLoads) -> SlotLoads:
    """total + more, slot by slot; `more` alone when the shapes differ (the pool changed size)."""
    if total is None or len(total) != len(more) or any(len(a) != len(b) for a, b in zip(total, more)):
        return [list(row) for row in more]
    return [[a + b for a, b in zip(row, other)] for row, other in zip(total, more)]


@dataclass
class ExpertLoadCounts:
    by_layout: dict[tuple[str, int], SlotLoads] = field(default_factory=dict)  # by (pool, layout version)

    def add(self, heartbeat: WorkerHeartbeat) -> None:
        if heartbeat.expert_load:
            key = (heartbeat.pool, heartbeat.ep_layout_version)
            self.by_layout[key] = add_slot_loads(self.by_layout.get(key), heartbeat.expert_load)

    def take(self) -> dict[tuple[str, int], SlotLoads]:
        """What was summed since the last take."""
        taken, self.by_layout = self.by_layout, {}
        return taken
