"""lb_sim's image-heavy mix (`python -m bench.lb_sim --image-mix`): requests with images pass an
encoder pool before the prefill pool; the encoder balancer (fewest patches in flight) against
round-robin and least-requests, by the p99 TTFT of image requests.

    python -m bench.lb_sim --image-mix [--cost-model var/cost_model.json] [--encoders 4]
        [--encoder-utilization 0.8] [--encoder-patches-per-s 341000] [--encoder-batch-overhead-s 0.0009]
        [--image-requests 4000] [--prefill-workers 8] [--quick]

Workload (seeded; every policy sees the same requests and arrival times):
- A request carries images with probability IMAGE_FRACTION, else it is text only. An image request
  has 1, 2, 4 or 8 images (IMAGES_PER_REQUEST: mostly one, a tail of multi-page documents); each
  image a size of a common aspect ratio (ASPECTS: photos, screens, portraits, panoramas, pages).
  Its tiles are what the gateway counts for SmolVLM-Instruct (workers.text.idefics3_images: longest
  edge 1536, 384-pixel tiles, split), 5 to 17 a image; its patches are tiles × 729 (so400m's 27 × 27,
  the shape bench.vision_encoder measures), its placeholder tokens num_image_tokens (81 a tile).
  Text tokens are log-normal around TEXT_TOKENS_MEDIAN.
- Arrivals are Poisson at the rate that gives the encoder pool `--encoder-utilization` of its
  capacity, counting each request's batch overhead as if it ran alone.

Encoders: each takes its queue in arrival order, whole requests (one EncodeRequest carries all a
request's images), as many as fit `--encoder-batch-patches` in one batch (the first always goes);
a batch takes `overhead + patches / patches_per_s` times the log-normal `--noise`, and its requests'
embeddings are ready when it ends. The defaults are bench.vision_encoder's so400m encoder (tower and
connector, bf16) on an H100 (bench/results/vision_encoder_h100.json), a line fitted through its
batches of 8 to 64 tiles: 2.93 µs a patch (341k patches/s) and 0.9 ms a batch. Under 8 tiles the
measured time stays near 11-12 ms (kernel launches bound it); a request has at least 5 tiles, where
the line gives 11.6 ms, so the floor is left out. The
balancers count patches and requests the gateway has sent to each encoder and not seen done, as the
gateway's client does (its own sends added to the encoder's heartbeat). No embedding cache: every
image is new, so every patch is encoded.

Prefill: lb_sim's prefill pool and our prefill balancer, the same for every encoder policy, with
the cost model's service times; an image request joins it when its embeddings are ready (the
prefill worker holds it until then), a text request at its arrival. The prompt is text plus image
tokens. TTFT = arrival to the prefill's last chunk: encode wait + encode + prefill wait + prefill.
"""

import argparse
import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from bench.lb_sim import (
    DEFAULT_WINDOW_REQUESTS,
    PoolStats,
    SimRequest,
    Simulator,
    _imbalance,
    _noise,
    _percentile,
    simulate_prefill,
)
from workers.client.routing.balancers.prefill import PrefillBalancer
from workers.client.routing.router import CHUNK_LIMIT
from workers.cost_model import PrefillCostModel
from workers.text.idefics3_images import ImageSettings, image_layout, num_image_tokens

# SmolVLM-Instruct's preprocessing (preprocessor_config.json) with so400m's 729 patches a tile.
SMOLVLM_IMAGES = ImageSettings(longest_edge=1536, tile_side=384, image_seq_len=81)
PATCHES_PER_TILE = 27 * 27
IMAGE_FRACTION = 0.8
IMAGES_PER_REQUEST = ((1, 0.6), (2, 0.2), (4, 0.12), (8, 0.08))
ASPECTS = ((1.0, 0.3), (4 / 3, 0.3), (16 / 9, 0.2), (3 / 4, 0.1), (4.0, 0.05), (1 / math.sqrt(2), 0.05))  # w / h
TEXT_TOKENS_MEDIAN = 200
QUICK_IMAGE_REQUESTS = 300
DEFAULT_PATCHES_PER_S = 341_000.0
DEFAULT_BATCH_OVERHEAD_S = 0.0009
DEFAULT_BATCH_PATCHES = 64 * PATCHES_PER_TILE


@dataclass(frozen=True, slots=True)
class ImageRequest:
    arrival_s: float
    text_tokens: int
    images: int
    patches: int  # 0 for a text request
    image_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return self.text_tokens + self.image_tokens


@dataclass(frozen=True, slots=True)
class EncoderCost:
    patches_per_s: float
    batch_overhead_s: float
    batch_patches: int  # a batch's patch budget

    def work_s(self, patches: int) -> float:
        """One request alone in a batch."""
        return self.batch_overhead_s + patches / self.patches_per_s


class EncoderPolicy(Protocol):
    def choose(self, patches: int) -> int: ...
    def on_done(self, encoder: int, patches: int) -> None: ...


class InFlight:
    """Patches and requests sent to each encoder and not done."""

    def __init__(self, encoders: int) -> None:
        self.patches = [0] * encoders
        self.requests = [0] * encoders

    def _send(self, encoder: int, patches: int) -> int:
        self.patches[encoder] += patches
        self.requests[encoder] += 1
        return encoder

    def on_done(self, encoder: int, patches: int) -> None:
        self.patches[encoder] -= patches
        self.requests[encoder] -= 1


class FewestPatches(InFlight):
    """The VE balancer's rule: fewest patches in flight, then fewest requests, then the first."""

    def choose(self, patches: int) -> int:
        encoder = min(range(len(self.patches)), key=lambda e: (self.patches[e], self.requests[e]))
        return self._send(encoder, patches)


class RoundRobinEncoders(InFlight):
    def __init__(self, encoders: int) -> None:
        super().__init__(encoders)
        self._next = 0

    def choose(self, patches: int) -> int:
        encoder = self._next
        self._next = (self._next + 1) % len(self.patches)
        return self._send(encoder, patches)


class LeastRequestsEncoders(InFlight):
    def choose(self, patches: int) -> int:
        encoder = min(range(len(self.requests)), key=self.requests.__getitem__)
        return self._send(encoder, patches)


ENCODER_POLICIES: dict[str, Callable[[int], InFlight]] = {
    "fewest_patches": FewestPatches,
    "round_robin": RoundRobinEncoders,
    "least_requests": LeastRequestsEncoders,
}


def _weighted(rng: random.Random, choices: Sequence[tuple[float, float]]) -> float:
    values, weights = zip(*choices)
    return rng.choices(values, weights)[0]


def draw_requests(count: int, seed: int) -> list[ImageRequest]:
    """The mix, arrivals not yet set."""
    rng = random.Random(seed)
    requests = []
    for _ in range(count):
        text = max(1, round(rng.lognormvariate(math.log(TEXT_TOKENS_MEDIAN), 0.8)))
        images = int(_weighted(rng, IMAGES_PER_REQUEST)) if rng.random() < IMAGE_FRACTION else 0
        patches = tokens = 0
        for _ in range(images):
            height = rng.randint(256, 3000)
            width = max(1, round(height * _weighted(rng, ASPECTS)))
            layout = image_layout(height, width, SMOLVLM_IMAGES)
            patches += layout.num_tiles * PATCHES_PER_TILE
            tokens += num_image_tokens(layout, SMOLVLM_IMAGES, double_newline_tokens=1)
        requests.append(ImageRequest(0.0, text, images, patches, tokens))
    return requests


def poisson_arrivals(requests: list[ImageRequest], rate_per_s: float, seed: int) -> list[ImageRequest]:
    rng = random.Random(seed)
    clock = 0.0
    timed = []
    for request in requests:
        clock += rng.expovariate(rate_per_s)
        timed.append(ImageRequest(clock, request.text_tokens, request.images, request.patches, request.image_tokens))
    return timed


@dataclass
class EncodeRun:
    ready_s: list[float]  # when each request's embeddings are at the prefill (its arrival for text)
    wait_s: list[float]  # image requests: arrival to the start of their batch
    stats: PoolStats
    span_s: float


def simulate_encode(
    requests: list[ImageRequest], policy: EncoderPolicy, encoders: int, cost: EncoderCost, noise: Callable[[], float]
) -> EncodeRun:
    sim = Simulator()
    queues: list[deque[int]] = [deque() for _ in range(encoders)]
    busy = [False] * encoders
    ready = [r.arrival_s for r in requests]
    wait: list[float] = []
    stats = PoolStats()

    def start(encoder: int) -> None:
        queue = queues[encoder]
        busy[encoder] = bool(queue)
        if not queue:
            return
        batch = [queue.popleft()]
        patches = requests[batch[0]].patches
        while queue and patches + requests[queue[0]].patches <= cost.batch_patches:
            patches += requests[queue[0]].patches
            batch.append(queue.popleft())
        wait.extend(sim.now - requests[i].arrival_s for i in batch)
        took = (cost.batch_overhead_s + patches / cost.patches_per_s) * noise()
        stats.busy_s += took
        sim.at(sim.now + took, lambda: finish(encoder, batch))

    def finish(encoder: int, batch: list[int]) -> None:
        for index in batch:
            ready[index] = sim.now
            policy.on_done(encoder, requests[index].patches)
        start(encoder)

    def arrive(index: int) -> None:
        encoder = policy.choose(requests[index].patches)
        stats.sample_imbalance([float(p) for p in policy.patches])
        queues[encoder].append(index)
        if not busy[encoder]:
            start(encoder)

    for index, request in enumerate(requests):
        if request.patches:
            sim.at(request.arrival_s, lambda index=index: arrive(index))
    sim.run()
    return EncodeRun(ready_s=ready, wait_s=wait, stats=stats, span_s=sim.now - requests[0].arrival_s)


def prefill_after_encode(
    requests: list[ImageRequest],
    ready_s: list[float],
    args: argparse.Namespace,
    model: PrefillCostModel,
    budget_s: float,
    window_s: float,
) -> tuple[list[float], PoolStats, float]:
    """Each request's first-token time through lb_sim's prefill pool, joining it when ready."""
    order = sorted(range(len(requests)), key=ready_s.__getitem__)
    joined = [SimRequest(ready_s[i], requests[i].prompt_tokens, 0, 1) for i in order]
    worker_ids = [f"prefill-{i}" for i in range(args.prefill_workers)]
    policy = PrefillBalancer(
        worker_ids, model, tiers=args.tiers, window_s=window_s, step_budget_s=budget_s, chunk_limit=CHUNK_LIMIT
    )
    first, stats, span_s = simulate_prefill(joined, policy, worker_ids, model, budget_s, _noise(args.noise, args.seed))
    first_token = [math.nan] * len(requests)
    for position, index in enumerate(order):
        first_token[index] = first[position]
    return first_token, stats, span_s


def run(args: argparse.Namespace) -> dict[str, object]:
    started = time.perf_counter()
    model = PrefillCostModel.load(args.cost_model)
    budget_s = args.step_budget_s or model.predict(512, 0)
    cost = EncoderCost(args.encoder_patches_per_s, args.encoder_batch_overhead_s, args.encoder_batch_patches)
    count = QUICK_IMAGE_REQUESTS if args.quick else args.image_requests
    drawn = draw_requests(count, args.seed)
    encode_work = sum(cost.work_s(r.patches) for r in drawn if r.patches)
    rate = args.encoder_utilization * args.encoders * len(drawn) / encode_work
    requests = poisson_arrivals(drawn, rate, args.seed + 2)
    prefill_work = [model.predict_prefill(r.prompt_tokens, 0, budget_s, limit=CHUNK_LIMIT) for r in requests]
    prefill_load = rate * float(np.mean(prefill_work)) / args.prefill_workers
    if prefill_load >= 0.95:
        raise ValueError(
            f"the prefill pool would run at {prefill_load:.2f} of its capacity, a bottleneck that hides the"
            " encoders': give it more --prefill-workers or a lower --encoder-utilization"
        )
    window_s = args.window_s or DEFAULT_WINDOW_REQUESTS * float(np.mean(prefill_work))
    imaged = [i for i, r in enumerate(requests) if r.patches]
    texts = [i for i, r in enumerate(requests) if not r.patches]

    rows = []
    for name, make in ENCODER_POLICIES.items():
        encoded = simulate_encode(requests, make(args.encoders), args.encoders, cost, _noise(args.noise, args.seed + 1))
        first_token, prefill_stats, prefill_span_s = prefill_after_encode(
            requests, encoded.ready_s, args, model, budget_s, window_s
        )
        ttft = [first_token[i] - requests[i].arrival_s for i in imaged]
        encode = [encoded.ready_s[i] - requests[i].arrival_s for i in imaged]
        rows.append(
            {
                "policy": name,
                "image_ttft_p50_s": _percentile(ttft, 0.5),
                "image_ttft_p99_s": _percentile(ttft, 0.99),
                "image_ttft_mean_s": round(float(np.mean(ttft)), 4),
                "encode_wait_p99_s": _percentile(encoded.wait_s, 0.99),
                "encoded_p99_s": _percentile(encode, 0.99),
                "text_ttft_p99_s": _percentile([first_token[i] - requests[i].arrival_s for i in texts], 0.99)
                if texts
                else None,
                "encoder_imbalance_max_over_mean": _imbalance(encoded.stats),
                "encoder_utilization": round(encoded.stats.busy_s / (encoded.span_s * args.encoders), 3),
                "prefill_utilization": round(prefill_stats.busy_s / (prefill_span_s * args.prefill_workers), 3),
            }
        )
    baseline = next(row for row in rows if row["policy"] == "round_robin")
    patches = [requests[i].patches for i in imaged]
    return {
        "benchmark": "lb_sim",
        "mix": "image",
        "requests": len(requests),
        "image_requests": len(imaged),
        "seed": args.seed,
        "cost_model": {"path": str(args.cost_model), "a": model.a, "b": model.b, "d": model.d, "e": model.e},
        "workload": {
            "image_fraction": IMAGE_FRACTION,
            "images_per_request": dict(IMAGES_PER_REQUEST),
            "aspects_w_over_h": {f"{aspect:.3f}": weight for aspect, weight in ASPECTS},
            "patches_per_tile": PATCHES_PER_TILE,
            "image_settings": {
                "longest_edge": SMOLVLM_IMAGES.longest_edge,
                "tile_side": SMOLVLM_IMAGES.tile_side,
                "image_seq_len": SMOLVLM_IMAGES.image_seq_len,
            },
            "patches_per_image_request": {
                "p50": int(np.quantile(patches, 0.5)),
                "p99": int(np.quantile(patches, 0.99)),
                "max": max(patches),
            },
            "mean_prompt_tokens": round(float(np.mean([r.prompt_tokens for r in requests])), 1),
            "arrival_rate_per_s": round(rate, 3),
            "target_encoder_utilization": args.encoder_utilization,
            "predicted_prefill_load": round(prefill_load, 3),
        },
        "encoder_pool": {
            "encoders": args.encoders,
            "patches_per_s": cost.patches_per_s,
            "batch_overhead_s": cost.batch_overhead_s,
            "batch_patches": cost.batch_patches,
        },
        "prefill_pool": {
            "workers": args.prefill_workers,
            "balancer": "ours",
            "tiers": list(args.tiers),
            "window_s": round(window_s, 3),
            "step_budget_s": round(budget_s, 4),
        },
        "noise_sigma": args.noise,
        "encode": rows,
        "ratios": {
            "image_ttft_p99_over_round_robin": {
                row["policy"]: round(row["image_ttft_p99_s"] / baseline["image_ttft_p99_s"], 3) for row in rows
            },
            "encode_wait_p99_over_round_robin": {
                row["policy"]: round(row["encode_wait_p99_s"] / baseline["encode_wait_p99_s"], 3)
                if baseline["encode_wait_p99_s"]
                else None
                for row in rows
            },
        },
        "seconds": round(time.perf_counter() - started, 1),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    images = parser.add_argument_group("image mix (--image-mix)")
    images.add_argument(
        "--image-mix",
        action="store_true",
        help="simulate the encoder pool before prefill on an image-heavy mix instead of the trace's text",
    )
    images.add_argument("--encoders", type=int, default=4)
    images.add_argument("--encoder-utilization", type=float, default=0.8, help="target encoder pool utilization")
    images.add_argument("--encoder-patches-per-s", type=float, default=DEFAULT_PATCHES_PER_S)
    images.add_argument("--encoder-batch-overhead-s", type=float, default=DEFAULT_BATCH_OVERHEAD_S)
    images.add_argument("--encoder-batch-patches", type=int, default=DEFAULT_BATCH_PATCHES, help="a batch's patches")
    images.add_argument(
        "--image-requests", type=int, default=4000, help=f"requests ({QUICK_IMAGE_REQUESTS} with --quick)"
    )


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.encoders < 1 or not 0 < args.encoder_utilization < 1 or args.image_requests < 1:
        parser.error("--encoders and --image-requests must be positive and --encoder-utilization in (0, 1)")
    if args.encoder_patches_per_s <= 0 or args.encoder_batch_overhead_s < 0 or args.encoder_batch_patches < 1:
        parser.error("--encoder-patches-per-s and --encoder-batch-patches must be positive, the overhead not negative")
