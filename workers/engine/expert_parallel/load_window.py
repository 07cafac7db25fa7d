"""The expert load a heartbeat reports: tokens routed to each physical slot per MoE layer, summed
over the ranks, since the previous heartbeat took it."""

import threading


class LoadWindow:
    """Filled by the engine's loop, taken by the heartbeat thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: list[list[int]] = []

    def add(self, per_rank: list[list[list[int]]], *, restart: bool = False) -> None:
        """Add the ranks' counts ([rank][layer][slot]). `restart`: the slots mean other experts now
        (a new placement, a re-formed group), so the counts so far are dropped, not mixed in."""
        per_rank = [counts for counts in per_rank if counts]
        if not per_rank:
            return
        summed = [[sum(column) for column in zip(*layers, strict=True)] for layers in zip(*per_rank, strict=True)]
        with self._lock:
            if restart or not self._counts:
                self._counts = summed
            else:
                self._counts = [
                    [a + b for a, b in zip(old, new, strict=True)]
                    for old, new in zip(self._counts, summed, strict=True)
                ]

    def clear(self) -> None:
        with self._lock:
            self._counts = []

    def take(self) -> list[list[int]]:
        with self._lock:
            counts, self._counts = self._counts, []
        return counts
