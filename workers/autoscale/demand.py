"""A pool's demand signals for the planner, from what its workers report and the fitted cost model."""

from collections.abc import Sequence
from dataclasses import dataclass

from workers.autoscale.planner import Demand, PlannerConfig
from workers.cost_model import PrefillCostModel


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """One live worker as its latest heartbeat recorded it (limits 0: not reported yet)."""

    num_running: int
    num_waiting: int
    kv_usage: float
    max_num_seqs: int = 0
    kv_capacity_tokens: int = 0


def prefill_tokens_per_s(model: PrefillCostModel, *, budget_s: float, limit: int) -> float:
    """Uncached tokens one prefill worker computes per second: the largest chunk that fits a step's
    time budget over that step's predicted time, with nothing cached before it (cached context makes
    a chunk dearer, so this is the optimistic end)."""
    chunk = model.max_chunk(budget_s, 0, limit=limit)
    return chunk / model.predict(chunk, 0)


def prefill_demands(*, uncached_tokens_per_s: Sequence[float], tokens_per_s_per_worker: float) -> dict[str, Demand]:
    """From the look-back's per-period rates (oldest first); none: no signal."""
    if not uncached_tokens_per_s:
        return {}
    mean = sum(uncached_tokens_per_s) / len(uncached_tokens_per_s)
    return {
        "uncached_tokens_per_s": Demand(mean=mean, peak=max(uncached_tokens_per_s), per_worker=tokens_per_s_per_worker)
    }


def encode_demands(*, patches_per_s: Sequence[float], patches_per_s_per_encoder: float) -> dict[str, Demand]:
    """Vision-tower patches per second asked of an encode pool, per period of the look-back (oldest
    first), against what one encoder measured it encodes per second. No periods, or no encoder that
    measured its capacity yet: no signal, so the pool is left as it is."""
    if not patches_per_s or patches_per_s_per_encoder <= 0:
        return {}
    mean = sum(patches_per_s) / len(patches_per_s)
    return {"patches_per_s": Demand(mean=mean, peak=max(patches_per_s), per_worker=patches_per_s_per_encoder)}


def decode_demands(
    workers: Sequence[WorkerLoad], config: PlannerConfig, *, peak_requests_in_flight: int = 0, peak_kv_tokens: int = 0
) -> dict[str, Demand]:
    """Requests in flight against max_num_seqs, and KV tokens in use against KV capacity (only once
    some worker reported its capacity). The mean is the workers' load now; the peak is the higher
    of that and the look-back's (`peak_*`: the most the pool held at once in the last minutes), so
    the quota guard sees a burst that has just passed."""
    if not workers:
        return {}
    in_flight = float(sum(w.num_running + w.num_waiting for w in workers))
    seqs = [w.max_num_seqs for w in workers if w.max_num_seqs > 0]
    per_worker_seqs = sum(seqs) / len(seqs) if seqs else float(config.default_max_num_seqs)
    demands = {
        "requests_in_flight": Demand(
            mean=in_flight, peak=max(in_flight, peak_requests_in_flight), per_worker=per_worker_seqs
        )
    }
    reported = [w for w in workers if w.kv_capacity_tokens > 0]
    if reported:
        kv_tokens = sum(w.kv_usage * w.kv_capacity_tokens for w in reported)
        per_worker_kv = sum(w.kv_capacity_tokens for w in reported) / len(reported)
        demands["kv_tokens"] = Demand(mean=kv_tokens, peak=max(kv_tokens, peak_kv_tokens), per_worker=per_worker_kv)
    return demands
