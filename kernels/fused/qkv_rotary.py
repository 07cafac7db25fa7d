"""The attention block's first kernel: residual add and RMSNorm, the fused QKV projection, the rotary
embedding and the paged KV-cache write, as one Triton kernel for decode-sized row counts.

The prologue and GEMM are linear.py's: qkv = round(RMSNorm(x + residual) @ W.T + bias) in x's
dtype, W the attention's fused [q; k; v] projection ([(H + 2 KV) * D, K]). The epilogue is
rotary.py's, on those rounded values: every q and k head (halves x1, x2) is rotated in HF's
rotate_half layout in float32 and rounded,

    out = x * cos[p] + cat(-x2, x1) * sin[p]        p = positions[t]

q is returned as a new contiguous [T, H, D] tensor; k and v (not rotated) are stored at cache slot
s = slot_mapping[t] (page s // page_size, offset s % page_size of caches shaped
[KV, pages, page_size, D]); a negative slot (a padding row) writes nothing. Positions must be
below the tables' length and slots below pages * page_size; neither is checked (a host sync).

A program computes BLOCK_D matching columns of both halves of the heads as two accumulators, so the
rotation needs nothing from another program: the columns run over the heads' first halves
(H + 2 KV heads of head_dim / 2), the second accumulator holds the same columns head_dim / 2 further
on. A BLOCK_D below head_dim / 2 splits a head over several programs, spreading a decode row over
more SMs; a multiple of it holds whole heads, which re-read x less (each program reads its rows).
Every column knows its head, so a tile may mix q, k and v heads.
Per-head q/k RMSNorm (Qwen3's qk_norm) would need a whole head's sum of squares before the
rotation; it is refused, and the model falls back to the unfused path for it.

Grid: (cdiv(T, BLOCK_M), cdiv((H + 2 KV) * head_dim / 2, BLOCK_D)); new_residual is written by the
column-0 programs (see linear.py). Launch-only wrapper (no host syncs, grid from shapes): safe to
capture in a CUDA graph once a first call has compiled the kernel.
"""

import torch
import triton
import triton.language as tl

from kernels.fused.linear import (
    DOT_PRECISION,
    blocks_for,
    check_prologue,
    check_vector,
    check_weight,
    matmul_reference,
    new_residual_like,
    normed_chunk,
    normed_reference,
    residual_args,
    row_rstd,
    weight_columns,
)
from kernels.fused.rotary import rotary_and_cache_write_reference


def add_rms_norm_qkv_rotary_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in plain torch; writes the caches (its boolean indexing syncs with the host)."""
    normed, summed = normed_reference(x, residual, norm_weight, eps)
    head_dim = k_cache.shape[-1]
    qkv = matmul_reference(normed, qkv_weight, qkv_bias).view(x.shape[0], num_heads + 2 * num_kv_heads, head_dim)
    qk, v = qkv[:, : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads :]
    q = rotary_and_cache_write_reference(
        qk, v, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads=num_heads
    )
    return q, summed


def add_rms_norm_qkv_rotary(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    qk_norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotated q [T, num_heads, head_dim], x + residual); rotated k and v written to the caches.

    positions and slot_mapping: [T] int64, -1 slots for padding rows; cos, sin: float32
    [positions, head_dim]; qk_norm: whether the model normalizes q and k heads (refused)."""
    if qk_norm:
        raise ValueError("per-head q/k RMSNorm (qk_norm) is not fused: use the unfused qkv projection and rotary")
    check_prologue(x, residual, norm_weight)
    check_weight("qkv_weight", qkv_weight, x)
    _check_heads(qkv_weight, qkv_bias, k_cache, v_cache, x, num_heads, num_kv_heads)
    _check_rotary(x, positions, cos, sin, slot_mapping, k_cache.shape[-1])
    tokens, hidden = x.shape
    head_dim = k_cache.shape[-1]
    q = torch.empty((tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    new_residual = new_residual_like(x, residual)
    if tokens == 0:
        return q, new_residual
    blocks = blocks_for("qkv", tokens, x.device)
    half_columns = (num_heads + 2 * num_kv_heads) * head_dim // 2
    grid = (triton.cdiv(tokens, blocks.block_m), triton.cdiv(half_columns, blocks.block_n))
    _qkv_rotary_kernel[grid](
        x, x.stride(0), *residual_args(residual, new_residual), norm_weight, eps,
        qkv_weight, qkv_weight.stride(0), qkv_bias if qkv_bias is not None else qkv_weight, tokens,
        positions, cos, sin, slot_mapping, q,
        k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_cache.shape[2],
        K=hidden, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2,
        HAS_RESIDUAL=residual is not None, HAS_BIAS=qkv_bias is not None,
        BLOCK_M=blocks.block_m, BLOCK_D=blocks.block_n, BLOCK_K=blocks.block_k,
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
    )  # fmt: skip
    return q, new_residual


def _check_heads(
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    x: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a positive multiple of num_kv_heads {num_kv_heads}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[0] != num_kv_heads:
        raise ValueError(
            f"k/v caches must both be [{num_kv_heads}, pages, page_size, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    head_dim = k_cache.shape[-1]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 (tiles split halves evenly), got {head_dim}")
    rows = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv_weight.shape[0] != rows:
        raise ValueError(
            f"qkv_weight has {qkv_weight.shape[0]} rows, "
            f"({num_heads} + 2 * {num_kv_heads}) heads of {head_dim} are {rows}"
        )
    if qkv_bias is not None:
        check_vector("qkv_bias", qkv_bias, rows, x)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype != x.dtype or cache.device != x.device:
            raise ValueError(f"{name} is {cache.dtype} on {cache.device}, x is {x.dtype} on {x.device}")
        if cache.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous, got strides {cache.stride()}")


def _check_rotary(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    head_dim: int,
) -> None:
    tokens = x.shape[0]
    for name, index in (("positions", positions), ("slot_mapping", slot_mapping)):
        if index.shape != (tokens,) or index.dtype != torch.int64:
            raise ValueError(f"{name} must be int64 of shape {(tokens,)}, got {index.dtype} {tuple(index.shape)}")
        if index.stride(0) != 1 and tokens > 1:
            raise ValueError(f"{name} must be contiguous, got stride {index.stride()}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != head_dim or table.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 [positions, {head_dim}], got {table.dtype} {tuple(table.shape)}")
        if not table.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ in shape")
    for name, tensor in (("positions", positions), ("slot_mapping", slot_mapping), ("cos", cos), ("sin", sin)):
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device}, x on {x.device}")


@triton.jit
def _qkv_rotary_kernel(
    x_ptr, stride_x, res_ptr, stride_r, new_res_ptr, nw_ptr, eps,
    w_ptr, stride_w, bias_ptr, T,
    positions_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr,
    kc_ptr, kc_head_stride, kc_page_stride, kc_offset_stride,
    vc_ptr, vc_head_stride, vc_page_stride, vc_offset_stride, page_size,
    K: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    rstd = row_rstd(
        x_ptr, stride_x, res_ptr, stride_r, new_res_ptr, eps, rows, row_ok, pid_n == 0,
        K, HAS_RESIDUAL, BLOCK_M, BLOCK_K,
    )  # fmt: skip
    j = pid_n * BLOCK_D + tl.arange(0, BLOCK_D)  # over the heads' first halves
    head = j // HALF
    d = j % HALF
    col_ok = head < NUM_HEADS + 2 * NUM_KV_HEADS
    cols1 = head * (2 * HALF) + d
    cols2 = cols1 + HALF
    w1_cols = weight_columns(w_ptr, stride_w, cols1)
    w2_cols = weight_columns(w_ptr, stride_w, cols2)
    acc1 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(0, K, BLOCK_K):
        a = normed_chunk(
            x_ptr, stride_x, res_ptr, stride_r, nw_ptr, rstd, rows, row_ok, start, K, HAS_RESIDUAL, BLOCK_K
        )
        k = start + tl.arange(0, BLOCK_K)[:, None]
        mask = (k < K) & col_ok[None, :]
        w1 = tl.load(w1_cols + k, mask=mask, other=0.0)
        w2 = tl.load(w2_cols + k, mask=mask, other=0.0)
        acc1 = tl.dot(a, w1, acc1, input_precision=DOT_PRECISION)
        acc2 = tl.dot(a, w2, acc2, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc1 += tl.load(bias_ptr + cols1, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc2 += tl.load(bias_ptr + cols2, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dtype = x_ptr.dtype.element_ty
    x1 = acc1.to(dtype).to(tl.float32)
    x2 = acc2.to(dtype).to(tl.float32)

    table = tl.load(positions_ptr + rows, mask=row_ok, other=0)[:, None] * (2 * HALF) + d[None, :]
    rotate = (head < NUM_HEADS + NUM_KV_HEADS)[None, :]  # q and k heads; v is stored as projected
    out1 = tl.where(rotate, x1 * tl.load(cos_ptr + table) - x2 * tl.load(sin_ptr + table), x1).to(dtype)
    out2 = tl.where(rotate, x2 * tl.load(cos_ptr + table + HALF) + x1 * tl.load(sin_ptr + table + HALF), x2).to(dtype)

    is_q = (head < NUM_HEADS)[None, :]
    q_dst = q_ptr + rows.to(tl.int64)[:, None] * (NUM_HEADS * 2 * HALF) + (head * (2 * HALF) + d)[None, :]
    tl.store(q_dst, out1, mask=row_ok[:, None] & is_q)
    tl.store(q_dst + HALF, out2, mask=row_ok[:, None] & is_q)
    slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1)
    write = (slot >= 0)[:, None]
    page, offset = (slot // page_size)[:, None], (slot % page_size)[:, None]
    k_head = (head - NUM_HEADS).to(tl.int64)[None, :]  # out of range where masked off
    k_dst = kc_ptr + k_head * kc_head_stride + page * kc_page_stride + offset * kc_offset_stride + d[None, :]
    k_write = write & ~is_q & rotate
    tl.store(k_dst, out1, mask=k_write)
    tl.store(k_dst + HALF, out2, mask=k_write)
    v_head = k_head - NUM_KV_HEADS
    v_dst = vc_ptr + v_head * vc_head_stride + page * vc_page_stride + offset * vc_offset_stride + d[None, :]
    v_write = write & ~rotate & col_ok[None, :]
    tl.store(v_dst, out1, mask=v_write)
    tl.store(v_dst + HALF, out2, mask=v_write)
