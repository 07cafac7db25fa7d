"""What expert parallelism costs one MoE layer on one GPU: ExpertParallelExperts over a single-rank
NCCL group (replica choice, the per-destination rows, four all-to-alls, the combine) against the
fused experts op it wraps, called directly (kernels.moe.experts), at a Qwen3-30B-A3B layer's shape
(128 experts, top-8, hidden 2048, expert intermediate 768, bf16) with random routing:

    python3 -m bench.ep_layer [--tokens 64,512,4096] [--runs 20]

Per token count: the median of --runs calls after warm-up (CUDA events), for the plain op, the EP
layer with one slot per expert, and with 32 redundant slots (the first 32 experts twice: replica
choice by token index); each EP time over the plain one; and the largest difference between the
EP and plain outputs. Several GPUs (the all-to-alls doing real work) are a later issue's benchmark.
Prints one JSON object.
"""

import argparse
import json

import torch

from bench.moe_layer import QWEN3_30B, median_ms, routed_inputs

REDUNDANT_SLOTS = 32


def measure(tokens: int, group, runs: int, warmup: int) -> dict:
    from kernels.moe import experts
    from workers.engine.parallel.experts import ExpertParallelExperts

    device = torch.device("cuda")
    x, w13, w2, ids, weights = routed_inputs(tokens, QWEN3_30B, torch.bfloat16, device)
    plain_ms = median_ms(lambda: experts(x, w13, w2, ids, weights), runs=runs, warmup=warmup, device=device)
    expected = experts(x, w13, w2, ids, weights).float()
    row = {"tokens": tokens, "plain_ms": round(plain_ms, 4)}
    num_experts = QWEN3_30B["experts"]
    for name, extra in (("ep", 0), ("ep_redundant", REDUNDANT_SLOTS)):
        placement = [[i % num_experts for i in range(num_experts + extra)]]
        layer = ExpertParallelExperts(
            group=group,
            host_w13=w13,
            host_w2=w2,
            placement=placement,
            top_k=QWEN3_30B["top_k"],
            compute=experts,
        )
        ms = median_ms(lambda layer=layer: layer(x, ids, weights), runs=runs, warmup=warmup, device=device)
        row[f"{name}_ms"] = round(ms, 4)
        row[f"{name}_over_plain"] = round(ms / plain_ms, 3)
        row[f"{name}_max_abs_diff"] = (layer(x, ids, weights).float() - expected).abs().max().item()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="64,512,4096", help="comma-separated token counts")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the NCCL path)")
    from workers.engine.parallel.groups import Rendezvous, join_group

    rendezvous = Rendezvous.open(1)
    group = join_group(rank=0, size=1, port=rendezvous.port, device=torch.device("cuda"), rendezvous=rendezvous)
    try:
        rows = [measure(int(t), group, args.runs, args.warmup) for t in args.tokens.split(",")]
    finally:
        group.destroy()
    print(json.dumps({"benchmark": "ep_layer", "device": torch.cuda.get_device_name(), "dtype": "bfloat16",
                      "ranks": 1, **QWEN3_30B, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
