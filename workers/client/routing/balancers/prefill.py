"""Prefill load balancing: input-length tiers, each served by workers sized to its compute demand;
within a tier, the worker with the most remaining compute quota.

Work is counted in predicted seconds of compute (the cost model, chunked by the step budget), not in
requests: one 8K-token prompt is worth hundreds of short turns. Tiers keep short prompts from
queueing behind long ones (a worker packs each step from its queue in order, so one long prompt
fills its steps); sizing tiers from the last window's demand keeps every tier about as loaded as the
others. Whole workers divide demand coarsely, and a burst shifts it within a window, so a request
spills to the least-loaded worker of the whole pool when its own tier is more than `spill_s` behind.

A sliding-window model's request is cheaper nowhere in particular (any worker fetches the SWA state at
its hit's end from the worker that holds it), but a holder needs no fetch and does not depend on
another worker staying up: among the workers the request may go to (its tier's, or the pool's when it
spills), a holder is preferred while its remaining quota is within `holder_slack_s` of the best's.

Default tier boundaries, for SmolLM2's 8192-token context: 1024 and 4096 tokens (1/8 and 1/2 of
the window), separating chat turns, medium prompts, and long documents or agent histories. A model
with a longer window should scale them with it.
"""

import bisect
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from workers.cost_model import PrefillCostModel

DEFAULT_TIERS = (1024, 4096)


@dataclass(slots=True)
class PrefillWorker:
    worker_id: str
    quota_rate: float = 1.0  # seconds of compute the worker delivers per second
    queued_s: float = 0.0  # predicted compute assigned to it and not yet done
    tier: int = 0

    def remaining_quota(self, window_s: float) -> float:
        return self.quota_rate * window_s - self.queued_s


class PrefillBalancer:
    def __init__(
        self,
        worker_ids: Sequence[str],
        cost_model: PrefillCostModel,
        *,
        tiers: Sequence[int] = DEFAULT_TIERS,
        window_s: float = 30.0,
        step_budget_s: float,
        chunk_limit: int,
        spill_s: float | None = None,
        holder_slack_s: float | None = None,
        now: float = 0.0,
    ) -> None:
        """`tiers` are ascending input-length boundaries: tier i takes prompts of tiers[i-1] up to
        fewer than tiers[i] tokens (the last tier takes the rest). `spill_s` (default: two step
        budgets; math.inf never spills) is how much less quota a tier's best worker may have than
        the pool's best before a request leaves its tier. `holder_slack_s` (default: a tenth of a step
        budget, about a fetch's worth of queueing and the quota estimates' noise) is how much less
        quota a holder of the request's SWA state may have than the best worker and still take it."""
        if not worker_ids:
            raise ValueError("a prefill balancer needs at least one worker")
        if len(set(worker_ids)) != len(worker_ids):
            raise ValueError("worker ids must be distinct")
        if list(tiers) != sorted(set(tiers)) or any(t <= 0 for t in tiers):
            raise ValueError(f"tier boundaries must be positive and strictly ascending, got {list(tiers)}")
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.cost_model = cost_model
        self.boundaries = tuple(tiers)
        self.window_s = window_s
        self.step_budget_s = step_budget_s
        self.chunk_limit = chunk_limit
        self.spill_s = 2 * step_budget_s if spill_s is None else spill_s
        self.holder_slack_s = step_budget_s / 10 if holder_slack_s is None else holder_slack_s
        self.workers = {worker_id: PrefillWorker(worker_id) for worker_id in worker_ids}
        self.num_tiers = len(self.boundaries) + 1
        # Until demand has been seen, spread the workers evenly over the tiers.
        for index, worker in enumerate(self.workers.values()):
            worker.tier = index * self.num_tiers // len(self.workers)
        self.window_start = now
        self.demand_s = [0.0] * self.num_tiers

    def tier_of(self, request_tokens: int) -> int:
        return bisect.bisect_right(self.boundaries, request_tokens)

    def predict(self, request_tokens: int, hit_tokens: int) -> float:
        """Predicted compute for the uncached suffix, in chunks that fit the step budget."""
        return self.cost_model.predict_prefill(request_tokens, hit_tokens, self.step_budget_s, limit=self.chunk_limit)

    def choose(self, request_tokens: int, hit_tokens: int, holders: Collection[str] = ()) -> str:
        """`hit_tokens`: prompt tokens prefill does not compute; `holders`: the workers that hold the
        request's SWA state (a sliding-window model's), preferred when close (see the module docstring)."""
        tier = self.tier_of(request_tokens)
        cost = self.predict(request_tokens, hit_tokens)
        self.demand_s[tier] += cost
        quota = self.window_s
        anywhere = max(self.workers.values(), key=lambda w: w.remaining_quota(quota))
        in_tier = [w for w in self.workers.values() if w.tier == tier]
        candidates = in_tier or list(self.workers.values())
        worker = max(candidates, key=lambda w: w.remaining_quota(quota))
        # Whole workers split the demand coarsely and bursts shift it within a window: when the
        # tier is that much further behind than the pool, the request spills to the pool's best.
        if worker.remaining_quota(quota) < anywhere.remaining_quota(quota) - self.spill_s:
            worker, candidates = anywhere, list(self.workers.values())
        holding = [w for w in candidates if w.worker_id in holders]
        if holding:
            holder = max(holding, key=lambda w: w.remaining_quota(quota))
            if holder.remaining_quota(quota) >= worker.remaining_quota(quota) - self.holder_slack_s:
                worker = holder
        worker.queued_s += cost
        return worker.worker_id

    def on_progress(self, worker_id: str, done_s: float) -> None:
        """The worker finished a chunk whose predicted compute was `done_s`."""
        worker = self.workers[worker_id]
        worker.queued_s = max(0.0, worker.queued_s - done_s)

    def on_done(self, worker_id: str, leftover_s: float = 0.0) -> None:
        """A request ended; `leftover_s` is the part of its prediction never reported as progress
        (an abort, or a prompt that hit more cache than predicted)."""
        self.on_progress(worker_id, leftover_s)

    def tier_sizes(self) -> list[int]:
        sizes = [0] * self.num_tiers
        for worker in self.workers.values():
            sizes[worker.tier] += 1
        return sizes

    def rebalance(self, now: float) -> bool:
        """At the end of a window, re-size the tiers from its demand; True when a worker moved."""
        if now - self.window_start < self.window_s:
            return False
        demand, self.demand_s = self.demand_s, [0.0] * self.num_tiers
        self.window_start = now
        if not any(demand):
            return False
        return self._assign(allocate_workers(demand, len(self.workers)))

    def _assign(self, sizes: list[int]) -> bool:
        """Move as few workers as possible; a tier that shrinks gives up its least-loaded workers,
        which can start on their new tier soonest."""
        members: list[list[PrefillWorker]] = [[] for _ in range(self.num_tiers)]
        for worker in self.workers.values():
            members[worker.tier].append(worker)
        spare: list[PrefillWorker] = []
        for tier, workers in enumerate(members):
            workers.sort(key=lambda w: w.queued_s, reverse=True)
            spare.extend(workers[sizes[tier] :])
        spare.sort(key=lambda w: w.queued_s)
        moved = bool(spare)
        for tier, workers in enumerate(members):
            for _ in range(sizes[tier] - min(len(workers), sizes[tier])):
                spare.pop(0).tier = tier
        return moved


def allocate_workers(demand_s: Sequence[float], num_workers: int) -> list[int]:
    """Workers per tier, proportional to demand: every tier with demand gets one (the largest first
    when there are fewer workers than such tiers), then each next worker goes to the tier with the
    most demand per worker, which minimises the busiest tier's load."""
    sizes = [0] * len(demand_s)
    by_demand = sorted((i for i, d in enumerate(demand_s) if d > 0), key=lambda i: demand_s[i], reverse=True)
    for tier in by_demand[:num_workers]:
        sizes[tier] = 1
    for _ in range(num_workers - sum(sizes)):
        tier = max(by_demand, key=lambda i: demand_s[i] / sizes[i])
        sizes[tier] += 1
    return sizes
