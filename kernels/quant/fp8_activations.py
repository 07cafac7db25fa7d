"""Activations quantized to e4m3 per token and group of channels, on the device: the arithmetic of
kernels.quant.fp8_blocks.quantize_activation_groups, value for value, as a Triton function the FP8
GEMM, GEMV and MoE kernels call on the tiles they load (`quantize_group`), and as a pass of its own
over a whole activation (`quantize_activation`).
"""

import torch
import triton
import triton.language as tl

from kernels.quant.fp8_blocks import FP8, FP8_MAX, MIN_AMAX

_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)
QUANTIZE_BLOCK_M = 16


def quantize_activation(rows: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values [M, K] and float32 scales [M, ceil(K / group)] of contiguous-row activations, as
    fp8_blocks.quantize_activation_groups computes them. The scales are a transposed view of a
    [groups, M] tensor (outer-dim-major, the layout cuBLAS reads 1 x 128 scales in)."""
    m, k = rows.shape
    groups = triton.cdiv(k, group)
    values = torch.empty((m, k), dtype=FP8, device=rows.device)
    scales = torch.empty((groups, m), dtype=torch.float32, device=rows.device).T
    grid = (triton.cdiv(m, QUANTIZE_BLOCK_M), groups)
    _quantize_groups_kernel[grid](
        rows,
        values,
        scales,
        m,
        k,
        rows.stride(0),
        scales.stride(0),
        scales.stride(1),
        BLOCK_M=QUANTIZE_BLOCK_M,
        GROUP=group,
    )
    return values, scales


@triton.jit
def quantize_group(x):
    """(e4m3 values, float32 scale per row) of a [rows, group] tile: the arithmetic of
    kernels.quant.fp8_blocks.quantize_activation_groups, so both give the same e4m3 values."""
    x = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), _MIN_AMAX)
    # Correctly rounded, as torch divides; one division per row.
    inverse = tl.math.div_rn(tl.full(amax.shape, _FP8_MAX, tl.float32), amax)
    values = tl.clamp(x * inverse[:, None], -_FP8_MAX, _FP8_MAX).to(tl.float8e4nv)
    return values, amax / _FP8_MAX


@triton.jit
def _quantize_groups_kernel(
    x_ptr,
    values_ptr,
    scales_ptr,
    M,
    K,
    x_row_stride,
    scale_row_stride,
    scale_group_stride,
    BLOCK_M: tl.constexpr,
    GROUP: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tl.program_id(1)
    ks = group * GROUP + tl.arange(0, GROUP)
    row_mask = rows < M
    mask = row_mask[:, None] & (ks < K)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_row_stride + ks[None, :], mask=mask, other=0.0)
    values, scale = quantize_group(x)
    tl.store(values_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], values, mask=mask)
    tl.store(scales_ptr + rows.to(tl.int64) * scale_row_stride + group * scale_group_stride, scale, mask=row_mask)
