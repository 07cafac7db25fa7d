"""Profile the engine's first steps on a batch (where its time goes), for tuning.

python -m bench.profile_step --device cuda --batch-size 256 --prompt-len 512 --steps 3
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.smollm2_config import SMOLLM2_135M_CONFIG
from workers.engine import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-batched-tokens", type=int, default=16384)
    args = parser.parse_args()
    llm = LLM(
        SMOLLM2_135M_CONFIG,
        device=args.device,
        enable_prefix_caching=False,
        max_num_seqs=args.batch_size,
        max_num_batched_tokens=args.max_batched_tokens,
        num_pages=args.batch_size * -(-(args.prompt_len + 64) // 16) + 2,
    )
    prompts = torch.randint(0, 49152, (args.batch_size, args.prompt_len)).tolist()
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    engine = llm.engine
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            if args.device == "cuda":
                torch.cuda.synchronize()
            print(f"step {time.perf_counter() - start:.4f}s", flush=True)
    sort = "cuda_time_total" if args.device == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60))
    while engine.has_unfinished():
        engine.step()


if __name__ == "__main__":
    main()
