"""Skinny GEMMs for decode-sized row counts with the layer's RMSNorm in their prologue, as Triton kernels.

For each row of x ([T, K]) the prologue forms, exactly as `fused_add_rms_norm` (norm.py) does,

    h      = round(x + residual)                                   (h = x when residual is None)
    normed = round(norm_weight * round(h * rsqrt(mean(h²) + eps)))  round: to x's dtype

and the GEMM accumulates y = normed @ W.T (+ bias) in float32. The epilogues:
- `add_rms_norm_linear`: out = round(y), optionally widened to float32 (logits) in the same store.
- `add_rms_norm_gate_up_silu`: W is the MLP's fused [gate; up] ([2I, K]); each program computes
  matching gate and up columns, g = round(y_gate), u = round(y_up), out = round(g / (1 + exp(-g)) * u),
  silu_and_mul's formula (activation.py) on the rounded projection.
- `add_rms_norm_qkv_rotary` (qkv_rotary.py) rotates q and k and writes the paged caches.

The inputs are not modified: every column block's program reads x and residual, so an in-place
update would race. `new_residual` (h) is a new tensor written by the programs of column block 0
only; with no residual it is x itself.

Grid: (cdiv(T, BLOCK_M), column blocks), row blocks fastest so the row blocks sharing a weight tile
run together and read it once from DRAM. A program makes two passes over K: the first sums h² (and
writes h), the second normalizes each chunk and multiplies it by the weight tile. Every column
block re-reads its rows of x and residual (from L2): small next to W at a few rows, growing with
the row count, which the model bounds (FUSED_LINEAR_MAX_ROWS). K (the hidden size) is a
compile-time constant, so the first pass unrolls and its loads issue together.

Block shapes come from BLOCKS, a table keyed by row count (INTERPRETER_BLOCKS on the CPU): BLOCK_M
is at least 16, tl.dot's smallest tile; columns per program are chosen so that a single decode row
still spreads over many SMs. BLOCK_K is 64 in every bucket, so a row's sum of squares is the same
whatever the batch. float32 operands multiply with input_precision "ieee" (fp32 FMAs), so float32
stays near-exact.

Launch-only wrappers (no host syncs, grid from shapes): safe to capture in a CUDA graph once a first
call has compiled the kernel.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.fused.norm import rms_norm_reference

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# float32 operands of tl.dot: exact float32 products (CUDA cores); bf16/fp16 operands ignore it.
DOT_PRECISION = tl.constexpr("ieee")


class Blocks(NamedTuple):
    block_m: int  # rows per program, >= 16 (tl.dot's smallest tile)
    block_n: int  # output columns per program and accumulator (qkv: of the heads' first halves)
    block_k: int
    num_warps: int
    num_stages: int


# Per kernel, (most rows, blocks) from small to large; row counts past the last use the last.
# Not yet timed on a GPU: chosen for SmolLM2-135M (K 576; N 960 qkv, 2 x 1536 gate_up, 49152
# lm_head) on 132 SMs from sm_90 builds (ptxas: none spills in bf16) and this reasoning: a decode row
# is bound by streaming W, so at few rows narrow column blocks put more SMs on it (gate_up 192
# programs, qkv 60 at one row); every program re-reads its rows of x and residual twice from L2, so
# past 16 rows wider blocks cut that redundant traffic. Retune from bench/fused_layer.py --sweep.
BLOCKS: dict[str, tuple[tuple[int, Blocks], ...]] = {
    "linear": (
        (16, Blocks(16, 64, 64, 4, 4)),
        (32, Blocks(32, 64, 64, 4, 4)),
        (64, Blocks(64, 64, 64, 4, 3)),
        (256, Blocks(64, 128, 64, 8, 3)),
    ),
    "gate_up": (
        (4, Blocks(16, 8, 64, 4, 4)),
        (16, Blocks(16, 16, 64, 4, 4)),
        (64, Blocks(32, 16, 64, 4, 4)),
        (256, Blocks(64, 32, 64, 4, 3)),
    ),
    "qkv": (
        (16, Blocks(16, 8, 64, 4, 4)),
        (64, Blocks(32, 8, 64, 4, 4)),
        (256, Blocks(64, 16, 64, 4, 3)),
    ),
}


# On the CPU the kernels run in Triton's interpreter, one program after another in Python, where each
# program costs milliseconds and tl.dot's cost grows with the tile: few wide programs of 16 rows
# (a decode step's rows; a prefill takes a few row blocks).
INTERPRETER_BLOCKS: dict[str, tuple[tuple[int, Blocks], ...]] = {
    kernel: ((1 << 30, Blocks(16, 128, 64, 4, 1)),) for kernel in ("linear", "gate_up", "qkv")
}


def blocks_for(kernel: str, rows: int, device: torch.device) -> Blocks:
    table = (BLOCKS if device.type == "cuda" else INTERPRETER_BLOCKS)[kernel]
    return next((blocks for most, blocks in table if rows <= most), table[-1][1])


# References: plain torch, float32 products rounded once, as the kernels compute.


def normed_reference(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(h), h) with h = x + residual rounded to x's dtype (x itself without a residual)."""
    summed = x if residual is None else x + residual
    return rms_norm_reference(summed, norm_weight, eps), summed


def matmul_reference(normed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """normed @ weight.T (+ bias) in float32, rounded once to normed's dtype."""
    out = normed.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(normed.dtype)


def add_rms_norm_linear_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    normed, summed = normed_reference(x, residual, norm_weight, eps)
    return matmul_reference(normed, weight, bias).to(out_dtype or x.dtype), summed


def add_rms_norm_gate_up_silu_reference(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    normed, summed = normed_reference(x, residual, norm_weight, eps)
    gate, up = matmul_reference(normed, gate_up_weight).float().chunk(2, dim=-1)
    return (gate / (1.0 + torch.exp(-gate)) * up).to(x.dtype), summed


# Wrappers.


def add_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) @ weight.T + bias, x + residual): out [T, N] in out_dtype (x's dtype if
    None; float32 holds exactly the x-dtype values widened), new_residual [T, K].

    x and residual: [T, K], rows may be strided; weight [N, K] and bias [N] in x's dtype."""
    check_prologue(x, residual, norm_weight)
    check_weight("weight", weight, x)
    if bias is not None:
        check_vector("bias", bias, weight.shape[0], x)
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"out_dtype must be x's dtype {x.dtype} or torch.float32, got {out_dtype}")
    tokens, hidden = x.shape
    out = torch.empty((tokens, weight.shape[0]), dtype=out_dtype or x.dtype, device=x.device)
    new_residual = new_residual_like(x, residual)
    if tokens == 0:
        return out, new_residual
    blocks = blocks_for("linear", tokens, x.device)
    grid = (triton.cdiv(tokens, blocks.block_m), triton.cdiv(weight.shape[0], blocks.block_n))
    _linear_kernel[grid](
        x, x.stride(0), *residual_args(residual, new_residual), norm_weight, eps,
        weight, weight.stride(0), bias if bias is not None else weight, out, tokens, weight.shape[0],
        K=hidden, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k,
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
    )  # fmt: skip
    return out, new_residual


def add_rms_norm_gate_up_silu(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate) * up of RMSNorm(x + residual) @ gate_up_weight.T, x + residual): out [T, I].

    gate_up_weight: [2I, K] in x's dtype, the gate rows first and the up rows last."""
    check_prologue(x, residual, norm_weight)
    check_weight("gate_up_weight", gate_up_weight, x)
    if gate_up_weight.shape[0] % 2:
        raise ValueError(f"gate_up_weight must have 2 * intermediate rows, got {gate_up_weight.shape[0]}")
    tokens, hidden = x.shape
    intermediate = gate_up_weight.shape[0] // 2
    out = torch.empty((tokens, intermediate), dtype=x.dtype, device=x.device)
    new_residual = new_residual_like(x, residual)
    if tokens == 0:
        return out, new_residual
    blocks = blocks_for("gate_up", tokens, x.device)
    grid = (triton.cdiv(tokens, blocks.block_m), triton.cdiv(intermediate, blocks.block_n))
    _gate_up_silu_kernel[grid](
        x, x.stride(0), *residual_args(residual, new_residual), norm_weight, eps,
        gate_up_weight, gate_up_weight.stride(0), out, tokens, intermediate,
        K=hidden, HAS_RESIDUAL=residual is not None,
        BLOCK_M=blocks.block_m, BLOCK_N=blocks.block_n, BLOCK_K=blocks.block_k,
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
    )  # fmt: skip
    return out, new_residual


# Checks and arguments shared with qkv_rotary.py.


def check_prologue(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"x's last dimension must be contiguous, got strides {x.stride()}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
            raise ValueError(
                f"residual is {tuple(residual.shape)} {residual.dtype} on {residual.device}, "
                f"x is {tuple(x.shape)} {x.dtype} on {x.device}"
            )
        if residual.stride(1) != 1:
            raise ValueError(f"residual's last dimension must be contiguous, got strides {residual.stride()}")
    if norm_weight.shape != x.shape[1:]:
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} does not match hidden size {x.shape[1]}")
    if norm_weight.dtype not in (torch.float32, x.dtype):
        raise ValueError(f"norm_weight must be float32 or x's dtype {x.dtype}, got {norm_weight.dtype}")
    if norm_weight.device != x.device:
        raise ValueError(f"norm_weight is on {norm_weight.device}, x on {x.device}")
    if norm_weight.stride(0) != 1:
        raise ValueError(f"norm_weight must be contiguous, got stride {norm_weight.stride()}")


def check_weight(name: str, weight: torch.Tensor, x: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"{name} must be [out_features, {x.shape[1]}], got shape {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"{name} is {weight.dtype}, x is {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"{name} is on {weight.device}, x on {x.device}")
    if weight.stride(1) != 1:
        raise ValueError(f"{name}'s last dimension must be contiguous, got strides {weight.stride()}")


def check_vector(name: str, vector: torch.Tensor, size: int, x: torch.Tensor) -> None:
    if vector.shape != (size,) or vector.dtype != x.dtype or vector.device != x.device:
        raise ValueError(
            f"{name} must be [{size}] {x.dtype} on {x.device}, "
            f"got {tuple(vector.shape)} {vector.dtype} on {vector.device}"
        )
    if vector.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {vector.stride()}")


def new_residual_like(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return x if residual is None else torch.empty(x.shape, dtype=x.dtype, device=x.device)


def residual_args(residual: torch.Tensor | None, new_residual: torch.Tensor) -> tuple:
    """(residual, its row stride, new_residual) kernel arguments; without a residual the pointers are
    unused placeholders (HAS_RESIDUAL is off)."""
    if residual is None:
        return new_residual, 0, new_residual
    return residual, residual.stride(0), new_residual


# Kernels and the prologue they share.


@triton.jit
def summed_chunk(x_ptr, stride_x, res_ptr, stride_r, rows, cols, mask, HAS_RESIDUAL: tl.constexpr):
    """h = round(x + residual) for rows x cols, in x's dtype (0 where masked)."""
    h = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(res_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        h = (h.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return h


@triton.jit
def row_rstd(
    x_ptr, stride_x, res_ptr, stride_r, new_res_ptr, eps, rows, row_ok, owns_residual,
    K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """rsqrt(mean(h²) + eps) per row (float32); the owning program also stores h into new_res."""
    squares = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    for start in tl.static_range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]
        h = summed_chunk(x_ptr, stride_x, res_ptr, stride_r, rows, cols, mask, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(new_res_ptr + rows[:, None] * K + cols[None, :], h, mask=mask & owns_residual)
        h = h.to(tl.float32)
        squares += h * h
    return tl.rsqrt(tl.sum(squares, axis=1) / K + eps)


@triton.jit
def normed_chunk(
    x_ptr, stride_x, res_ptr, stride_r, nw_ptr, rstd, rows, row_ok, start,
    K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """round(norm_weight * round(h * rstd)) for columns [start, start + BLOCK_K): _scaled_norm's formula."""
    cols = start + tl.arange(0, BLOCK_K)
    col_ok = cols < K
    h = summed_chunk(x_ptr, stride_x, res_ptr, stride_r, rows, cols, row_ok[:, None] & col_ok[None, :], HAS_RESIDUAL)
    dtype = x_ptr.dtype.element_ty
    normed = (h.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32)
    weight = tl.load(nw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    return (weight[None, :] * normed).to(dtype)


@triton.jit
def weight_columns(w_ptr, stride_w, out_cols):
    """Pointers to W[out_cols, 0] as a [1, len(out_cols)] block: add k[:, None] for a [k, cols] tile."""
    return w_ptr + out_cols.to(tl.int64)[None, :] * stride_w


@triton.jit
def _linear_kernel(
    x_ptr, stride_x, res_ptr, stride_r, new_res_ptr, nw_ptr, eps,
    w_ptr, stride_w, bias_ptr, out_ptr, T, N,
    K: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    rstd = row_rstd(
        x_ptr, stride_x, res_ptr, stride_r, new_res_ptr, eps, rows, row_ok, pid_n == 0,
        K, HAS_RESIDUAL, BLOCK_M, BLOCK_K,
    )  # fmt: skip
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_cols = weight_columns(w_ptr, stride_w, cols)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, K, BLOCK_K):
        a = normed_chunk(
            x_ptr, stride_x, res_ptr, stride_r, nw_ptr, rstd, rows, row_ok, start, K, HAS_RESIDUAL, BLOCK_K
        )
        k = start + tl.arange(0, BLOCK_K)[:, None]
        w = tl.load(w_cols + k, mask=(k < K) & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = acc.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out_ptrs, out, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gate_up_silu_kernel(
    x_ptr, stride_x, res_ptr, stride_r, new_res_ptr, nw_ptr, eps,
    w_ptr, stride_w, out_ptr, T, intermediate,
    K: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    rstd = row_rstd(
        x_ptr, stride_x, res_ptr, stride_r, new_res_ptr, eps, rows, row_ok, pid_n == 0,
        K, HAS_RESIDUAL, BLOCK_M, BLOCK_K,
    )  # fmt: skip
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < intermediate
    gate_cols = weight_columns(w_ptr, stride_w, cols)
    up_cols = weight_columns(w_ptr, stride_w, cols + intermediate)
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(0, K, BLOCK_K):
        a = normed_chunk(
            x_ptr, stride_x, res_ptr, stride_r, nw_ptr, rstd, rows, row_ok, start, K, HAS_RESIDUAL, BLOCK_K
        )
        k = start + tl.arange(0, BLOCK_K)[:, None]
        mask = (k < K) & col_ok[None, :]
        w_gate = tl.load(gate_cols + k, mask=mask, other=0.0)
        w_up = tl.load(up_cols + k, mask=mask, other=0.0)
        gate = tl.dot(a, w_gate, gate, input_precision=DOT_PRECISION)
        up = tl.dot(a, w_up, up, input_precision=DOT_PRECISION)
    dtype = x_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    out = (gate / (1.0 + tl.exp(-gate)) * up).to(dtype)
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * intermediate + cols[None, :]
    tl.store(out_ptrs, out, mask=row_ok[:, None] & col_ok[None, :])
