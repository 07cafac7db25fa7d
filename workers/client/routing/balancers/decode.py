"""Decode load balancing by request count and total KV length, never over a worker's KV capacity.

A decode step costs about `a + per_request_s * requests + per_kv_token_s * total_kv` (the cost
model's decode form), so a worker is loaded in two dimensions: its batch and its KV. The balancer
keeps both balanced by placing each request where it least increases the sum over workers of
(batch cost)^2 + (KV cost)^2. The increase is per_request_s^2 * (2*requests + 1) for the batch and
per_kv_token_s^2 * (2*kv + k) * k for a request of k KV tokens: for a short request the batch term
dominates, so it goes where there are few requests even if their KV is long; for a long request
the KV term dominates, so it goes where the total KV is short. With one dimension free this reduces
to least-requests or least-KV.

KV capacity is reserved at a request's peak (prompt plus expected output), so a worker can never run
out of KV once a request is admitted; when no worker has room the caller waits and asks again.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from workers.cost_model import PrefillCostModel


@dataclass(slots=True)
class DecodeWorker:
    worker_id: str
    kv_capacity: int  # tokens of KV the worker holds
    max_requests: int  # its largest decode batch
    num_requests: int = 0
    kv_tokens: int = 0  # current KV of its requests (reported as they grow)
    reserved_kv_tokens: int = 0  # the sum of its requests' peak KV

    def fits(self, peak_kv_tokens: int) -> bool:
        return self.num_requests < self.max_requests and self.reserved_kv_tokens + peak_kv_tokens <= self.kv_capacity


def new_workers(worker_ids: Sequence[str], *, kv_capacity: int, max_requests: int) -> list[DecodeWorker]:
    if not worker_ids or len(set(worker_ids)) != len(worker_ids):
        raise ValueError("decode workers need distinct ids, at least one")
    if kv_capacity < 1 or max_requests < 1:
        raise ValueError("kv_capacity and max_requests must be positive")
    return [DecodeWorker(w, kv_capacity=kv_capacity, max_requests=max_requests) for w in worker_ids]


class DecodeLoadTracker:
    """The bookkeeping every decode policy shares: admissions, KV reports, completions."""

    def __init__(self, workers: Sequence[DecodeWorker]) -> None:
        if not workers:
            raise ValueError("a decode balancer needs at least one worker")
        self.workers = {worker.worker_id: worker for worker in workers}

    def _admit(self, worker: DecodeWorker, request_kv_tokens: int, expected_output_tokens: int) -> str:
        worker.num_requests += 1
        worker.kv_tokens += request_kv_tokens
        worker.reserved_kv_tokens += request_kv_tokens + expected_output_tokens
        return worker.worker_id

    def on_progress(self, worker_id: str, kv_tokens: int) -> None:
        """The worker's current total KV, as its heartbeat reports it."""
        self.workers[worker_id].kv_tokens = kv_tokens

    def on_done(self, worker_id: str, request_kv_tokens: int, expected_output_tokens: int) -> None:
        """A request ended: release its slot and its reservation (the arguments it was chosen with)."""
        worker = self.workers[worker_id]
        worker.num_requests -= 1
        worker.reserved_kv_tokens -= request_kv_tokens + expected_output_tokens
        worker.kv_tokens = max(0, worker.kv_tokens - request_kv_tokens - expected_output_tokens)


class DecodeBalancer(DecodeLoadTracker):
    def __init__(self, workers: Sequence[DecodeWorker], *, per_request_s: float, per_kv_token_s: float) -> None:
        super().__init__(workers)
        if per_request_s < 0 or per_kv_token_s < 0 or per_request_s + per_kv_token_s == 0:
            raise ValueError("per_request_s and per_kv_token_s must be non-negative, not both zero")
        self.per_request_s = per_request_s
        self.per_kv_token_s = per_kv_token_s

    @classmethod
    def from_cost_model(cls, workers: Sequence[DecodeWorker], model: PrefillCostModel) -> "DecodeBalancer":
        return cls(workers, per_request_s=model.decode_per_request_s, per_kv_token_s=model.decode_per_kv_token_s)

    def choose(self, request_kv_tokens: int, expected_output_tokens: int) -> str | None:
        """The worker to decode on, or None when no worker has room for the request's peak KV."""
        peak = request_kv_tokens + expected_output_tokens
        # Its mean KV over its life: what it adds to the attention cost of the steps it shares.
        kv = request_kv_tokens + expected_output_tokens // 2
        best: tuple[float, int, DecodeWorker] | None = None
        for worker in self.workers.values():
            if not worker.fits(peak):
                continue
            score = (
                self.per_request_s**2 * (2 * worker.num_requests + 1)
                + self.per_kv_token_s**2 * (2 * worker.kv_tokens + kv) * kv
            )
            key = (score, worker.num_requests, worker)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else self._admit(best[2], request_kv_tokens, expected_output_tokens)
