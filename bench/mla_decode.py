"""The Triton MLA decode kernel alone (latent 512 + 64, values 512, bf16, pages of 16; DeepSeek-V3's
128 heads unless --heads says otherwise), against the device's own copy bandwidth measured in the
same run:

    python -m bench.mla_decode [--heads 128] [--batch-sizes 64,128] [--context 4096] [--sweep]

Each call is timed in CUDA-graph replays of LAUNCHES launches (bench.kernel_timing: the median replay, after a
warmup replay). Bytes moved are what the call must touch at least: every row's latents (context x
576 x 2 bytes), its queries and its outputs; the split partials the kernel writes and merges are
reported beside them, not counted. The peer is a large device-to-device tensor copy (bytes read
plus written). Without --sweep, the config the engine uses (DECODE_CONFIG); with it, every kernel
config of SWEEP (the batch sizes' largest batch), then the best few with each split count and
partial dtype at every batch size, and the best config overall (geometric mean over the batches).
Prints one JSON object.
"""

import argparse
import itertools
import json
import math
import sys
from dataclasses import asdict, replace

import torch

from bench import kernel_timing
from bench.kernel_timing import median_ms
from kernels.attention.triton.mla_decode import DECODE_CONFIG, MlaDecodeConfig, paged_mla_decode

V_DIM, ROPE_DIM = 512, 64
LATENT_DIM = V_DIM + ROPE_DIM
PAGE = 16  # workers/args.py's default page_size
DTYPE = torch.bfloat16
LAUNCHES = 10  # per graph replay
COPY_BYTES = 2**31  # the peer copy's source: far larger than L2
# The kernel configs a sweep times: heads per program, keys per tile, warps, pipeline stages.
SWEEP = {"block_h": (16, 32, 64), "block_n": (16, 32, 64), "num_warps": (4, 8), "num_stages": (1, 2, 3)}
SWEEP_SPLITS = (2, 4, 8, 16)
SWEEP_PARTIALS = (torch.float32, torch.bfloat16)
SWEEP_FINALISTS = 3


def copy_bandwidth() -> float:
    """GB/s of a device-to-device tensor copy, counting bytes read and written."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), launches=1)
    return 2 * COPY_BYTES / ms / 1e6


def time_decode(batch: int, heads: int, context: int, config: MlaDecodeConfig) -> dict:
    device = torch.device("cuda")
    pages_per_row = -(-context // PAGE)
    cache = torch.randn(1, batch * pages_per_row + 1, PAGE, LATENT_DIM, device=device, dtype=DTYPE)
    tables = (torch.arange(batch * pages_per_row, device=device, dtype=torch.int32) + 1).view(batch, pages_per_row)
    seq_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    q = torch.randn(batch, heads, LATENT_DIM, device=device, dtype=DTYPE)
    out = torch.empty(batch, heads, V_DIM, device=device, dtype=DTYPE)

    def run() -> None:
        paged_mla_decode(q, cache, tables, seq_lens, v_dim=V_DIM, scale=LATENT_DIM**-0.5, out=out, config=config)

    ms = median_ms(run, LAUNCHES)
    moved = batch * (context * LATENT_DIM + heads * LATENT_DIM + heads * V_DIM) * DTYPE.itemsize
    # Written once and read once by the merge: outputs in the partial dtype, log-sum-exps in float32.
    partials = batch * heads * config.num_splits * (V_DIM * config.partial_dtype.itemsize + 4)
    return {
        "us_per_call": round(ms * 1000, 2),
        "bytes_moved": moved,
        "achieved_gb_s": round(moved / ms / 1e6, 1),
        "partial_bytes_written": partials,
    }


def described(config: MlaDecodeConfig) -> dict:
    return {**asdict(config), "partial_dtype": str(config.partial_dtype).removeprefix("torch.")}


def timed_or_failed(batch: int, heads: int, context: int, config: MlaDecodeConfig, peer: float) -> dict:
    result = kernel_timing.timed_or_failed(lambda: time_decode(batch, heads, context, config), peer)
    # Progress on stderr: a sweep compiles dozens of kernels.
    print(json.dumps({"batch": batch, **described(config), **result}), file=sys.stderr, flush=True)
    return result


def sweep(heads: int, batches: list[int], context: int, peer: float) -> dict:
    kernels = [
        replace(DECODE_CONFIG, block_h=block_h, block_n=block_n, num_warps=warps, num_stages=stages)
        for block_h, block_n, warps, stages in itertools.product(*SWEEP.values())
        if block_h <= max(16, 1 << (heads - 1).bit_length())
    ]
    largest = max(batches)
    timed = [(config, timed_or_failed(largest, heads, context, config, peer)) for config in kernels]
    ran = sorted((pair for pair in timed if "error" not in pair[1]), key=lambda pair: pair[1]["us_per_call"])
    finalists = [config for config, _ in ran[:SWEEP_FINALISTS]]
    candidates = [
        replace(c, num_splits=splits, partial_dtype=dtype)
        for c in finalists
        for splits, dtype in itertools.product(SWEEP_SPLITS, SWEEP_PARTIALS)
    ]
    rows = []
    for config in candidates:
        by_batch = {batch: timed_or_failed(batch, heads, context, config, peer) for batch in batches}
        if all("error" not in result for result in by_batch.values()):
            mean = math.exp(sum(math.log(result["fraction_of_copy"]) for result in by_batch.values()) / len(batches))
            rows.append({"config": described(config), "geomean_fraction_of_copy": round(mean, 3), "by_batch": by_batch})
    rows.sort(key=lambda row: -row["geomean_fraction_of_copy"])
    return {
        "kernel_configs_at_batch": largest,
        "kernel_configs": [{**described(config), **result} for config, result in timed],
        "finalists": rows,
        "best": rows[0] if rows else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--batch-sizes", default="64,128")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--sweep", action="store_true", help="time the configs of SWEEP, not just the engine's")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.mla_decode times a CUDA kernel: it needs a CUDA device")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    peer = copy_bandwidth()
    config = DECODE_CONFIG
    results = {batch: timed_or_failed(batch, args.heads, args.context, config, peer) for batch in batches}
    report = {"benchmark": "mla_decode", "device": torch.cuda.get_device_name(), "heads": args.heads,
              "latent_dim": LATENT_DIM, "v_dim": V_DIM, "page_size": PAGE, "dtype": str(DTYPE),
              "context": args.context, "config": described(config), "copy_gb_s": round(peer, 1),
              "by_batch": results}  # fmt: skip
    if args.sweep:
        report["sweep"] = sweep(args.heads, batches, args.context, peer)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
