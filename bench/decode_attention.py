"""Split-KV decode attention at SmolLM2's shape (9 query heads, 3 KV heads, head_dim 64, pages of
16, bf16) for several keys-per-split, in CUDA-graph replays of 30 launches over 30 layers' caches:

    python -m bench.decode_attention [--batch-sizes 1,16,64,256] [--context 576] [--split-keys 64,128,256]

Fewer keys per split spread a short batch over more multiprocessors (a shorter chain of dependent
loads per program) and cost more partial results to merge. Prints one JSON object: microseconds per
launch for each batch size and split, and each split's ratio against the engine's SPLIT_KEYS.
"""

import argparse
import json
from dataclasses import replace

import torch

from kernels.attention.triton.decode import SPLIT_KEYS, decode_config, paged_decode_attention

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16
LAYERS = 30
MAX_MODEL_LEN = 640  # bench.engine_throughput's prompt 512 + 128 new tokens


def time_launches(batch: int, context: int, split_keys: int) -> float:
    """Microseconds per launch, median of 20 replays of a graph of LAYERS launches."""
    device = torch.device("cuda")
    max_pages = MAX_MODEL_LEN // PAGE
    pages = batch * max_pages + 1
    caches = [
        (torch.randn(KV_HEADS, pages, PAGE, HEAD_DIM, device=device, dtype=torch.bfloat16),) * 2 for _ in range(LAYERS)
    ]
    tables = (torch.arange(batch * max_pages, device=device, dtype=torch.int32) + 1).view(batch, max_pages)
    seq_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)

    config = replace(decode_config(HEAD_DIM, fp8=False), split_keys=split_keys)

    def launches() -> None:
        for k, v in caches:
            paged_decode_attention(q, k, v, tables, seq_lens, scale=HEAD_DIM**-0.5, config=config)

    launches()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launches()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / LAYERS)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16,64,256")
    parser.add_argument("--context", type=int, default=576)
    parser.add_argument("--split-keys", default="64,128,256")
    args = parser.parse_args()
    splits = [int(s) for s in args.split_keys.split(",")]
    if SPLIT_KEYS not in splits:
        splits.append(SPLIT_KEYS)
    times = {
        batch: {split: round(time_launches(batch, args.context, split), 3) for split in splits}
        for batch in (int(b) for b in args.batch_sizes.split(","))
    }
    ratios = {
        batch: {split: round(t / per_split[SPLIT_KEYS], 3) for split, t in per_split.items()}
        for batch, per_split in times.items()
    }
    print(json.dumps({"benchmark": "decode_attention", "context": args.context, "engine_split_keys": SPLIT_KEYS,
                      "us_per_launch": times, "ratio_vs_engine": ratios}))  # fmt: skip


if __name__ == "__main__":
    main()
