"""What a model with sliding-window layers did with its SWA state since the engine started: where the
state for a prefix hit came from, and what a missing one cost (workers.engine.kv.spec says why the
state is not in the store)."""

from dataclasses import dataclass


@dataclass(slots=True)
class SwaStats:
    # Prefix hits whose SWA state for the hit's end was found in this worker's host cache, fetched
    # from the worker that holds it, or had to be replayed.
    state_hits: int = 0
    state_fetches: int = 0
    state_misses: int = 0
    # Bounded replays run, and the tokens they recomputed.
    replays: int = 0
    replayed_tokens: int = 0
    # Bytes the store did not write because the SWA layers' KV stays with the worker.
    store_bytes_not_written: int = 0

    def count_replay(self, start: int, end: int) -> None:
        """A replay recomputed positions [start, end) for the windows."""
        self.replays += 1
        self.replayed_tokens += end - start
