"""Round-robin and least-requests balancers, with the interfaces of the prefill and decode balancers,
as the baselines lb_sim compares against. The decode baselines respect KV capacity too (skipping
workers without room), so a comparison measures placement, not overflow."""

from collections.abc import Sequence

from workers.client.routing.balancers.decode import DecodeLoadTracker, DecodeWorker


class RoundRobinPrefill:
    def __init__(self, worker_ids: Sequence[str]) -> None:
        if not worker_ids:
            raise ValueError("a prefill balancer needs at least one worker")
        self.worker_ids = list(worker_ids)
        self._next = 0

    def choose(self, request_tokens: int, hit_tokens: int) -> str:
        worker_id = self.worker_ids[self._next]
        self._next = (self._next + 1) % len(self.worker_ids)
        return worker_id

    def on_progress(self, worker_id: str, done_s: float) -> None:
        pass

    def on_done(self, worker_id: str, leftover_s: float = 0.0) -> None:
        pass

    def rebalance(self, now: float) -> bool:
        return False


class LeastRequestsPrefill:
    """The worker with the fewest requests assigned and not done; the first such on ties."""

    def __init__(self, worker_ids: Sequence[str]) -> None:
        if not worker_ids:
            raise ValueError("a prefill balancer needs at least one worker")
        self.in_flight = dict.fromkeys(worker_ids, 0)

    def choose(self, request_tokens: int, hit_tokens: int) -> str:
        worker_id = min(self.in_flight, key=self.in_flight.__getitem__)
        self.in_flight[worker_id] += 1
        return worker_id

    def on_progress(self, worker_id: str, done_s: float) -> None:
        pass

    def on_done(self, worker_id: str, leftover_s: float = 0.0) -> None:
        self.in_flight[worker_id] -= 1

    def rebalance(self, now: float) -> bool:
        return False


class RoundRobinDecode(DecodeLoadTracker):
    """The next worker in turn that has room; None when none has."""

    def __init__(self, workers: Sequence[DecodeWorker]) -> None:
        super().__init__(workers)
        self._order = list(self.workers.values())
        self._next = 0

    def choose(self, request_kv_tokens: int, expected_output_tokens: int) -> str | None:
        for offset in range(len(self._order)):
            worker = self._order[(self._next + offset) % len(self._order)]
            if worker.fits(request_kv_tokens + expected_output_tokens):
                self._next = (self._next + offset + 1) % len(self._order)
                return self._admit(worker, request_kv_tokens, expected_output_tokens)
        return None


class LeastRequestsDecode(DecodeLoadTracker):
    """Among workers with room, the one with the fewest requests; None when none has room."""

    def choose(self, request_kv_tokens: int, expected_output_tokens: int) -> str | None:
        peak = request_kv_tokens + expected_output_tokens
        fitting = [w for w in self.workers.values() if w.fits(peak)]
        if not fitting:
            return None
        worker = min(fitting, key=lambda w: w.num_requests)
        return self._admit(worker, request_kv_tokens, expected_output_tokens)
