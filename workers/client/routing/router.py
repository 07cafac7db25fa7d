"""Which prefill and which decode worker take a request: the entrypoint's routing decision.

The prefill side keeps one PrefillBalancer (length tiers, most remaining compute quota) over the
prefill workers that are ready now, rebuilt when that set changes; the work queued on a worker that
stays carries over. The decode side is decided from the current load alone, so it needs no state
here: a DecodeBalancer is built per decision from each decode worker's capacity (its heartbeat) and
the load this gateway placed on it, or the load its heartbeat reports when that is larger (other
gateways' requests).

A request's KV is reserved at its expected peak: the prompt plus its max_tokens, capped at
EXPECTED_OUTPUT_TOKENS: reserving a whole context window for every request without max_tokens would
leave room for only a few. A decode worker that runs short anyway refuses the transfer, and the
request is retried elsewhere.
"""

import os
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from workers.args import default
from workers.client.routing.balancers.decode import DecodeBalancer, DecodeWorker
from workers.client.routing.balancers.prefill import PrefillBalancer
from workers.cost_model import PrefillCostModel
from workers.protocol.messages import GenerateRequest, WorkerHeartbeat

EXPECTED_OUTPUT_TOKENS = 512
# Until a model is fitted for the hardware (python -m bench.fit_cost_model, then point
# SLUICE_COST_MODEL at its file): SmolLM2-135M fp32 measured on a 2-core CPU, rounded. The balancers
# use only ratios of predicted times, so a stale model misweights, it does not misroute.
NOMINAL_COST_MODEL = PrefillCostModel(a=0.07, b=1.6e-3, d=2e-7, e=1.4e-6)
# The time budget of one prefill step, which `serve` also gives its workers (--step-budget-ms).
STEP_BUDGET_S = 1.0
CHUNK_LIMIT = default("max_num_batched_tokens")  # the most one step of a worker at its defaults prefills


def cost_model_from_environment() -> PrefillCostModel:
    return fitted_cost_model_from_environment() or NOMINAL_COST_MODEL


def fitted_cost_model_from_environment() -> PrefillCostModel | None:
    """The model fitted for this hardware (SLUICE_COST_MODEL names its file), or None."""
    path = os.environ.get("SLUICE_COST_MODEL")
    return PrefillCostModel.load(Path(path)) if path else None


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    """A decode worker as the router sees it."""

    key: str
    heartbeat: WorkerHeartbeat
    num_requests: int  # this gateway's requests on it
    reserved_kv_tokens: int  # their peak KV


def expected_peak(request: GenerateRequest, max_model_len: int, num_output_tokens: int = 0) -> tuple[int, int]:
    """(KV tokens now, expected output tokens still to come) of a request, as the decode balancer
    reserves them. `num_output_tokens`: those it already generated (a request that moves between
    decode workers holds their KV too)."""
    tokens = len(request.prompt_token_ids) + num_output_tokens
    room = max(0, max_model_len - tokens)
    max_tokens = request.params.max_tokens
    left = max_tokens - num_output_tokens if max_tokens is not None else room
    return tokens, min(left, room, EXPECTED_OUTPUT_TOKENS)


class Router:
    def __init__(self, cost_model: PrefillCostModel, *, step_budget_s: float = STEP_BUDGET_S) -> None:
        self.cost_model = cost_model
        self.step_budget_s = step_budget_s
        self._prefill: PrefillBalancer | None = None

    def choose_prefill(
        self,
        workers: Sequence[tuple[str, WorkerHeartbeat]],
        request_tokens: int,
        hit_tokens: int,
        holders: Collection[str] = (),
    ) -> tuple[str, float]:
        """The key of the prefill worker to use and the compute it was charged, to pass to prefill_done.
        `hit_tokens`: prompt tokens prefill does not compute (a sliding-window model's replayed window
        is computed: workers.client.routing.prefix_match.StoreHit.compute_from); `holders`: the keys
        of the workers that hold its SWA state, preferred when close (PrefillBalancer)."""
        balancer = self._prefill_balancer(workers)
        balancer.rebalance(time.monotonic())
        cost = balancer.predict(request_tokens, hit_tokens)
        return balancer.choose(request_tokens, hit_tokens, holders), cost

    def prefill_done(self, key: str, cost: float) -> None:
        if self._prefill is not None and key in self._prefill.workers:
            self._prefill.on_done(key, cost)

    def choose_decode(self, workers: Sequence[DecodeLoad], prompt_tokens: int, output_tokens: int) -> str | None:
        """The key of the decode worker to use, or None when none has room for the request's peak KV."""
        if not workers:
            return None
        candidates = []
        for load in workers:
            beat = load.heartbeat
            in_use = round(beat.kv_usage * beat.kv_capacity_tokens)
            candidates.append(
                DecodeWorker(
                    load.key,
                    kv_capacity=beat.kv_capacity_tokens,
                    max_requests=beat.max_num_seqs,
                    num_requests=max(load.num_requests, beat.num_running + beat.num_waiting),
                    kv_tokens=max(load.reserved_kv_tokens, in_use),
                    reserved_kv_tokens=max(load.reserved_kv_tokens, in_use),
                )
            )
        balancer = DecodeBalancer.from_cost_model(candidates, self.cost_model)
        return balancer.choose(prompt_tokens, output_tokens)

    def _prefill_balancer(self, workers: Sequence[tuple[str, WorkerHeartbeat]]) -> PrefillBalancer:
        keys = [key for key, _ in workers]
        if self._prefill is None or list(self._prefill.workers) != keys:
            previous = self._prefill.workers if self._prefill is not None else {}
            self._prefill = PrefillBalancer(
                keys, self.cost_model, step_budget_s=self.step_budget_s, chunk_limit=CHUNK_LIMIT, now=time.monotonic()
            )
            for key, worker in self._prefill.workers.items():
                if key in previous:
                    worker.queued_s = previous[key].queued_s
        return self._prefill
