"""Measure real engine prefill steps over a (q, c) grid and fit the cost model `cost(q, c)`; with
--decode, also measure decode steps over a (batch, context) grid and fit `decode(batch, kv)`.

    python -m bench.fit_cost_model [--model smollm2-135m-instruct | tiny-config.json] [--device cpu]
        [--out var/cost_model.json] [--trials 2] [--quick] [--decode]

For each context length c, a prefix of c random tokens is computed once, so that the engine's prefix
cache holds it; then each measured request is that prefix plus q fresh tokens, admitted alone and
timed over the one `LLMEngine.step()` that computes its q tokens and samples its first token (the
engine must report exactly c cached tokens). A grid point's sample is the fastest of --trials such
steps. A random 20% of the samples is held back; the model is fitted on the rest, and its relative
error is reported on both.

Decode (--decode): for each (batch, context) point, `batch` distinct prompts of `context` tokens are
prefilled, then DECODE_STEPS synchronous decode steps are timed one by one (the device synchronised
around each; on CUDA they are replayed from the engine's CUDA graphs, as in serving), and the median
is the sample of (batch, batch * mean context). The decode model is fitted and held back the same way
and saved with the prefill model, which the decode balancer and bench.lb_sim then use for decode.

Prints one JSON object and writes the model to --out; progress goes to stderr.
"""

import argparse
import json
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from statistics import median

import torch

from workers.cost_model import (
    DecodeSample,
    PrefillCostModel,
    StepSample,
    evaluate,
    evaluate_decode,
    fit,
    fit_decode,
)
from workers.engine import LLM, SamplingParams
from workers.engine.engine import LLMEngine
from workers.protocol.engine_request import EngineRequest

MODEL = "smollm2-135m-instruct"
DEFAULT_OUT = Path("var/cost_model.json")
# Sized for the default run to stay within ~3 minutes on a 2-core CPU with SmolLM2-135M.
GRID_Q = (16, 64, 128, 256, 512, 1024)
GRID_C = (0, 1024, 2048, 3072, 4096)
QUICK_Q = (16, 32, 64)
QUICK_C = (0, 32, 64)
HOLD_BACK = 0.2
FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
DECODE_BATCHES = (1, 8, 32, 64, 128, 256)
DECODE_CONTEXTS = (128, 512, 1024, 2048, 4096)
QUICK_DECODE_BATCHES = (1, 2, 4)
QUICK_DECODE_CONTEXTS = (16, 48)
DECODE_STEPS = 8


def measure(
    engine: LLMEngine, grid_q: tuple[int, ...], grid_c: tuple[int, ...], trials: int, rng: random.Random
) -> list[StepSample]:
    """One sample per grid point: the fastest of `trials` steps, each on a fresh suffix. The points
    run in random order, so a burst of load from other processes spreads over the grid instead of
    skewing one context length, and the minimum discards the trials such a burst slowed down."""
    vocab = engine.model_config.vocab_size
    page = engine.config.args.page_size
    bad = [c for c in grid_c if c % page]
    if bad:
        raise ValueError(f"contexts {bad} must be multiples of the page size {page} to be fully cached")
    prefixes = {c: [rng.randrange(vocab) for _ in range(c)] for c in grid_c}
    points = [(q, c) for c in grid_c for q in grid_q if c + q < engine.max_model_len]
    rng.shuffle(points)
    for c, prefix in prefixes.items():
        _compute(engine, f"prefix-{c}", prefix)
    ids = iter(range(1 << 62))
    samples: list[StepSample] = []
    for index, (q, c) in enumerate(points, start=1):
        times = [_timed_step(engine, ids, prefixes[c], q, rng) for _ in range(trials)]
        samples.append(StepSample(q=q, c=c, seconds=min(times)))
        print(f"[{index}/{len(points)}] q={q:5d} c={c:5d} {min(times) * 1000:8.1f} ms", file=sys.stderr, flush=True)
    return samples


def _timed_step(engine: LLMEngine, ids: Iterator[int], prefix: list[int], q: int, rng: random.Random) -> float:
    """Seconds of the step that prefills q fresh tokens over the cached `prefix`; if the prefix was
    evicted meanwhile, it is computed again and the step retried."""
    vocab = engine.model_config.vocab_size
    for _ in range(2):
        tokens = prefix + [rng.randrange(vocab) for _ in range(q)]
        seconds, cached = _step_alone(engine, f"measure-{next(ids)}", tokens)
        if cached == len(prefix):
            return seconds
        _compute(engine, f"prefix-{next(ids)}", prefix)
    raise RuntimeError(f"a {len(prefix)}-token prefix does not stay in the prefix cache; give the engine more KV")


def _compute(engine: LLMEngine, request_id: str, tokens: list[int]) -> None:
    """Prefill `tokens` in the engine's own chunks, which leaves them in the prefix cache."""
    if tokens:
        engine.add_request(EngineRequest(request_id=request_id, prompt_token_ids=tokens, params=FIRST_TOKEN))
        while engine.has_unfinished():
            engine.step()


def _step_alone(engine: LLMEngine, request_id: str, tokens: list[int]) -> tuple[float, int]:
    """(seconds, cached tokens) of the one step that prefills `tokens` and samples their next token."""
    engine.add_request(EngineRequest(request_id=request_id, prompt_token_ids=tokens, params=FIRST_TOKEN))
    started = time.perf_counter()
    deltas = engine.step()
    seconds = time.perf_counter() - started
    if len(deltas) != 1 or not deltas[0].finished:
        raise RuntimeError(f"the step did not prefill {len(tokens)} tokens in one go: {deltas}")
    return seconds, deltas[0].num_cached_tokens


def measure_decode(
    model: str, device: str, batches: tuple[int, ...], contexts: tuple[int, ...], seed: int, rng: random.Random
) -> list[DecodeSample]:
    """One sample per (batch, context): the median of DECODE_STEPS synchronous decode steps."""
    max_context = max(contexts) + DECODE_STEPS + 2
    llm = LLM(
        model,
        device=device,
        seed=seed,
        enable_prefix_caching=False,
        async_scheduling=False,
        max_num_seqs=max(batches),
        # Every point's prompts prefill in one step: prefilled one by one, the first ones would reach
        # max_tokens and finish before the last were in, and the timed steps would decode a few.
        max_num_batched_tokens=max(batches) * max(contexts),
        max_model_len=max_context,
        num_pages=max(batches) * -(-max_context // 16) + 2,
    )
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    points = [(b, c) for b in batches for c in contexts]
    rng.shuffle(points)
    ids = iter(range(1 << 62))
    samples = []
    for index, (batch, context) in enumerate(points, start=1):
        params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 2, ignore_eos=True)
        for _ in range(batch):
            engine.add_request(
                EngineRequest(
                    request_id=f"decode-{next(ids)}",
                    prompt_token_ids=[rng.randrange(vocab) for _ in range(context)],
                    params=params,
                )
            )
        while engine.scheduler.waiting or any(not r.output_token_ids for r in engine.scheduler.running):
            engine.step()
        engine.step()  # the first decode step after a prefill step (graph bucket, allocator) is not timed
        times = []
        for _ in range(DECODE_STEPS):
            started = _synchronized(device)
            decoded = len(engine.step())
            times.append(_synchronized(device) - started)
            if decoded != batch:
                raise RuntimeError(f"a timed decode step decoded {decoded} of the batch's {batch} requests")
        while engine.has_unfinished():
            engine.step()
        seconds = median(times)
        # The timed steps attend to the prompt, the first two tokens and on average half of theirs.
        mean_context = context + 2 + DECODE_STEPS // 2
        samples.append(DecodeSample(batch=batch, total_kv=batch * mean_context, seconds=seconds))
        print(f"[{index}/{len(points)}] decode batch={batch:4d} context={context:5d} {seconds * 1000:8.3f} ms",
              file=sys.stderr, flush=True)  # fmt: skip
    llm.close()
    return samples


def _synchronized(device: str) -> float:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def run(
    model: str, device: str, trials: int, quick: bool, seed: int, decode: bool = False
) -> tuple[PrefillCostModel, dict[str, object]]:
    grid_q, grid_c = (QUICK_Q, QUICK_C) if quick else (GRID_Q, GRID_C)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    # Synchronous steps: each timed step must return the token it sampled.
    llm = LLM(
        model,
        device=device,
        max_num_batched_tokens=max(grid_q),
        max_num_seqs=1,
        seed=seed,
        async_scheduling=False,
        # One prompt at a time needs little KV, and the decode grid's engine (measure_decode), built
        # while this one is alive, needs the device's memory.
        kv_cache_bytes=1 << 30,
    )
    engine = llm.engine
    _step_alone(engine, "warm-up", [1] * max(grid_q))  # first-call allocations
    started = time.perf_counter()
    samples = measure(engine, grid_q, grid_c, trials, rng)
    measure_s = time.perf_counter() - started
    llm.close()

    rng.shuffle(samples)
    held = max(1, round(len(samples) * HOLD_BACK))
    held_back, training = samples[:held], samples[held:]
    cost_model, train_report = fit(training)
    held_report = evaluate(cost_model, held_back)
    decode_result = None
    if decode:
        batches, contexts = (
            (QUICK_DECODE_BATCHES, QUICK_DECODE_CONTEXTS) if quick else (DECODE_BATCHES, DECODE_CONTEXTS)
        )
        decode_samples = measure_decode(model, device, batches, contexts, seed, rng)
        rng.shuffle(decode_samples)
        held = max(1, round(len(decode_samples) * HOLD_BACK))
        decode_model, decode_train = fit_decode(decode_samples[held:])
        cost_model = replace(cost_model, decode=decode_model)
        decode_result = {
            "grid": {"batch": list(batches), "context": list(contexts), "steps": DECODE_STEPS},
            "coefficients": {"a": decode_model.a, "b": decode_model.b, "e": decode_model.e},
            "fit_error_train": _report(decode_train),
            "fit_error_held_back": _report(evaluate_decode(decode_model, decode_samples[:held])),
            "samples": [
                {"batch": s.batch, "total_kv": s.total_kv, "ms": round(s.seconds * 1000, 4)}
                for s in sorted(decode_samples, key=lambda s: (s.batch, s.total_kv))
            ],
        }
    result = {
        "benchmark": "fit_cost_model",
        "model": model,
        "device": device,
        "grid": {"q": list(grid_q), "c": list(grid_c), "trials": trials},
        "coefficients": {"a": cost_model.a, "b": cost_model.b, "d": cost_model.d, "e": cost_model.e},
        "fit_error_train": _report(train_report),
        "fit_error_held_back": _report(held_report),
        "measure_seconds": round(measure_s, 1),
        "decode": decode_result,
    }
    return cost_model, result


def _report(report) -> dict[str, float | int]:
    return {
        "samples": report.samples,
        "median_rel_error": round(report.median_rel_error, 4),
        "p90_rel_error": round(report.p90_rel_error, 4),
        "max_rel_error": round(report.max_rel_error, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=MODEL, help="packaged model name, HF directory or config JSON")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--trials", type=int, default=2, help="timings per grid point (the fastest is kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a tiny grid, for tests")
    parser.add_argument("--decode", action="store_true", help="also measure and fit decode steps")
    args = parser.parse_args()
    if args.trials < 1:
        parser.error("--trials must be >= 1")
    cost_model, result = run(args.model, args.device, args.trials, args.quick, args.seed, decode=args.decode)
    cost_model.save(args.out)
    result["out"] = str(args.out)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
