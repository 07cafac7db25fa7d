"""Where a decode step's time goes: the host's share and the kernels', for tuning.

python -m bench.profile_step --device cuda --batch-size 64 --prompt-len 512 --steps 5 [--enforce-eager]
    [--shape qwen3_30b_a3b_16_layers]  (a shape of bench.shapes, random weights; SmolLM2-135M's by default)
    [--quantization fp8] [--kv-cache-dtype fp8]  (FP8 weights and KV cache, as the engine's flags)
    [--prefill]  (profile the batch's prefill steps instead of decode steps)

Prefills the batch first, then profiles `--steps` decode steps: prints the wall time of each step,
the device time of its kernels (from the profiler), and the top kernels. With CUDA graphs the
kernels of a replay still show up under the profiler's CUDA activity. Then the host's side: the
engine's Python functions by their own time over as many steps again (cProfile), which is where a
host-bound step's time goes.
"""

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.shapes import SHAPES, shape
from workers.engine import LLM, SamplingParams
from workers.protocol.engine_request import EngineRequest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--max-batched-tokens", type=int, default=16384)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--shape", default="smollm2_135m", choices=sorted(SHAPES))
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--prefill", action="store_true")
    args = parser.parse_args()
    config = shape(args.shape)
    llm = LLM(
        config,
        device=args.device,
        enable_prefix_caching=False,
        max_num_seqs=max(args.batch_size, 1),
        max_num_batched_tokens=args.max_batched_tokens,
        num_pages=args.batch_size * -(-(args.prompt_len + 64) // 16) + 2,
        max_model_len=args.prompt_len + 64,
        enforce_eager=args.enforce_eager,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    prompts = torch.randint(0, config["vocab_size"], (args.batch_size, args.prompt_len)).tolist()
    engine = llm.engine
    if args.prefill:
        # One prompt through first, so that the profiled prefill compiles no kernel.
        llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=1))
    for index, prompt in enumerate(prompts):
        engine.add_request(
            EngineRequest(
                request_id=str(index),
                prompt_token_ids=prompt,
                params=SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
            )
        )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    started: set[str] = set()
    if args.prefill:
        steps = 0
        with profile(activities=activities) as prof:
            while len(started) < len(prompts):
                start = time.perf_counter()
                started.update(delta.request_id for delta in engine.step())
                _synchronize(args.device)
                steps += 1
                print(f"prefill step: {1000 * (time.perf_counter() - start):.3f} ms", flush=True)
        args.steps = steps
    else:
        while len(started) < len(prompts):
            started.update(delta.request_id for delta in engine.step())
        for _ in range(3):
            engine.step()  # warm decode steps
        with profile(activities=activities) as prof:
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                _synchronize(args.device)
                print(
                    f"decode step at batch {args.batch_size}: {1000 * (time.perf_counter() - start):.3f} ms", flush=True
                )
    events = prof.key_averages()
    if args.device == "cuda":
        device_us = sum(e.self_device_time_total for e in events) / args.steps
        print(f"kernel time per step: {device_us / 1000:.3f} ms")
        print(events.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
    host = cProfile.Profile()
    host.enable()
    for _ in range(args.steps):
        engine.step()
    host.disable()
    print(f"host time of {args.steps} decode steps, by function (cProfile):")
    pstats.Stats(host).sort_stats("tottime").print_stats(20)
    while engine.has_unfinished():
        engine.step()


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
