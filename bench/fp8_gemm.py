"""The W8A8 block-scaled FP8 GEMM (kernels.quant.fp8_gemm) at Llama-3.1-8B's projection shapes
(qkv 6144x4096, o 4096x4096, gate-up 28672x4096, down 4096x14336 as [N, K]) over token counts, against
two peers timed in the same run: bf16 torch.matmul on the unquantized weight, and torch._scaled_mm
on the same e4m3 values:

    python -m bench.fp8_gemm [--tokens 1,2,...,8192] [--shapes qkv,o,gate_up,down] [--sweep]

torch._scaled_mm is given DeepSeek-V3's scales (1x128 per-token groups, 128x128 weight tiles) where
this torch and GPU take them, checked against the reference; otherwise rowwise scales (one per token,
one per output channel of the dequantized weight) as the nearest peer. `scaled_mm_scaling` says which.
Its activations are quantized before the timed call (our kernel quantizes inside its own time).
Up to GEMV_MAX_M rows the FP8 GEMV (kernels.quant.fp8_gemv) is timed beside them with its own config
choice (what `ours`, the dispatcher, runs up to kernels.quant.fp8_gemm.GEMV_MAX_M rows), so a sweep
can compare its configs with the tiled kernel's.

Per row: the median of triton.testing.do_bench (L2 flushed between calls) for each op; TFLOP/s
(2 * M * N * K over the time); our time over each peer's; and each op's fraction of the memory
roofline: the bytes it must move at least (weight, its scales, activation in, output out) over the
HBM bandwidth of the device (3.35 TB/s for the H100 SXM, 4.8 for the H200), the bound that matters
at small M. --sweep also times a few tile configs per row and reports the fastest beside the table's.
Prints one JSON object. Needs a CUDA device: exits 2 without one.
"""

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial

import torch

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
BLOCK = (128, 128)
GEMV_MAX_M = 4  # rows at which the GEMV candidate is timed too
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}
# The peer's result may differ from our reference by what the float32 summation order gives, far
# under the 2.5% that rowwise scales (a different quantization) or a misread scale layout would.
PEER_AGREEMENT = 1e-2


def hbm_bandwidth(device_name: str) -> float | None:
    return next((bandwidth for name, bandwidth in HBM_BYTES_PER_S.items() if name in device_name), None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated M values")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--sweep", action="store_true", help="also time a few tile configs per row")
    args = parser.parse_args(argv)
    args.tokens = [int(m) for m in args.tokens.split(",")]
    args.shapes = args.shapes.split(",")
    unknown = [name for name in args.shapes if name not in SHAPES]
    if unknown or any(m < 1 for m in args.tokens):
        parser.error(f"shapes must be among {list(SHAPES)} and tokens >= 1, got {unknown or args.tokens}")
    return args


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx.float() - exact.float()).norm() / exact.float().norm()).item()


class ScaledMmPeer:
    """torch._scaled_mm on the same e4m3 weight: blockwise scales if accepted and right, else rowwise."""

    def __init__(self, values: torch.Tensor, scale_inv: torch.Tensor) -> None:
        from kernels.quant.fp8_blocks import FP8, FP8_MAX, dequantize_weight_blocks

        self.values, self.scale_inv = values, scale_inv
        real = dequantize_weight_blocks(values, scale_inv, BLOCK)
        row_scale = real.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        self.row_values = (real / row_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        self.row_scale = row_scale.T.contiguous()  # [1, N]
        # The 128x128 scales as mat_b's [K / 128, N / 128], in the layouts tried: a transposed view, contiguous.
        self.blockwise_scales_b = (scale_inv.T, scale_inv.T.contiguous())
        self.blockwise_error: str | None = None  # why the last blockwise attempt failed

    def rowwise(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from kernels.quant.fp8_blocks import FP8, FP8_MAX

        scale = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale

    def call(self, x: torch.Tensor, reference: torch.Tensor) -> tuple[Callable[[], torch.Tensor], str]:
        """(a no-argument callable computing x @ W.T with x already quantized, its scaling):
        blockwise where torch takes it and agrees with our reference, else rowwise."""
        from kernels.quant.fp8_blocks import quantize_activation_groups

        x_values, x_scales = quantize_activation_groups(x, BLOCK[1])
        x_scales = x_scales.T.contiguous().T  # outer-dim-major, as cuBLAS reads 1x128 scales
        weight = self.values.T
        for index, scale_b in enumerate(self.blockwise_scales_b):
            run = partial(torch._scaled_mm, x_values, weight, x_scales, scale_b, out_dtype=torch.bfloat16)
            try:
                out = run()
            except (RuntimeError, ValueError, TypeError) as error:  # refusals vary by torch version
                self.blockwise_error = str(error).splitlines()[0][:200]
                continue
            if relative_error(out, reference) < PEER_AGREEMENT:
                return run, "blockwise_1x128_128x128"
            self.blockwise_error = f"scale_b layout {index} ran but disagreed with the reference"
        x_values, x_scale = self.rowwise(x)
        weight = self.row_values.T
        run = partial(torch._scaled_mm, x_values, weight, x_scale, self.row_scale, out_dtype=torch.bfloat16)
        return run, "rowwise_per_token_per_channel"


def sweep_configs(m: int) -> list:
    """Tile configs worth trying at M rows, for tuning CONFIGS (and the GEMV's at a few rows)."""
    from kernels.quant.fp8_gemm import GemmConfig
    from kernels.quant.fp8_gemv import GemvConfig

    if m <= GEMV_MAX_M:
        return [
            GemvConfig(block_n, groups_per_step, warps)
            for block_n in (4, 8, 16, 32)
            for groups_per_step in (2, 4, 8, 16)
            for warps in (4, 8)
            if block_n * groups_per_step * 128 <= 32768
        ]
    if m <= 16:
        return [
            GemmConfig(16, n, w, s, split_k=split)
            for n in (32, 64, 128)
            for w, s in ((4, 4), (4, 6), (8, 4))
            for split in (1, 2, 4, 8)
        ]
    if m <= 64:
        return [
            GemmConfig(bm, bn, 4, 4, prequantize=q) for bm in (32, 64) for bn in (32, 64, 128) for q in (False, True)
        ]
    if m <= 256:
        return [
            GemmConfig(64, 64, 4, 4, prequantize=True),
            GemmConfig(64, 128, 4, 4, prequantize=True),
            GemmConfig(64, 128, 4, 4),
            GemmConfig(64, 256, 8, 3, prequantize=True),
            GemmConfig(128, 128, 8, 3, prequantize=True),
        ]
    return [
        GemmConfig(128, 128, 8, 3, prequantize=True),
        GemmConfig(128, 128, 8, 4, prequantize=True),
        GemmConfig(128, 256, 8, 3, prequantize=True),
        GemmConfig(64, 256, 8, 3, prequantize=True),
        GemmConfig(128, 128, 8, 3),
    ]


def _config_row(config) -> list:
    from kernels.quant.fp8_gemv import GemvConfig

    if isinstance(config, GemvConfig):
        return ["gemv", config.block_n, config.groups_per_step, config.num_warps]
    return [config.block_m, config.block_n, config.num_warps, config.num_stages, config.split_k, config.prequantize]


def dispatched_config(m: int, n: int, k: int) -> list | str:
    """What w8a8_block_fp8_matmul runs at these sizes: the GEMM's config, or cuBLAS."""
    from kernels.quant.fp8_gemm import CUBLAS_MIN_M, gemm_config

    if m > CUBLAS_MIN_M:
        return "cublas_blockwise_if_offered"
    return _config_row(gemm_config(m, n, k, BLOCK[1]))


def _timed_with(x, values, scale_inv, config) -> Callable[[], torch.Tensor]:
    from kernels.quant.fp8_gemm import block_fp8_matmul_with
    from kernels.quant.fp8_gemv import GemvConfig, block_fp8_gemv_with

    if isinstance(config, GemvConfig):
        return partial(block_fp8_gemv_with, x, values, scale_inv, BLOCK, None, config)
    return partial(block_fp8_matmul_with, x, values, scale_inv, BLOCK, None, config)


def measure_shape(name: str, tokens: list[int], bandwidth: float | None, sweep: bool) -> tuple[list[dict], dict]:
    import triton
    import triton.testing

    from kernels.quant.fp8_blocks import quantize_weight_blocks, w8a8_block_matmul_reference
    from kernels.quant.fp8_gemm import gemm_config, w8a8_block_fp8_matmul
    from kernels.quant.fp8_gemv import block_fp8_gemv_with, gemv_config

    n, k = SHAPES[name]
    generator = torch.Generator("cuda").manual_seed(0)
    weight = (torch.randn(n, k, device="cuda", generator=generator) * k**-0.5).bfloat16()
    values, scale_inv = quantize_weight_blocks(weight, BLOCK)
    peer = ScaledMmPeer(values, scale_inv)

    def time_ms(run) -> float:
        return triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")

    rows = []
    for m in tokens:
        x = torch.randn(m, k, device="cuda", generator=generator).bfloat16()
        reference = w8a8_block_matmul_reference(x, values, scale_inv, BLOCK)
        ours = w8a8_block_fp8_matmul(x, values, scale_inv, BLOCK)
        scaled_mm, scaling = peer.call(x, reference)
        times = {
            "ours": time_ms(lambda: w8a8_block_fp8_matmul(x, values, scale_inv, BLOCK)),
            "bf16": time_ms(lambda: torch.matmul(x, weight.T)),
            "scaled_mm": time_ms(scaled_mm),
        }
        gemv = None
        if m <= GEMV_MAX_M:
            gemv = partial(block_fp8_gemv_with, x, values, scale_inv, BLOCK, None, gemv_config(m, n, k, BLOCK[1]))
            times["gemv"] = time_ms(gemv)
        config = gemm_config(m, n, k, BLOCK[1])
        flops = 2 * m * n * k
        activation_bytes = m * k * 2 + m * n * 2
        least_bytes = {
            "ours": n * k + scale_inv.numel() * 4 + activation_bytes,
            "bf16": n * k * 2 + activation_bytes,
            "scaled_mm": n * k + activation_bytes,
            "gemv": n * k + scale_inv.numel() * 4 + activation_bytes,
        }
        row = {
            "m": m,
            "scaled_mm_scaling": scaling,
            "config": dispatched_config(m, n, k),
            "ours_vs_reference_relative_error": round(relative_error(ours, reference), 6),
            "scaled_mm_vs_reference_relative_error": round(relative_error(scaled_mm(), reference), 6),
        }
        for op, ms in times.items():
            row[f"{op}_ms"] = round(ms, 4)
            row[f"{op}_tflops"] = round(flops / (ms / 1000) / 1e12, 1)
            if bandwidth is not None:
                row[f"{op}_memory_roofline_fraction"] = round(least_bytes[op] / bandwidth / (ms / 1000), 3)
        row["speedup_over_bf16"] = round(times["bf16"] / times["ours"], 3)
        row["speedup_over_scaled_mm"] = round(times["scaled_mm"] / times["ours"], 3)
        if gemv is not None:
            row["gemv_config"] = _config_row(gemv_config(m, n, k, BLOCK[1]))
            row["gemv_vs_reference_relative_error"] = round(relative_error(gemv(), reference), 6)
            row["gemv_speedup_over_bf16"] = round(times["bf16"] / times["gemv"], 3)
        if sweep:
            timed = {}
            for candidate in dict.fromkeys([config, *sweep_configs(m)]):  # the table's own first
                try:
                    timed[candidate] = time_ms(_timed_with(x, values, scale_inv, candidate))
                except triton.runtime.errors.OutOfResources:
                    continue
            best = min(timed, key=timed.get)
            row["sweep_best_config"] = _config_row(best)
            row["sweep_best_ms"] = round(timed[best], 4)
        rows.append(row)
    return rows, {"scaled_mm_blockwise_refusal": peer.blockwise_error}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.fp8_gemm needs a CUDA device (FP8 tensor cores: Hopper or newer)", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name()
    bandwidth = hbm_bandwidth(device_name)
    shapes = {}
    for name in args.shapes:
        rows, peer = measure_shape(name, args.tokens, bandwidth, args.sweep)
        shapes[name] = {"n": SHAPES[name][0], "k": SHAPES[name][1], **peer, "rows": rows}
    print(json.dumps({"benchmark": "fp8_gemm", "device": device_name, "torch": torch.__version__,
                      "hbm_tb_per_s": bandwidth and bandwidth / 1e12, "block": BLOCK, "shapes": shapes}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
