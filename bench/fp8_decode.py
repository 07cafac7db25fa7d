"""Decode throughput with FP8 weights and an FP8 KV cache against bf16, each variant's engine in the same
run on the same random prompts, and each step's time against its memory roofline.

    python -m bench.fp8_decode --shape llama3_8b --batch-sizes 1 --prompt-len 1024 --variants bf16,fp8_weights
    python -m bench.fp8_decode --shape llama3_8b --batch-sizes 256 --prompt-len 4096 --new-tokens 64 \\
        --variants bf16,fp8_weights_kv
    python -m bench.fp8_decode --shape deepseek_v3_4_layers --batch-sizes 1,64 --variants fp8_weights

Variants: bf16 (the peer), fp8_weights (`--quantization fp8`: bf16 random weights quantized at load),
fp8_kv (`--kv-cache-dtype fp8`), fp8_weights_kv (both). Each engine sizes its KV cache from
--gpu-memory-utilization, so an FP8 cache holds more sequences: where a bf16 cache cannot hold the
whole batch at its context, the bf16 engine runs fewer at once, as a served one would
(`max_running` says how many ran). The roofline as bench.decode_roofline's: the bytes a step reads
(the weights it touches, at their stored size, and the batch's KV) at the device's copy bandwidth.
Prints one JSON object.
"""

import argparse
import gc
import json

import torch

from bench.decode_roofline import copy_bandwidth, decode_rows
from bench.shapes import shape
from workers.engine import LLM

VARIANTS = {
    "bf16": {},
    "fp8_weights": {"quantization": "fp8"},
    "fp8_kv": {"kv_cache_dtype": "fp8"},
    "fp8_weights_kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}


def main() -> None:
    args = _parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_decode measures a GPU: no CUDA device here")
    variants = args.variants.split(",")
    if unknown := set(variants) - VARIANTS.keys():
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {sorted(VARIANTS)}")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    copy_bytes_per_s = copy_bandwidth(torch.device("cuda"))
    results = {}
    for variant in variants:
        results[variant] = _measure_variant(variant, args, batch_sizes, copy_bytes_per_s)
        gc.collect()
        torch.cuda.empty_cache()
    peer = results.get("bf16")
    ratios = {}
    if peer is not None:
        for variant, result in results.items():
            ratios[variant] = {
                str(row["batch_size"]): round(row["decode_tok_s"] / base["decode_tok_s"], 3)
                for row, base in zip(result["rows"], peer["rows"], strict=True)
            }
    print(
        json.dumps(
            {
                "benchmark": "fp8_decode",
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "shape": args.shape,
                "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens,
                "copy_bytes_per_s": copy_bytes_per_s,
                "variants": results,
                "decode_speedup_over_bf16": ratios,
            },
            indent=2,
        )
    )


def _measure_variant(variant: str, args: argparse.Namespace, batch_sizes: list[int], copy_bytes_per_s: float) -> dict:
    context = args.prompt_len + args.new_tokens
    llm = LLM(
        shape(args.shape),
        device="cuda",
        dtype=torch.bfloat16,
        enable_prefix_caching=False,
        max_num_seqs=max(batch_sizes),
        max_num_batched_tokens=args.max_batched_tokens,
        max_model_len=context,
        **VARIANTS[variant],
    )
    runner = llm.engine.runner
    specs = runner.kv_cache.specs
    rows = decode_rows(llm, batch_sizes, args, copy_bytes_per_s, {"variant": variant})
    result = {
        "settings": VARIANTS[variant],
        "kv_layout": specs.layout,
        "kv_pages": runner.kv_cache.num_pages,
        "kv_bytes_per_token": specs.bytes_per_token,
        "rows": rows,
    }
    llm.engine.close()
    return result


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3_8b")
    parser.add_argument("--batch-sizes", default="1")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-batched-tokens", type=int, default=32768)
    parser.add_argument("--variants", default="bf16,fp8_weights,fp8_weights_kv")
    return parser.parse_args()


if __name__ == "__main__":
    main()
