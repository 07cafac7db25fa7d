"""The Triton MLA decode kernel alone at DeepSeek-V3's shape (128 heads, latent 512 + 64, values 512,
bf16, pages of 16), against the device's own copy bandwidth measured in the same run:

    python -m bench.mla_decode [--batch-sizes 64,128] [--context 4096] [--num-splits 8]

Each call is timed in CUDA-graph replays of LAUNCHES launches (median of REPEATS replays, after a
warmup replay). Bytes moved are what the call must touch at least: every row's latents (context x
576 x 2 bytes), its queries and its outputs; the split partials the kernel writes and merges are
reported beside them, not counted. The peer is a large device-to-device tensor copy (bytes read
plus written). Prints one JSON object.
"""

import argparse
import json
import sys

import torch

from kernels.attention.triton.mla_decode import BLOCK_H, DECODE_KEY_TILE, NUM_SPLITS, paged_mla_decode

HEADS, V_DIM, ROPE_DIM = 128, 512, 64
LATENT_DIM = V_DIM + ROPE_DIM
PAGE = 16  # workers/args.py's default page_size
DTYPE = torch.bfloat16
LAUNCHES = 10  # per graph replay
REPEATS = 20
COPY_BYTES = 2**31  # the peer copy's source: far larger than L2


def median_ms(run, launches: int) -> float:
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


def copy_bandwidth() -> float:
    """GB/s of a device-to-device tensor copy, counting bytes read and written."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), launches=1)
    return 2 * COPY_BYTES / ms / 1e6


def time_decode(batch: int, context: int, num_splits: int) -> dict:
    device = torch.device("cuda")
    pages_per_row = -(-context // PAGE)
    cache = torch.randn(1, batch * pages_per_row + 1, PAGE, LATENT_DIM, device=device, dtype=DTYPE)
    tables = (torch.arange(batch * pages_per_row, device=device, dtype=torch.int32) + 1).view(batch, pages_per_row)
    seq_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    q = torch.randn(batch, HEADS, LATENT_DIM, device=device, dtype=DTYPE)
    out = torch.empty(batch, HEADS, V_DIM, device=device, dtype=DTYPE)

    def run() -> None:
        paged_mla_decode(
            q, cache, tables, seq_lens, v_dim=V_DIM, scale=LATENT_DIM**-0.5, out=out, num_splits=num_splits
        )

    ms = median_ms(run, LAUNCHES)
    element = DTYPE.itemsize
    moved = batch * (context * LATENT_DIM + HEADS * LATENT_DIM + HEADS * V_DIM) * element
    partials = batch * HEADS * num_splits * (V_DIM + 1) * 4  # fp32, written once and read once by the merge
    return {
        "us_per_call": round(ms * 1000, 2),
        "bytes_moved": moved,
        "achieved_gb_s": round(moved / ms / 1e6, 1),
        "partial_bytes_written": partials,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="64,128")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--num-splits", type=int, default=NUM_SPLITS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.mla_decode times a CUDA kernel: it needs a CUDA device")
    peer = copy_bandwidth()
    results = {}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        result = time_decode(batch, args.context, args.num_splits)
        result["fraction_of_copy"] = round(result["achieved_gb_s"] / peer, 3)
        results[batch] = result
    print(json.dumps({"benchmark": "mla_decode", "device": torch.cuda.get_device_name(), "heads": HEADS,
                      "latent_dim": LATENT_DIM, "v_dim": V_DIM, "page_size": PAGE, "dtype": str(DTYPE),
                      "context": args.context, "num_splits": args.num_splits, "block_h": BLOCK_H,
                      "key_tile": DECODE_KEY_TILE, "copy_gb_s": round(peer, 1), "by_batch": results}))  # fmt: skip


if __name__ == "__main__":
    main()
