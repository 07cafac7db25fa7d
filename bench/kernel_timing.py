"""Timing one kernel's launches on a GPU, for the kernel benchmarks (bench.mla_decode,
bench.kv_decode_attention): CUDA-graph replays, and a config's figures or why it failed."""

from collections.abc import Callable

import torch

REPEATS = 20


def median_ms(run: Callable[[], object], launches: int) -> float:
    """Milliseconds per launch: a graph of `launches` calls of `run`, median of REPEATS replays."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            run()
    graph.replay()  # warmup
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / launches)
    return sorted(times)[len(times) // 2]


def timed_or_failed(measure: Callable[[], dict], peer_gb_s: float) -> dict:
    """`measure()`'s figures (with "achieved_gb_s") and their fraction of the peer's bandwidth, or why
    it did not run: a config over the SM's registers or shared memory fails to compile, and a sweep
    goes on past it."""
    try:
        result = measure()
        result["fraction_of_copy"] = round(result["achieved_gb_s"] / peer_gb_s, 3)
    except Exception as error:  # noqa: BLE001 - any failing config is reported, the sweep goes on
        result = {"error": f"{type(error).__name__}: {str(error)[:160]}"}
    return result
