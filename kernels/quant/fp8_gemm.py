"""W8A8 block-scaled FP8 GEMM in Triton: x @ W.T for an e4m3 weight stored with one float32 scale
per (block_n, block_k) tile (DeepSeek-V3's format, kernels.quant.fp8_blocks), the activation
quantized on the fly, one scale per token and group of block_k channels.

Each program computes a BLOCK_M x BLOCK_N tile of the output. Its K loop steps one group at a time
(BLOCK_K == block_k), so the activation tile it loads holds exactly one group of each of its rows:

1. load that tile in x's dtype, take each row's amax and quantize it to e4m3 in registers
   (`quantize_group`: fp8_blocks.quantize_activation_groups's arithmetic, value for value);
2. tl.dot the e4m3 tile by the weight's e4m3 tile into a fresh float32 product;
3. scale that product by the row's activation scale times the column's weight-tile scale and add it
   to the float32 accumulator.

Scaling and summing each block_k-deep product in float32 is also what keeps the sum accurate: the
tensor cores' FP8 accumulation keeps fewer bits than float32 (DeepSeek-V3 promotes its partial sums
every 128 channels for that reason).

Two shapes of call, two ways (GemmConfig):
- decode (M up to 16): the weight streams once and the activation is a few rows, so quantizing them in
  every program's prologue costs nothing. Few rows make few column blocks, too few programs to keep
  every SM reading: the K loop is split over `split_k` programs per tile, each writing a float32
  partial that torch sums (in a fixed order, so results do not depend on timing);
- prefill (M past PREQUANTIZE_MIN_M): re-quantizing each activation tile in every column block's
  program costs as much ALU work as the tensor cores' own, so one pass quantizes the activation
  (the same arithmetic) and the GEMM loads e4m3 rows and their scales.

No host syncs: grids and configs come from shapes only, so the op is safe to capture in a CUDA graph.
On CPU tensors it runs only under Triton's interpreter (TRITON_INTERPRET=1).
"""

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.quant.fp8_blocks import FP8, FP8_MAX, MIN_AMAX, block_grid, check_block

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FP8_MAX = tl.constexpr(FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)


@dataclass(frozen=True, slots=True)
class GemmConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # row blocks that walk the column blocks together, sharing weight tiles in L2
    split_k: int = 1  # programs sharing one output tile's K groups, summed after
    prequantize: bool = False  # quantize the activation in a pass of its own, before the GEMM


# The first row whose M bound the call does not exceed. Up to 64 rows the GEMM streams the weight
# (M * K activation bytes beside N * K weight bytes) and wants many programs in flight; beyond,
# wider tiles reuse each loaded tile more. Tuned with bench.fp8_gemm --sweep.
CONFIGS: tuple[tuple[int | None, GemmConfig], ...] = (
    (16, GemmConfig(block_m=16, block_n=64, num_warps=4, num_stages=4)),
    (64, GemmConfig(block_m=32, block_n=64, num_warps=4, num_stages=4)),
    (256, GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=4, prequantize=True)),
    (None, GemmConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, prequantize=True)),
)
# Programs to keep in flight, four per multiprocessor of an H100 (132): a decode call splits its K
# loop until it has them; other streaming calls narrow their column blocks.
MIN_PROGRAMS = 528
SPLIT_K_MAX_M = 16  # past it the float32 partials' bytes start to rival the weight's
STREAMING_MAX_BLOCK_M = 32
NARROWEST_STREAMING_BLOCK_N = 16
NARROWEST_WGMMA_BLOCK_N = 64
QUANTIZE_BLOCK_M = 16


def gemm_config(m: int, n: int, k: int, block_k: int = 128) -> GemmConfig:
    """The config of an [m, k] x [k, n] call whose K groups are block_k wide."""
    config = next(row for bound, row in CONFIGS if bound is None or m <= bound)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    if m <= SPLIT_K_MAX_M:
        groups = triton.cdiv(k, block_k)
        return dataclasses.replace(config, split_k=max(1, min(groups, triton.cdiv(MIN_PROGRAMS, max(tiles, 1)))))
    block_n = config.block_n
    narrowest = NARROWEST_STREAMING_BLOCK_N if config.block_m <= STREAMING_MAX_BLOCK_M else NARROWEST_WGMMA_BLOCK_N
    while block_n > narrowest and triton.cdiv(m, config.block_m) * triton.cdiv(n, block_n) < MIN_PROGRAMS // 2:
        block_n //= 2
    return dataclasses.replace(config, block_n=block_n)


def w8a8_block_fp8_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int] = (128, 128),
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """[..., N] in x's dtype: x [..., K] @ W.T for W = weight [N, K] (e4m3) times its tiles'
    weight_scale_inv [ceil(N / block_n), ceil(K / block_k)], x quantized per token and group of
    block_k channels (what fp8_blocks.w8a8_block_matmul_reference computes), plus bias [N]."""
    check_matmul_inputs(x, weight, weight_scale_inv, block, bias)
    m = x.shape[:-1].numel()
    return block_fp8_matmul_with(x, weight, weight_scale_inv, block, bias, gemm_config(m, *weight.shape, block[1]))


def block_fp8_matmul_with(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    config: GemmConfig,
) -> torch.Tensor:
    """The GEMM with a given tile config (the benchmark's sweep); inputs checked."""
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    if m == 0 or n == 0:
        return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    x_scales = None
    if config.prequantize:
        rows, x_scales = quantize_activation(rows, block[1])
    split_k = min(config.split_k, triton.cdiv(k, block[1]))
    if split_k > 1:
        out = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), split_k)
    _w8a8_block_kernel[grid](
        rows,
        x_scales,
        weight,
        weight_scale_inv,
        bias,
        out,
        m,
        n,
        k,
        rows.stride(0),
        x_scales.stride(0) if x_scales is not None else 0,
        weight.stride(0),
        weight_scale_inv.stride(0),
        weight_scale_inv.stride(1),
        out.stride(-2),
        out.stride(0) if split_k > 1 else 0,
        SCALE_BLOCK_N=block[0],
        HAS_BIAS=bias is not None and split_k == 1,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=block[1],
        GROUP_M=config.group_m,
        SPLIT_K=split_k,
        PREQUANTIZED=x_scales is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if split_k > 1:
        summed = out.sum(dim=0)
        if bias is not None:
            summed += bias.float()
        out = summed.to(x.dtype)
    return out.reshape(*x.shape[:-1], n)


def quantize_activation(rows: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values [M, K] and float32 scales [M, ceil(K / group)] of contiguous-row activations, as
    fp8_blocks.quantize_activation_groups computes them."""
    m, k = rows.shape
    groups = triton.cdiv(k, group)
    values = torch.empty((m, k), dtype=FP8, device=rows.device)
    scales = torch.empty((m, groups), dtype=torch.float32, device=rows.device)
    grid = (triton.cdiv(m, QUANTIZE_BLOCK_M), groups)
    _quantize_groups_kernel[grid](rows, values, scales, m, k, rows.stride(0), BLOCK_M=QUANTIZE_BLOCK_M, GROUP=group)
    return values, scales


def check_matmul_inputs(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
) -> None:
    check_block(block)
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if weight.dim() != 2 or weight.dtype != FP8:
        raise ValueError(f"weight must be a 2-D {FP8} [N, K], got {weight.dtype} of shape {tuple(weight.shape)}")
    n, k = weight.shape
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"x must be [..., {k}] to match weight [N, K], got shape {tuple(x.shape)}")
    if weight.stride(1) != 1:
        raise ValueError(f"weight's last dimension must be contiguous, got strides {weight.stride()}")
    grid = block_grid((n, k), block)
    if weight_scale_inv.dtype != torch.float32 or tuple(weight_scale_inv.shape) != grid:
        raise ValueError(
            f"weight_scale_inv must be float32 {grid} (one per {block} tile of weight {(n, k)}), "
            f"got {weight_scale_inv.dtype} of shape {tuple(weight_scale_inv.shape)}"
        )
    if bias is not None and (tuple(bias.shape) != (n,) or not bias.is_floating_point()):
        raise ValueError(f"bias must be a floating [{n}], got {bias.dtype} of shape {tuple(bias.shape)}")
    for name, tensor in (("weight", weight), ("weight_scale_inv", weight_scale_inv), ("bias", bias)):
        if tensor is not None and tensor.device != x.device:
            raise ValueError(f"{name} must be on {x.device} like x, got {tensor.device}")


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
    x_ptr, values_ptr, scales_ptr, M, K, x_row_stride, BLOCK_M: tl.constexpr, GROUP: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tl.program_id(1)
    ks = group * GROUP + tl.arange(0, GROUP)
    row_mask = rows < M
    mask = row_mask[:, None] & (ks < K)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_row_stride + ks[None, :], mask=mask, other=0.0)
    values, scale = quantize_group(x)
    tl.store(values_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :], values, mask=mask)
    tl.store(scales_ptr + rows.to(tl.int64) * tl.cdiv(K, GROUP) + group, scale, mask=row_mask)


@triton.jit
def _w8a8_block_kernel(
    x_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    x_row_stride,
    x_scale_row_stride,
    w_row_stride,
    scale_row_stride,
    scale_col_stride,
    out_row_stride,
    out_split_stride,
    SCALE_BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PREQUANTIZED: tl.constexpr,
):
    # GROUP_M row blocks take each column block in turn, so a weight tile is read from HBM once
    # per group rather than once per row block.
    pid = tl.program_id(0)
    row_blocks = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_row_block = pid // per_group * GROUP_M
    group_rows = tl.minimum(row_blocks - first_row_block, GROUP_M)
    row_block = first_row_block + (pid % per_group) % group_rows
    column_block = (pid % per_group) // group_rows
    # This program's share of the K groups (all of them without a split).
    groups = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(groups, SPLIT_K)
    first_group = tl.program_id(1) * per_split
    last_group = tl.minimum(first_group + per_split, groups)

    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = column_block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * w_row_stride
    # A column block may straddle weight tiles (BLOCK_N > block_n): one scale per column.
    scale_ptrs = w_scale_ptr + (cols // SCALE_BLOCK_N) * scale_row_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for group in range(first_group, last_group):
        ks = group * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptrs + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        w_scale = tl.load(scale_ptrs + group * scale_col_stride, mask=col_mask, other=0.0)
        if PREQUANTIZED:
            x_values = x
            x_scale = tl.load(x_scale_ptr + rows.to(tl.int64) * x_scale_row_stride + group, mask=row_mask, other=0.0)
        else:
            x_values, x_scale = quantize_group(x)
        acc += tl.dot(x_values, tl.trans(w)) * (x_scale[:, None] * w_scale[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = (
        out_ptr + tl.program_id(1) * out_split_stride + rows.to(tl.int64)[:, None] * out_row_stride + cols[None, :]
    )
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
