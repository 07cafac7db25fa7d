"""A worker the engine client finds dead has its SWA holder registrations dropped: once per life, only for
workers that serve SWA state, and a failing index costs a log line, not the client."""

import asyncio

import msgspec

from tests.workers.client.routing.test_swa_routing import heartbeat
from workers.client.dead_holders import DeadHolders
from workers.kvstore.holders import MemoryHolders
from workers.kvstore.remote_holders import RemoteHolders
from workers.protocol.messages import SwaLayers

LAYERS = SwaLayers(window=8, num_layers=1, replay="approximate", state_endpoint="ipc://a.swa")


class CountingHolders(MemoryHolders):
    """The in-memory index, counting the drop_worker calls that reach it."""

    def __init__(self) -> None:
        super().__init__()
        self.drops: list[str] = []

    def drop_worker(self, worker_id: str) -> int:
        self.drops.append(worker_id)
        return super().drop_worker(worker_id)


def test_each_life_of_a_worker_that_served_state_is_dropped_once():
    holders = CountingHolders()
    holders.register([b"k1", b"k2"], "a")
    holders.register([b"k1"], "b")

    async def run():
        dead = DeadHolders(holders)
        first_life = heartbeat("a", LAYERS)
        for _ in range(3):  # the watchdog sees it dead on every tick
            dead.found_dead(first_life)
        dead.found_dead(None)  # never heard from: nothing known to drop
        dead.found_dead(heartbeat("dense", None))
        dead.found_dead(heartbeat("no-state", SwaLayers(window=8, num_layers=1, replay="exact")))
        await dead.wait()
        holders.register([b"k2"], "a")  # a second life registers, then dies too
        dead.found_dead(msgspec.structs.replace(first_life, started_at=1.0))
        await dead.wait()

    asyncio.run(run())
    assert holders.drops == ["a", "a"]
    assert holders.holders([b"k1", b"k2"]) == [{"b"}, set()]


def test_an_index_that_fails_costs_a_warning(tmp_path, caplog):
    async def run():
        dead = DeadHolders(RemoteHolders(f"ipc://{tmp_path}/no-index", timeout_s=0.1))
        dead.found_dead(heartbeat("a", LAYERS))
        await dead.wait()

    asyncio.run(run())
    assert "dropping dead worker a's SWA holder registrations failed" in caplog.text
