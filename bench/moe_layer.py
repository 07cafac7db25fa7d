"""A MoE layer's routed experts at a Qwen3-30B-A3B layer's shape (128 experts, top-8, hidden 2048,
expert intermediate 768, bf16) with random routing: the fused op's two paths, the aligned grouped
GEMMs (what every token count ran before the direct path; still the op's path beyond
kernels.moe.configs.DIRECT_MAX_PAIRS pairs) and the direct path (kernels.moe.direct, the op's path
up to that bound, timed here up to DIRECT_BENCH_MAX_PAIRS), against the per-expert torch loop
(kernels.moe.reference); `fused_path` says which one kernels.moe.fused_experts takes:

    python -m bench.moe_layer [--tokens 1,2,4,8,16,32,64,256] [--runs 50]
    python -m bench.moe_layer --tiny    # a toy shape, runnable on the CPU (Triton's interpreter)

Per token count: the median of --runs timed calls after warm-up (CUDA events on the GPU) of the
loop, and of each path called eagerly and replayed from a CUDA graph (what a decode step sees: its
launches without their Python overhead); the kernels one eager call launches (torch's profiler);
each graph time's fraction of the roofline, the weights of the experts the routing touches plus
hidden in and out streamed once at the device-to-device copy bandwidth measured in the same run;
achieved TFLOP/s (2 * tokens * top_k * 3 * hidden * intermediate multiply-adds over the time); and
the largest difference of each path from the loop. Prints one JSON object.
"""

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

# The direct path is timed beside the aligned one up to 4x the pairs fused_experts gives it
# (kernels.moe.configs.DIRECT_MAX_PAIRS), to show where the bound should sit.
DIRECT_BENCH_MAX_PAIRS = 256
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


def copy_bandwidth(device: torch.device, runs: int, warmup: int) -> float:
    """Bytes per second a device-to-device copy of 1 GiB moves (read plus write)."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source), runs=runs, warmup=warmup, device=device)
    return 2 * source.numel() / (ms / 1000)


def kernel_launches(run: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def streamed_bytes(inputs: tuple[torch.Tensor, ...]) -> int:
    """The least the op must move: each touched expert's weights once, hidden read and written."""
    x, w13, w2, ids, _ = inputs
    touched = ids[(ids >= 0) & (ids < w13.shape[0])].unique().numel()
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    return touched * expert_bytes + 2 * x.numel() * x.element_size()


def measure(
    tokens: int, shape: dict, dtype: torch.dtype, device: torch.device, runs: int, warmup: int, bandwidth: float | None
) -> dict:
    from kernels.moe import experts_reference
    from kernels.moe.configs import tile_config
    from kernels.moe.direct import direct_experts
    from kernels.moe.fused import aligned_experts

    inputs = routed_inputs(tokens, shape, dtype, device)
    reference = experts_reference(*inputs).float()
    loop_ms = median_ms(lambda: experts_reference(*inputs), runs=runs, warmup=warmup, device=device)
    flops = 2 * tokens * shape["top_k"] * 3 * shape["hidden"] * shape["intermediate"]
    row = {"tokens": tokens, "loop_ms": round(loop_ms, 4), "loop_tflops": round(flops / (loop_ms / 1000) / 1e12, 2)}
    if bandwidth is not None:
        row["roofline_ms"] = round(streamed_bytes(inputs) / bandwidth * 1000, 4)
    paths = {"aligned": aligned_experts}
    if tokens * shape["top_k"] <= DIRECT_BENCH_MAX_PAIRS:
        paths["direct"] = direct_experts
    for name, op in paths.items():
        row[f"{name}_max_abs_diff"] = (op(*inputs).float() - reference).abs().max().item()
        row[f"{name}_ms"] = round(median_ms(lambda op=op: op(*inputs), runs=runs, warmup=warmup, device=device), 4)
        if device.type != "cuda":
            continue
        row[f"{name}_launches"] = kernel_launches(lambda op=op: op(*inputs))
        graph_ms = median_ms(graph_replay(lambda op=op: op(*inputs)), runs=runs, warmup=warmup, device=device)
        row[f"{name}_graph_ms"] = round(graph_ms, 4)
        row[f"{name}_graph_roofline_fraction"] = round(row["roofline_ms"] / graph_ms, 3)
        row[f"{name}_graph_tflops"] = round(flops / (graph_ms / 1000) / 1e12, 2)
    row["fused_path"] = "direct" if tile_config(tokens * shape["top_k"], shape["experts"]).direct else "aligned"
    if device.type == "cuda" and "direct" in paths:
        row["direct_graph_speedup_over_aligned"] = round(row["aligned_graph_ms"] / row["direct_graph_ms"], 2)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--tokens", default=None, help="comma-separated token counts (default 1,2,4,8,16,32,64,256; tiny 2,4,24)"
    )
    parser.add_argument("--runs", type=int, default=50)
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
    tokens = [int(t) for t in (args.tokens or ("2,4,24" if args.tiny else "1,2,4,8,16,32,64,256")).split(",")]
    bandwidth = copy_bandwidth(device, args.runs, args.warmup) if device.type == "cuda" else None
    rows = [measure(t, shape, dtype, device, args.runs, args.warmup, bandwidth) for t in tokens]
    print(json.dumps({"benchmark": "moe_layer", "device": torch.cuda.get_device_name() if device.type == "cuda"
                      else "cpu", "dtype": str(dtype).removeprefix("torch."), **shape,
                      "copy_gb_per_s": bandwidth and round(bandwidth / 1e9), "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
