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

Up to GEMV_MAX_M rows the GEMV of kernels.quant.fp8_gemv runs instead (no tensor cores; faster at a
row or two). Otherwise two shapes of call, two ways (GemmConfig):
- decode (M up to 16): the weight streams once and the activation is a few rows, so quantizing them in
  every program's prologue costs nothing. Few rows make few column blocks, too few programs to keep
  every SM reading: the K loop is split over `split_k` programs per tile, each writing a float32
  partial that torch sums (in a fixed order, so results do not depend on timing);
- more rows: re-quantizing each activation tile in every column block's program costs as much ALU
  work as the tensor cores' own, so one pass quantizes the activation (the same arithmetic) and the
  GEMM loads e4m3 rows and their scales. Past CUBLAS_MIN_M rows (prefill) those go to torch's own
  blockwise FP8 GEMM (cuBLAS) where the installed torch offers it, faster there than this kernel.

No host syncs: grids and configs come from shapes only, so the op is safe to capture in a CUDA graph
(the one-time check of torch's blockwise GEMM happens outside graphs).
On CPU tensors it runs only under Triton's interpreter (TRITON_INTERPRET=1).
"""

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.quant.fp8_activations import quantize_activation, quantize_group
from kernels.quant.fp8_blocks import FP8, block_grid, check_block
from kernels.quant.fp8_gemv import block_fp8_gemv_with, gemv_config

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True, slots=True)
class GemmConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8  # row blocks that walk the column blocks together, sharing weight tiles in L2
    split_k: int = 1  # programs sharing one output tile's K groups, summed after
    prequantize: bool = False  # quantize the activation in a pass of its own, before the GEMM


# The first row whose M bound the call does not exceed, from bench.fp8_gemm --sweep on an H100 at the
# Llama-3.1-8B projections: decode streams the weight through 128-column blocks of 8 warps, splitting
# K; from 17 rows the activation is quantized once and 64-row wgmma tiles narrow their columns until
# the programs fill the device (the fastest at 64 rows by 1.3-2.6x over in-prologue quantization).
CONFIGS: tuple[tuple[int | None, GemmConfig], ...] = (
    (16, GemmConfig(block_m=16, block_n=128, num_warps=8, num_stages=4)),
    (256, GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=4, prequantize=True)),
    (None, GemmConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, prequantize=True)),
)
# Programs to keep in flight, two per multiprocessor of an H100 (132): a decode call splits its K
# loop until it has them; other calls narrow their column blocks.
MIN_PROGRAMS = 264
SPLIT_K_MAX_M = 16  # past it the float32 partials' bytes start to rival the weight's
NARROWEST_BLOCK_N = 32
# Up to this many rows the GEMV (kernels.quant.fp8_gemv) runs: on an H100 at the Llama-3.1-8B
# projections bench.fp8_gemm measured it 1.3-1.7x bf16 at one row, where this kernel's split-K tiles
# gave 0.8-1.3x (and torch's blockwise GEMM refuses one or two rows).
GEMV_MAX_M = 3
# Past this many rows torch._scaled_mm's blockwise FP8 GEMM (cuBLAS) runs where this torch offers it:
# on an H100 bench.fp8_gemm measured it 1.1-5x this kernel at 4 and 16 rows and 1.5-2x from 512 on.
CUBLAS_MIN_M = 3
CUBLAS_OUT_DTYPES = (torch.bfloat16, torch.float16)
CUBLAS_AGREEMENT = 1e-2  # relative, against this kernel: the two sum in other orders
# How mat_b's [K / 128, N / 128] scales may have to be laid out, per torch version: a transposed
# view of weight_scale_inv, or that transpose made contiguous.
_WEIGHT_SCALE_LAYOUTS = (lambda scale_inv: scale_inv.T, lambda scale_inv: scale_inv.T.contiguous())
_CUBLAS_SCALE_LAYOUT: dict[torch.device, int] = {}  # per device: the layout it takes, or -1 for none


def gemm_config(m: int, n: int, k: int, block_k: int = 128) -> GemmConfig:
    """The config of an [m, k] x [k, n] call whose K groups are block_k wide."""
    config = next(row for bound, row in CONFIGS if bound is None or m <= bound)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    if m <= SPLIT_K_MAX_M:
        groups = triton.cdiv(k, block_k)
        return dataclasses.replace(config, split_k=max(1, min(groups, triton.cdiv(MIN_PROGRAMS, max(tiles, 1)))))
    block_n = config.block_n
    while block_n > NARROWEST_BLOCK_N and triton.cdiv(m, config.block_m) * triton.cdiv(n, block_n) < MIN_PROGRAMS:
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
    n, k = weight.shape
    m = x.shape[:-1].numel()
    if 0 < m <= GEMV_MAX_M and n:
        config = gemv_config(m, n, k, block[1])
        return block_fp8_gemv_with(_rows(x, k), weight, weight_scale_inv, block, bias, config).reshape(*x.shape[:-1], n)
    if m > CUBLAS_MIN_M and _cublas_may_take(x, weight, block):
        values, scales = quantize_activation(_rows(x, k), block[1])
        out = _cublas_blockwise(values, scales, weight, weight_scale_inv, x.dtype)
        if out is not None:
            if bias is not None:
                out += bias.to(out.dtype)
            return out.reshape(*x.shape[:-1], n)
    return block_fp8_matmul_with(x, weight, weight_scale_inv, block, bias, gemm_config(m, n, k, block[1]))


def _cublas_may_take(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int]) -> bool:
    n, k = weight.shape
    return (
        x.is_cuda
        and block == (128, 128)
        and x.dtype in CUBLAS_OUT_DTYPES
        and n % 128 == k % 128 == 0
        and _CUBLAS_SCALE_LAYOUT.get(x.device, 0) >= 0
    )


def block_fp8_matmul_with(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    config: GemmConfig,
) -> torch.Tensor:
    """The Triton GEMM with a given tile config (the benchmark's sweep); inputs checked."""
    n, k = weight.shape
    rows = _rows(x, k)
    if rows.shape[0] == 0 or n == 0:
        return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    x_scales = None
    if config.prequantize:
        rows, x_scales = quantize_activation(rows, block[1])
    out = _triton_matmul(rows, x_scales, weight, weight_scale_inv, block, bias, config, x.dtype)
    return out.reshape(*x.shape[:-1], n)


def _rows(x: torch.Tensor, k: int) -> torch.Tensor:
    rows = x.reshape(-1, k)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _triton_matmul(
    rows: torch.Tensor,
    x_scales: torch.Tensor | None,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None,
    config: GemmConfig,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """[M, N] in out_dtype of `rows` [M, K]: activations, or e4m3 values with their `x_scales`."""
    m, k = rows.shape
    n = weight.shape[0]
    split_k = min(config.split_k, triton.cdiv(k, block[1]))
    if split_k > 1:
        out = torch.empty((split_k, m, n), dtype=torch.float32, device=rows.device)
    else:
        out = torch.empty((m, n), dtype=out_dtype, device=rows.device)
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
        x_scales.stride(1) if x_scales is not None else 0,
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
    if split_k == 1:
        return out
    summed = out.sum(dim=0)
    if bias is not None:
        summed += bias.float()
    return summed.to(out_dtype)


def _cublas_blockwise(
    values: torch.Tensor,
    scales: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor | None:
    """x @ W.T by torch._scaled_mm's blockwise FP8 GEMM (cuBLAS, 1 x 128 and 128 x 128 scales), or
    None where this torch does not offer it. The first call on a device finds the weight scales'
    layout it takes and checks its result against the Triton kernel's; a refusal or a disagreement
    sends that device's calls to the Triton kernel for good."""
    device = values.device
    layout = _CUBLAS_SCALE_LAYOUT.get(device)
    if layout is not None:
        if layout < 0:
            return None
        try:
            return _scaled_mm(values, scales, weight, weight_scale_inv, layout, out_dtype)
        except (RuntimeError, ValueError, TypeError):  # a shape it refuses: this call only runs ours
            return None
    if torch.cuda.is_current_stream_capturing():
        return None  # found out outside a graph, never inside one
    _CUBLAS_SCALE_LAYOUT[device] = -1
    ours = _triton_matmul(values, scales, weight, weight_scale_inv, (128, 128), None, CONFIGS[-1][1], out_dtype)
    for layout in range(len(_WEIGHT_SCALE_LAYOUTS)):
        try:
            out = _scaled_mm(values, scales, weight, weight_scale_inv, layout, out_dtype)
        except (RuntimeError, ValueError, TypeError):  # refusals vary by torch version
            continue
        if ((out.float() - ours.float()).norm() / ours.float().norm().clamp(min=1e-12)).item() < CUBLAS_AGREEMENT:
            _CUBLAS_SCALE_LAYOUT[device] = layout
            return out
    return None


def _scaled_mm(
    values: torch.Tensor,
    scales: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    layout: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    scale_b = _WEIGHT_SCALE_LAYOUTS[layout](weight_scale_inv)
    return torch._scaled_mm(values, weight.T, scales, scale_b, out_dtype=out_dtype)


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
    x_scale_group_stride,
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
            x_scale = tl.load(
                x_scale_ptr + rows.to(tl.int64) * x_scale_row_stride + group * x_scale_group_stride,
                mask=row_mask,
                other=0.0,
            )
        else:
            x_values, x_scale = quantize_group(x)
        acc += tl.dot(x_values, tl.trans(w)) * (x_scale[:, None] * w_scale[None, :])
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = (
        out_ptr + tl.program_id(1) * out_split_stride + rows.to(tl.int64)[:, None] * out_row_stride + cols[None, :]
    )
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
