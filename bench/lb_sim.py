"""Discrete-event simulation of the prefill and decode pools, driving the real balancers with the
Mooncake trace; ours against round-robin and least-requests.

    python -m bench.lb_sim [--trace ../shared/data/mooncake_synthetic_trace.jsonl]
        [--cost-model var/cost_model.json] [--prefill-workers 8] [--decode-workers 8]
        [--utilization 0.8] [--quick]

Workload, scaled to our model (SmolLM2, 8192-token context), recorded under "scaling" in the JSON:
- Token lengths are multiplied by 8192/131072 = 1/16 (the trace comes from a 128K-context service),
  which keeps the shape of the length distribution; prompts are then capped so that prompt plus
  output fit the window. A trace block of 512 tokens becomes 32.
- Hit tokens: the leading blocks of a request whose hash_ids an earlier request (in arrival order)
  already had, times the scaled block size, leaving at least one token to compute. That is an
  infinite prefix cache, i.e. the global store, which keeps blocks for days against a trace of
  minutes; every policy sees the same hits.
- Arrivals are re-timed window by window (50 s of the trace each): every window lasts as long as its
  predicted prefill compute takes at `--utilization` of the pool's capacity, and the requests inside
  it keep their (Poisson) spacing. One stretch factor for the whole trace would overload its first
  half, where the prefix cache is still cold and requests bring more work.

Service times come from the fitted cost model (`python -m bench.fit_cost_model`), times a
log-normal factor (`--noise`) so that the balancers, which see only predictions, are not clairvoyant:
- Prefill: each worker runs its queue in arrival order, one request at a time, in chunks, each the
  largest that fits the step budget (`max_chunk`); the budget defaults to the predicted time of a
  512-token chunk without context. TTFT = arrival to the end of the last chunk (queue + prefill).
- Decode: the same fit's decode form, `t(batch, total_kv) = a + (b + d) * batch + e * total_kv`
  (a decode step is a batch of q = 1 rows), no separate measurement. A request joins a worker's
  batch at the next step boundary; every step emits one token per request. Inter-token latency is
  the gap between a request's consecutive tokens; the first gap runs from the prefill's first
  token, so it includes any wait for KV room. Each worker holds the KV that SmolLM2 fits in the
  engine's default 1 GiB cache in float32 and at most 64 requests (the engine's defaults); requests
  reserve their peak KV (prompt + output, the output length taken from the trace, as max_tokens
  would give it) and wait when no worker has room. The decode pools all receive the prefill
  completions of our prefill balancer, so the decode rows differ only in decode placement.

Load imbalance is max/mean over workers of their outstanding load, sampled at every arrival to the
pool (prefill: predicted seconds of queued compute; decode: predicted step time) and averaged over
samples where any worker is loaded. Utilization is busy time over workers x span.

`--image-mix` simulates instead an image-heavy mix through an encoder pool before the prefill pool:
the encoder balancer (fewest patches in flight) against round-robin and least-requests, by the p99
TTFT of image requests (bench.lb_sim_images says how; its options are listed under "image mix").
"""

import argparse
import heapq
import json
import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from bench.smollm2_config import SMOLLM2_135M_CONFIG
from workers.args import CPU_KV_CACHE_BYTES, default
from workers.client.routing.balancers.baselines import (
    LeastRequestsDecode,
    LeastRequestsPrefill,
    RoundRobinDecode,
    RoundRobinPrefill,
)
from workers.client.routing.balancers.decode import DecodeBalancer, DecodeWorker, new_workers
from workers.client.routing.balancers.prefill import DEFAULT_TIERS, PrefillBalancer
from workers.client.routing.router import CHUNK_LIMIT
from workers.cost_model import PrefillCostModel

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared/data/mooncake_synthetic_trace.jsonl"
DEFAULT_COST_MODEL = Path("var/cost_model.json")
TRACE_BLOCK_TOKENS = 512
TRACE_CONTEXT = 131072
CONTEXT = SMOLLM2_135M_CONFIG["max_position_embeddings"]
MAX_DECODE_REQUESTS = default("max_num_seqs")
# float32 K and V per token: 2 x layers x kv heads x head dim x 4 bytes.
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4
DECODE_KV_CAPACITY = CPU_KV_CACHE_BYTES // KV_BYTES_PER_TOKEN  # the engine's default cache on a CPU
QUICK_REQUESTS = 300
# The tier re-sizing window, in mean requests' worth of compute: long enough to measure demand.
DEFAULT_WINDOW_REQUESTS = 100


@dataclass(frozen=True, slots=True)
class SimRequest:
    arrival_s: float
    input_tokens: int
    hit_tokens: int
    output_tokens: int


class PrefillPolicy(Protocol):
    def choose(self, request_tokens: int, hit_tokens: int) -> str: ...
    def on_progress(self, worker_id: str, done_s: float) -> None: ...
    def on_done(self, worker_id: str, leftover_s: float = 0.0) -> None: ...
    def rebalance(self, now: float) -> bool: ...


class DecodePolicy(Protocol):
    workers: dict[str, DecodeWorker]

    def choose(self, request_kv_tokens: int, expected_output_tokens: int) -> str | None: ...
    def on_progress(self, worker_id: str, kv_tokens: int) -> None: ...
    def on_done(self, worker_id: str, request_kv_tokens: int, expected_output_tokens: int) -> None: ...


def load_requests(path: Path, limit: int | None) -> tuple[list[SimRequest], float]:
    """The trace scaled to our context (arrivals still in trace seconds), and its token scale."""
    scale = CONTEXT / TRACE_CONTEXT
    block = round(TRACE_BLOCK_TOKENS * scale)
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    lines.sort(key=lambda r: r["timestamp"])
    seen: set[int] = set()
    requests = []
    for line in lines[:limit]:
        output = max(1, min(line["output_length"], CONTEXT // 2))
        tokens = max(1, min(round(line["input_length"] * scale), CONTEXT - output))
        hit = 0
        while hit < len(line["hash_ids"]) and line["hash_ids"][hit] in seen:
            hit += 1
        seen.update(line["hash_ids"])
        requests.append(SimRequest(line["timestamp"] / 1000.0, tokens, min(hit * block, tokens - 1), output))
    return requests, scale


def pace(requests: list[SimRequest], work_s: list[float], capacity_s_per_s: float, window_s: float) -> list[SimRequest]:
    """Re-time arrivals so that each `window_s` window of the trace offers `capacity_s_per_s` seconds
    of predicted compute per second: a window lasts its work divided by that rate, and the requests
    inside it keep their relative spacing."""
    start = requests[0].arrival_s
    windows: dict[int, float] = {}
    for request, work in zip(requests, work_s):
        key = int((request.arrival_s - start) // window_s)
        windows[key] = windows.get(key, 0.0) + work
    begins: dict[int, float] = {}
    clock = 0.0
    for key in range(max(windows) + 1):
        begins[key] = clock
        clock += windows.get(key, 0.0) / capacity_s_per_s
    paced = []
    for request in requests:
        offset = request.arrival_s - start
        key = int(offset // window_s)
        duration = windows[key] / capacity_s_per_s
        at = begins[key] + (offset - key * window_s) / window_s * duration
        paced.append(SimRequest(at, request.input_tokens, request.hit_tokens, request.output_tokens))
    return paced


@dataclass
class PoolStats:
    busy_s: float = 0.0
    imbalance: list[float] = field(default_factory=list)

    def sample_imbalance(self, loads: Sequence[float]) -> None:
        mean = sum(loads) / len(loads)
        if mean > 0:
            self.imbalance.append(max(loads) / mean)


class Simulator:
    """The event queue both pools run on: (time, sequence, callback)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._sequence = 0

    def at(self, when: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._events, (when, self._sequence, callback))
        self._sequence += 1

    def run(self) -> None:
        while self._events:
            self.now, _, callback = heapq.heappop(self._events)
            callback()


def simulate_prefill(
    requests: list[SimRequest],
    policy: PrefillPolicy,
    worker_ids: list[str],
    model: PrefillCostModel,
    budget_s: float,
    noise: Callable[[], float],
) -> tuple[list[float], PoolStats, float]:
    """Each request's first-token time, the pool's stats, and the span."""
    sim = Simulator()
    queues: dict[str, deque[int]] = {w: deque() for w in worker_ids}
    stepping = dict.fromkeys(worker_ids, False)
    outstanding = dict.fromkeys(worker_ids, 0.0)  # predicted seconds not yet done
    done_tokens = [r.hit_tokens for r in requests]
    # What the balancer was told each request costs, less what has been reported done.
    unreported = [0.0] * len(requests)
    first_token = [math.nan] * len(requests)
    stats = PoolStats()

    def step(worker: str) -> None:
        plan = plan_step(model, [(requests[i].input_tokens, done_tokens[i]) for i in queues[worker]], budget_s)
        stepping[worker] = bool(plan)
        if not plan:
            return
        shares = [
            (index, q, model.predict(q, done_tokens[index]) - model.a + model.a / len(plan))
            for index, q in zip(queues[worker], plan)
        ]
        took = sum(share for _, _, share in shares) * noise()
        stats.busy_s += took
        sim.at(sim.now + took, lambda: finish_step(worker, shares))

    def finish_step(worker: str, shares: list[tuple[int, int, float]]) -> None:
        for index, q, share in shares:
            done_tokens[index] += q
            credit = min(share, unreported[index])
            unreported[index] -= credit
            outstanding[worker] -= credit
            policy.on_progress(worker, credit)
            if done_tokens[index] == requests[index].input_tokens:
                first_token[index] = sim.now
                queues[worker].remove(index)
                outstanding[worker] -= unreported[index]
                policy.on_done(worker, unreported[index])
        step(worker)

    def arrive(index: int) -> None:
        request = requests[index]
        policy.rebalance(sim.now)
        worker = policy.choose(request.input_tokens, request.hit_tokens)
        unreported[index] = model.predict_prefill(request.input_tokens, request.hit_tokens, budget_s, limit=CHUNK_LIMIT)
        outstanding[worker] += unreported[index]
        stats.sample_imbalance(list(outstanding.values()))
        queues[worker].append(index)
        if not stepping[worker]:
            step(worker)

    for index, request in enumerate(requests):
        sim.at(request.arrival_s, lambda index=index: arrive(index))
    sim.run()
    return first_token, stats, sim.now - requests[0].arrival_s


def plan_step(model: PrefillCostModel, queue: Sequence[tuple[int, int]], budget_s: float) -> list[int]:
    """Tokens per queued (input tokens, done tokens) request for one step, in queue order, as the
    engine's scheduler packs a step: each takes the largest chunk that fits what is left of the
    time budget and the token limit; the first always gets at least one token."""
    plan: list[int] = []
    left_s = budget_s - model.a
    left_tokens = CHUNK_LIMIT
    for tokens, done in queue:
        if left_tokens == 0:
            break
        q = min(model.max_chunk(left_s + model.a, done, limit=left_tokens), tokens - done)
        cost = model.predict(q, done) - model.a
        if plan and cost > left_s:
            break
        plan.append(q)
        left_s -= cost
        left_tokens -= q
    return plan


@dataclass
class DecodeRun:
    itl_s: list[float]
    stats: PoolStats
    span_s: float
    max_kv_fraction: float  # the fullest any worker's KV got, as a fraction of its capacity
    mean_kv_fraction: float


def simulate_decode(
    requests: list[SimRequest],
    ready_s: list[float],
    policy: DecodePolicy,
    model: PrefillCostModel,
    noise: Callable[[], float],
) -> DecodeRun:
    sim = Simulator()
    workers = policy.workers
    batches: dict[str, list[int]] = {w: [] for w in workers}
    joining: dict[str, list[int]] = {w: [] for w in workers}
    stepping = dict.fromkeys(workers, False)
    kv = [r.input_tokens + 1 for r in requests]  # the prompt and the first token, from prefill
    left = [r.output_tokens - 1 for r in requests]
    last_token = list(ready_s)
    pending: deque[int] = deque()
    itl: list[float] = []
    stats = PoolStats()
    kv_fraction: list[float] = []

    def admit(index: int) -> bool:
        worker = policy.choose(kv[index], left[index])
        if worker is None:
            return False
        joining[worker].append(index)
        if not stepping[worker]:
            step(worker)
        return True

    def step(worker: str) -> None:
        batches[worker].extend(joining[worker])
        joining[worker].clear()
        batch = batches[worker]
        stepping[worker] = bool(batch)
        if not batch:
            return
        total_kv = sum(kv[i] for i in batch)
        policy.on_progress(worker, total_kv)
        kv_fraction.append(total_kv / workers[worker].kv_capacity)
        took = model.predict_decode_step(len(batch), total_kv) * noise()
        stats.busy_s += took
        sim.at(sim.now + took, lambda: finish_step(worker))

    def finish_step(worker: str) -> None:
        still: list[int] = []
        for index in batches[worker]:
            itl.append(sim.now - last_token[index])
            last_token[index] = sim.now
            kv[index] += 1
            left[index] -= 1
            if left[index]:
                still.append(index)
            else:
                request = requests[index]
                policy.on_done(worker, request.input_tokens + 1, request.output_tokens - 1)
        freed = len(still) < len(batches[worker])
        batches[worker] = still
        while freed and pending and admit(pending[0]):
            pending.popleft()
        step(worker)

    def ready(index: int) -> None:
        loads = [model.predict_decode_step(w.num_requests, w.kv_tokens) for w in workers.values()]
        stats.sample_imbalance(loads)
        if pending or not admit(index):
            pending.append(index)

    decoding = [i for i, r in enumerate(requests) if r.output_tokens > 1]
    for index in decoding:
        sim.at(ready_s[index], lambda index=index: ready(index))
    sim.run()
    start = min(ready_s[i] for i in decoding)
    return DecodeRun(
        itl_s=itl,
        stats=stats,
        span_s=sim.now - start,
        max_kv_fraction=max(kv_fraction),
        mean_kv_fraction=float(np.mean(kv_fraction)),
    )


def _noise(sigma: float, seed: int) -> Callable[[], float]:
    """Log-normal factors with mean 1."""
    rng = random.Random(seed)
    return lambda: rng.lognormvariate(-sigma * sigma / 2, sigma) if sigma else 1.0


def _percentile(values: Sequence[float], q: float) -> float:
    return round(float(np.quantile(values, q)), 4)


def _imbalance(stats: PoolStats) -> float:
    return round(float(np.mean(stats.imbalance)), 3) if stats.imbalance else 1.0


def prefill_policies(
    worker_ids: list[str], model: PrefillCostModel, budget_s: float, tiers: Sequence[int], window_s: float
) -> dict[str, Callable[[], PrefillPolicy]]:
    return {
        "ours": lambda: PrefillBalancer(
            worker_ids,
            model,
            tiers=tiers,
            window_s=window_s,
            step_budget_s=budget_s,
            chunk_limit=CHUNK_LIMIT,
        ),
        "round_robin": lambda: RoundRobinPrefill(worker_ids),
        "least_requests": lambda: LeastRequestsPrefill(worker_ids),
    }


def decode_policies(worker_ids: list[str], model: PrefillCostModel) -> dict[str, Callable[[], DecodePolicy]]:
    def workers() -> list[DecodeWorker]:
        return new_workers(worker_ids, kv_capacity=DECODE_KV_CAPACITY, max_requests=MAX_DECODE_REQUESTS)

    return {
        "ours": lambda: DecodeBalancer.from_cost_model(workers(), model),
        "round_robin": lambda: RoundRobinDecode(workers()),
        "least_requests": lambda: LeastRequestsDecode(workers()),
    }


def run(args: argparse.Namespace) -> dict[str, object]:
    started = time.perf_counter()
    model = PrefillCostModel.load(args.cost_model)
    budget_s = args.step_budget_s or model.predict(512, 0)
    requests, token_scale = load_requests(args.trace, QUICK_REQUESTS if args.quick else None)
    work = [model.predict_prefill(r.input_tokens, r.hit_tokens, budget_s, limit=CHUNK_LIMIT) for r in requests]
    trace_span_s = requests[-1].arrival_s - requests[0].arrival_s
    requests = pace(requests, work, args.utilization * args.prefill_workers, args.pace_window_s)
    factor = (requests[-1].arrival_s - requests[0].arrival_s) / trace_span_s
    prefill_ids = [f"prefill-{i}" for i in range(args.prefill_workers)]
    decode_ids = [f"decode-{i}" for i in range(args.decode_workers)]
    window_s = args.window_s or DEFAULT_WINDOW_REQUESTS * sum(work) / len(requests)

    prefill_rows = []
    ours_first_token: list[float] = []
    for name, make in prefill_policies(prefill_ids, model, budget_s, args.tiers, window_s).items():
        first_token, stats, span_s = simulate_prefill(
            requests, make(), prefill_ids, model, budget_s, _noise(args.noise, args.seed)
        )
        if name == "ours":
            ours_first_token = first_token
        ttft = [t - r.arrival_s for t, r in zip(first_token, requests)]
        prefill_rows.append(
            {
                "policy": name,
                "ttft_p50_s": _percentile(ttft, 0.5),
                "ttft_p99_s": _percentile(ttft, 0.99),
                "ttft_mean_s": round(float(np.mean(ttft)), 4),
                "imbalance_max_over_mean": _imbalance(stats),
                "utilization": round(stats.busy_s / (span_s * len(prefill_ids)), 3),
            }
        )

    decode_rows = []
    for name, make in decode_policies(decode_ids, model).items():
        result = simulate_decode(requests, ours_first_token, make(), model, _noise(args.noise, args.seed + 1))
        decode_rows.append(
            {
                "policy": name,
                "itl_p50_s": _percentile(result.itl_s, 0.5),
                "itl_p99_s": _percentile(result.itl_s, 0.99),
                "itl_mean_s": round(float(np.mean(result.itl_s)), 4),
                "imbalance_max_over_mean": _imbalance(result.stats),
                "utilization": round(result.stats.busy_s / (result.span_s * len(decode_ids)), 3),
                "mean_kv_fraction": round(result.mean_kv_fraction, 3),
                "max_kv_fraction": round(result.max_kv_fraction, 3),
            }
        )

    return {
        "benchmark": "lb_sim",
        "requests": len(requests),
        "cost_model": {
            "path": str(args.cost_model),
            "a": model.a,
            "b": model.b,
            "d": model.d,
            "e": model.e,
            "decode": None if model.decode is None else {"a": model.decode.a, "b": model.decode.b, "e": model.decode.e},
        },
        "scaling": {
            "token_scale": token_scale,
            "context_tokens": CONTEXT,
            "block_tokens": round(TRACE_BLOCK_TOKENS * token_scale),
            "pace_window_trace_s": args.pace_window_s,
            "overall_time_stretch": round(factor, 4),
            "target_prefill_utilization": args.utilization,
            "mean_input_tokens": round(float(np.mean([r.input_tokens for r in requests])), 1),
            "hit_token_fraction": round(sum(r.hit_tokens for r in requests) / sum(r.input_tokens for r in requests), 3),
            "arrival_rate_per_s": round(len(requests) / (requests[-1].arrival_s - requests[0].arrival_s), 3),
        },
        "prefill_pool": {
            "workers": args.prefill_workers,
            "tiers": list(args.tiers),
            "window_s": round(window_s, 2),
            "step_budget_s": round(budget_s, 4),
            "chunk_limit": CHUNK_LIMIT,
        },
        "decode_pool": {
            "workers": args.decode_workers,
            "kv_capacity_tokens": DECODE_KV_CAPACITY,
            "max_requests": MAX_DECODE_REQUESTS,
        },
        "noise_sigma": args.noise,
        "prefill": prefill_rows,
        "decode": decode_rows,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--cost-model", type=Path, default=DEFAULT_COST_MODEL, help="from bench.fit_cost_model")
    parser.add_argument("--prefill-workers", type=int, default=8)
    parser.add_argument("--decode-workers", type=int, default=8)
    parser.add_argument("--utilization", type=float, default=0.8, help="target prefill pool utilization")
    parser.add_argument("--tiers", type=int, nargs="+", default=list(DEFAULT_TIERS), help="tier boundaries (tokens)")
    parser.add_argument("--window-s", type=float, default=None, help="tier re-sizing window")
    parser.add_argument("--pace-window-s", type=float, default=50.0, help="trace seconds per pacing window")
    parser.add_argument("--step-budget-s", type=float, default=None, help="prefill step budget")
    parser.add_argument("--noise", type=float, default=0.1, help="log-normal sigma of service times")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help=f"the first {QUICK_REQUESTS} requests, for tests")
    # Imported here: bench.lb_sim_images builds on this module's pools.
    from bench import lb_sim_images

    lb_sim_images.add_arguments(parser)
    args = parser.parse_args()
    if args.prefill_workers < 1 or args.decode_workers < 1 or not 0 < args.utilization < 1:
        parser.error("worker counts must be positive and --utilization in (0, 1)")
    lb_sim_images.check_arguments(parser, args)
    try:
        result = lb_sim_images.run(args) if args.image_mix else run(args)
    except ValueError as error:
        parser.error(str(error))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
