"""A MoE layer's routed experts: the fused Triton grouped GEMMs (kernels.moe.fused) against the
per-expert torch loop (kernels.moe.reference), at a Qwen3-30B-A3B layer's shape (128 experts, top-8,
hidden 2048, expert intermediate 768, bf16) with random routing:

    python -m bench.moe_layer [--tokens 64,512,4096] [--runs 20]
    python -m bench.moe_layer --tiny    # a toy shape, runnable on the CPU (Triton's interpreter)

Per token count: the median of --runs timed calls after warm-up (CUDA events on the GPU), for the
loop, the fused op called eagerly, and the fused op replayed from a CUDA graph (what a decode step
sees: the launches of the sort and the three kernels without their Python overhead); the speed-up
of each fused time over the loop; achieved TFLOP/s (2 * tokens * top_k * 3 * hidden * intermediate
multiply-adds over the time); and the largest difference between the two outputs. Prints one
JSON object.
"""

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

QWEN3_30B = dict(experts=128, top_k=8, hidden=2048, intermediate=768)
TINY = dict(experts=8, top_k=2, hidden=64, intermediate=32)


def routed_inputs(tokens: int, shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0):
    generator = torch.Generator(device).manual_seed(seed)
    experts, hidden, intermediate = shape["experts"], shape["hidden"], shape["intermediate"]

    def randn(*size: int, scale: float) -> torch.Tensor:
        return (torch.randn(*size, device=device, generator=generator) * scale).to(dtype)

    x = randn(tokens, hidden, scale=1.0)
    w13 = randn(experts, 2 * intermediate, hidden, scale=hidden**-0.5)
    w2 = randn(experts, hidden, intermediate, scale=intermediate**-0.5)
    logits = torch.randn(tokens, experts, device=device, generator=generator)
    weights, ids = logits.softmax(dim=-1).topk(shape["top_k"], dim=-1)
    return x, w13, w2, ids, weights


def median_ms(run: Callable[[], object], *, runs: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(runs):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            run()
            times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def graph_replay(run: Callable[[], object]) -> Callable[[], object]:
    run()  # compiles outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def measure(tokens: int, shape: dict, dtype: torch.dtype, device: torch.device, runs: int, warmup: int) -> dict:
    from kernels.moe import experts_reference, fused_experts

    inputs = routed_inputs(tokens, shape, dtype, device)
    difference = (fused_experts(*inputs).float() - experts_reference(*inputs).float()).abs().max().item()
    loop_ms = median_ms(lambda: experts_reference(*inputs), runs=runs, warmup=warmup, device=device)
    fused_ms = median_ms(lambda: fused_experts(*inputs), runs=runs, warmup=warmup, device=device)
    row = {"tokens": tokens, "loop_ms": round(loop_ms, 4), "fused_ms": round(fused_ms, 4)}
    flops = 2 * tokens * shape["top_k"] * 3 * shape["hidden"] * shape["intermediate"]
    fused_times = {"fused": fused_ms}
    if device.type == "cuda":
        replay = graph_replay(lambda: fused_experts(*inputs))
        fused_times["fused_graph"] = median_ms(replay, runs=runs, warmup=warmup, device=device)
        row["fused_graph_ms"] = round(fused_times["fused_graph"], 4)
    for name, ms in fused_times.items():
        row[f"{name}_speedup"] = round(loop_ms / ms, 2)
        row[f"{name}_tflops"] = round(flops / (ms / 1000) / 1e12, 2)
    row["loop_tflops"] = round(flops / (loop_ms / 1000) / 1e12, 2)
    row["max_abs_diff"] = difference
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=None, help="comma-separated token counts (default 64,512,4096; tiny 4,24)")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="a toy shape in float32, on the CPU without CUDA")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        if not args.tiny:
            parser.error("needs a CUDA device; --tiny runs a toy shape on the CPU")
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when Triton is first imported
        # The interpreter gaps the test suite patches (loop bounds under numpy 2.4) are ours too.
        from tests.triton_interpreter import patch_interpreter

        patch_interpreter()
    shape = TINY if args.tiny else QWEN3_30B
    dtype = torch.float32 if args.tiny else torch.bfloat16
    tokens = [int(t) for t in (args.tokens or ("4,24" if args.tiny else "64,512,4096")).split(",")]
    rows = [measure(t, shape, dtype, device, args.runs, args.warmup) for t in tokens]
    print(json.dumps({"benchmark": "moe_layer", "device": torch.cuda.get_device_name() if device.type == "cuda"
                      else "cpu", "dtype": str(dtype).removeprefix("torch."), **shape, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
