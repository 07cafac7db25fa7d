"""The Triton GQA decode attention kernel alone over a bf16 and an FP8 KV cache (Llama-3.1-8B's heads:
32 query heads, 8 KV heads of 128, pages of 16), against the device's copy bandwidth measured in the
same run:

    python -m bench.kv_decode_attention [--batch-sizes 1,64,128] [--context 4096] [--sweep]

Each call is timed in CUDA-graph replays (bench.kernel_timing) over enough distinct caches
that no launch finds the last one's rows in L2. Bytes moved are what the call must read at least:
every row's keys and values as stored (an FP8 row's e4m3 bytes, scale and padding: 144 bytes where
bf16 takes 256), its queries and its outputs. The FP8 cache is the same random bf16 values quantized
(kernels.attention.fp8_kv), so `fp8_time_ratio` is FP8's time over bf16's at each batch: 144/256 =
0.5625 where both run at the same bandwidth. With --sweep, every config of SWEEP for each cache
dtype at the largest batch. Prints one JSON object.
"""

import argparse
import itertools
import json
import sys
from dataclasses import asdict

import torch

from bench import kernel_timing
from bench.decode_roofline import copy_bandwidth
from bench.kernel_timing import median_ms
from kernels.attention.fp8_kv import quantize_rows
from kernels.attention.triton.decode import DecodeConfig, decode_config, paged_decode_attention

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
L2_FLUSH_BYTES = 2**28  # distinct caches per graph: at least this many bytes between reuses
LAUNCHES = 8
SWEEP = {"block_n": (32, 64, 128), "num_warps": (2, 4, 8), "num_stages": (1, 2, 3), "split_keys": (128, 256, 512)}
CACHE_DTYPES = ("bf16", "fp8")


def time_decode(batch: int, context: int, cache_dtype: str, config: DecodeConfig) -> dict:
    device = torch.device("cuda")
    pages_per_row = -(-context // PAGE)
    pages = batch * pages_per_row + 1
    values = torch.randn(KV_HEADS, pages, PAGE, HEAD_DIM, device=device, dtype=torch.bfloat16)
    cache = quantize_rows(values) if cache_dtype == "fp8" else values
    del values
    copies = max(1, min(LAUNCHES, -(-L2_FLUSH_BYTES // (2 * cache.numel() * cache.element_size()))))
    caches = [(cache, cache.clone())] + [(cache.clone(), cache.clone()) for _ in range(copies - 1)]
    tables = (torch.arange(batch * pages_per_row, device=device, dtype=torch.int32) + 1).view(batch, pages_per_row)
    seq_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    turn = iter(itertools.cycle(caches))

    def run() -> None:
        k, v = next(turn)
        paged_decode_attention(q, k, v, tables, seq_lens, scale=HEAD_DIM**-0.5, out=out, config=config)

    ms = median_ms(run, LAUNCHES)
    row_bytes = cache.shape[-1] * cache.element_size()
    moved = batch * (2 * KV_HEADS * context * row_bytes + 2 * HEADS * HEAD_DIM * q.element_size())
    return {"us_per_call": round(ms * 1000, 2), "bytes_moved": moved, "achieved_gb_s": round(moved / ms / 1e6, 1)}


def timed_or_failed(batch: int, context: int, cache_dtype: str, config: DecodeConfig, peer_gb_s: float) -> dict:
    result = kernel_timing.timed_or_failed(lambda: time_decode(batch, context, cache_dtype, config), peer_gb_s)
    torch.cuda.empty_cache()
    print(
        json.dumps({"batch": batch, "cache": cache_dtype, **asdict(config), **result}),
        file=sys.stderr,
        flush=True,
    )
    return result


def sweep(batch: int, context: int, peer_gb_s: float, cache_dtypes: list[str]) -> dict:
    configs = [
        DecodeConfig(split_keys=split_keys, block_n=block_n, num_warps=warps, num_stages=stages)
        for block_n, warps, stages, split_keys in itertools.product(*SWEEP.values())
    ]
    report = {}
    for cache_dtype in cache_dtypes:
        timed = [(config, timed_or_failed(batch, context, cache_dtype, config, peer_gb_s)) for config in configs]
        ran = sorted((pair for pair in timed if "error" not in pair[1]), key=lambda pair: pair[1]["us_per_call"])
        report[cache_dtype] = [{**asdict(config), **result} for config, result in ran] + [
            {**asdict(config), **result} for config, result in timed if "error" in result
        ]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,64,128")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--sweep", action="store_true", help="time every config of SWEEP at the largest batch")
    parser.add_argument("--sweep-caches", default=",".join(CACHE_DTYPES), help="the cache dtypes a sweep times")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kv_decode_attention measures a GPU: no CUDA device here")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    peer_gb_s = copy_bandwidth(torch.device("cuda")) / 1e9
    configs = {dtype: decode_config(HEAD_DIM, fp8=dtype == "fp8") for dtype in CACHE_DTYPES}
    by_batch = {
        batch: {dtype: timed_or_failed(batch, args.context, dtype, configs[dtype], peer_gb_s) for dtype in CACHE_DTYPES}
        for batch in batches
    }
    report = {
        "benchmark": "kv_decode_attention",
        "device": torch.cuda.get_device_name(),
        "context": args.context,
        "copy_gb_s": round(peer_gb_s, 1),
        "engine_configs": {dtype: asdict(config) for dtype, config in configs.items()},
        "by_batch": by_batch,
        "fp8_time_ratio": {
            batch: round(row["fp8"]["us_per_call"] / row["bf16"]["us_per_call"], 3)
            for batch, row in by_batch.items()
            if "error" not in row["fp8"] and "error" not in row["bf16"]
        },
    }
    if args.sweep:
        report["sweep"] = sweep(max(batches), args.context, peer_gb_s, args.sweep_caches.split(","))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
