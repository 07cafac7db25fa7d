"""Time to the first token of a long prompt whose prefix the engine has cached, and where that time goes:

    python3 -m bench.cached_prefill [--prompt-len 8421] [--cached 8400] [--runs 5]

On CUDA, random bf16 weights of a Llama-3.1-8B shape (the served-stack benchmark's). A prompt of
--prompt-len tokens is computed once; then --runs prompts sharing its first --cached tokens (whole
pages are hit, the rest computed) each run alone, timed from add_request to the first token (the
device synchronised). Peer in the same run: a --peer-len-token prompt computed from scratch. The
last cached run is profiled (torch.profiler): time on the host vs in kernels, and the kernels that
took longest. Prints one JSON object.
"""

import argparse
import json
import statistics
import time

import torch

from bench.shapes import shape
from workers.protocol.engine_request import EngineRequest


def first_token_s(engine, request_id: str, prompt: list[int]) -> float:
    from workers.engine import SamplingParams

    torch.cuda.synchronize()
    started = time.perf_counter()
    engine.add_request(
        EngineRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        )
    )
    while not any(delta.token_ids for delta in engine.step()):
        pass
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    while engine.has_unfinished():
        engine.step()
    return seconds


def main() -> None:
    from workers.engine import LLM

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=8421)
    parser.add_argument("--cached", type=int, default=8400)
    parser.add_argument("--peer-len", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    config = {**shape("llama3_8b"), "num_hidden_layers": args.layers}
    engine = LLM(config, device="cuda", max_model_len=16384).engine
    generator = torch.Generator().manual_seed(0)
    vocab = config["vocab_size"]

    def tokens(count: int) -> list[int]:
        return torch.randint(vocab, (count,), generator=generator).tolist()

    base = tokens(args.prompt_len)
    first_token_s(engine, "warm", base)
    peer = [first_token_s(engine, f"peer-{run}", tokens(args.peer_len)) for run in range(args.runs)]
    cached = []
    for run in range(args.runs):
        cached.append(
            first_token_s(engine, f"cached-{run}", base[: args.cached] + tokens(args.prompt_len - args.cached))
        )
    prompt = base[: args.cached] + tokens(args.prompt_len - args.cached)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as profile:
        profiled_s = first_token_s(engine, "profiled", prompt)
    events = profile.key_averages()
    kernels = sorted(
        (e for e in events if e.device_time_total > 0 and e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.device_time_total,
        reverse=True,
    )
    device_s = sum(e.device_time_total for e in kernels) / 1e6
    stats = engine.stats()
    print(
        json.dumps(
            {
                "benchmark": "cached_prefill",
                "device": torch.cuda.get_device_name(),
                "model": f"Llama-3.1-8B shape, {args.layers} layers, random bf16 weights",
                "prompt_len": args.prompt_len,
                "cached_tokens": args.cached,
                "cached_prompt_tokens_hit": stats.num_cached_prompt_tokens,
                "ttft_cached_ms": [round(s * 1000, 2) for s in cached],
                "ttft_cached_median_ms": round(statistics.median(cached) * 1000, 2),
                f"ttft_uncached_{args.peer_len}_median_ms": round(statistics.median(peer) * 1000, 2),
                "profiled_ms": round(profiled_s * 1000, 2),
                "profiled_kernel_ms": round(device_s * 1000, 2),
                "top_kernels_ms": {e.key[:80]: round(e.device_time_total / 1000, 3) for e in kernels[:8]},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
