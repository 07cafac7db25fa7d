"""The W8A8 block-scaled FP8 product for a few rows (decode at small batch): x @ W.T as
kernels.quant.fp8_gemm computes it, without tensor cores.

At one row a tensor-core tile wastes 15 of its 16 rows, and the column blocks are too few to keep
every SM reading unless the K loop is split, which costs a float32 partial per split and a second
kernel to sum them. Here each program owns BLOCK_N output columns of one row and walks all of K,
GROUPS_PER_STEP groups of block_k channels a step: it loads that [BLOCK_N, GROUPS_PER_STEP, block_k]
e4m3 slab of the weight (the bytes in flight that keep HBM busy), quantizes the row's groups in
registers (`quantize_group`, the reference's arithmetic), and adds each group's float32 dot product
times the group's activation scale and the column's weight-tile scale. One launch, the output
written once in x's dtype, no host syncs (safe in a CUDA graph).

Rows are the grid's fastest dimension, so the programs of a column block for different rows run
together and read its weight slab once from HBM, the rest from L2.

On Hopper the kernel is launched with programmatic dependent launch (kernels.pdl): it starts while
the kernel that writes its input still runs and waits for it before its first load. Loading the
first weight slab before that wait, one step ahead of the loop, measured 20% slower on an H100 at
batch 1 (the loop-carried slab), so the wait comes first; PDL alone gained 1.7%.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.pdl import launch_options, pdl_prologue
from kernels.quant.fp8_activations import quantize_group


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int
    groups_per_step: int
    num_warps: int


# From bench.fp8_gemm --sweep on an H100 at the Llama-3.1-8B projections, one row: 8 warps each
# loading 64 weight bytes a step (16 KiB a program), column blocks of 16 narrowed to 8 until about
# three programs per multiprocessor (132) are in flight, were the fastest at three of four shapes and
# within 4% at the fourth (1.3-1.4x the first 4-warp, 8 KiB, 528-program choice at qkv and down).
MIN_PROGRAMS = 384
WIDEST_BLOCK_N = 16
NARROWEST_BLOCK_N = 4
NUM_WARPS = 8
SLAB_BYTES = 16384  # e4m3 weight bytes a program loads per step: 64 per thread


def gemv_config(m: int, n: int, k: int, block_k: int = 128) -> GemvConfig:
    """The config of an [m, k] x [k, n] call whose K groups are block_k wide."""
    block_n = WIDEST_BLOCK_N
    while block_n > NARROWEST_BLOCK_N and m * triton.cdiv(n, block_n) < MIN_PROGRAMS:
        block_n //= 2
    groups = triton.cdiv(k, block_k)
    groups_per_step = max(1, min(triton.next_power_of_2(groups), SLAB_BYTES // (block_n * block_k)))
    return GemvConfig(block_n=block_n, groups_per_step=groups_per_step, num_warps=NUM_WARPS)


def block_fp8_gemv_with(
    rows: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    config: GemvConfig,
) -> torch.Tensor:
    """[M, N] in rows' dtype: `rows` [M, K] (last dimension contiguous) @ W.T, inputs already checked
    by fp8_gemm.check_matmul_inputs."""
    m, k = rows.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=rows.dtype, device=rows.device)
    if m == 0 or n == 0:
        return out
    grid = (m * triton.cdiv(n, config.block_n),)
    _w8a8_gemv_kernel[grid](
        rows,
        weight,
        weight_scale_inv,
        bias,
        out,
        m,
        n,
        k,
        rows.stride(0),
        weight.stride(0),
        weight_scale_inv.stride(0),
        weight_scale_inv.stride(1),
        out.stride(0),
        SCALE_BLOCK_N=block[0],
        HAS_BIAS=bias is not None,
        BLOCK_N=config.block_n,
        GROUP=block[1],
        GROUPS_PER_STEP=config.groups_per_step,
        num_warps=config.num_warps,
        **launch_options(rows.device),
    )
    return out


@triton.jit
def _w8a8_gemv_kernel(
    x_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    x_row_stride,
    w_row_stride,
    scale_row_stride,
    scale_col_stride,
    out_row_stride,
    SCALE_BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS_PER_STEP: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)  # kernels.pdl: the kernel before writes the input, and may read what this one overwrites
    pid = tl.program_id(0)
    row = pid % M
    cols = (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    groups = tl.cdiv(K, GROUP)
    step_groups = tl.arange(0, GROUPS_PER_STEP)
    lanes = tl.arange(0, GROUP)
    x_row = x_ptr + row.to(tl.int64) * x_row_stride
    w_rows = w_ptr + cols.to(tl.int64)[:, None, None] * w_row_stride
    # A column block may straddle weight tiles: one scale row per column.
    scale_rows = w_scale_ptr + (cols // SCALE_BLOCK_N)[:, None] * scale_row_stride
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for first_group in range(0, groups, GROUPS_PER_STEP):
        group_ids = first_group + step_groups
        ks = group_ids[:, None] * GROUP + lanes[None, :]
        k_mask = ks < K
        x = tl.load(x_row + ks, mask=k_mask, other=0.0)
        x_values, x_scale = quantize_group(x)
        w = tl.load(w_rows + ks[None, :, :], mask=col_mask[:, None, None] & k_mask[None, :, :], other=0.0)
        products = tl.sum(w.to(tl.float32) * x_values.to(tl.float32)[None, :, :], axis=2)
        w_scale = tl.load(
            scale_rows + group_ids[None, :] * scale_col_stride,
            mask=col_mask[:, None] & (group_ids < groups)[None, :],
            other=0.0,
        )
        acc += tl.sum(products * (w_scale * x_scale[None, :]), axis=1)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * out_row_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)
