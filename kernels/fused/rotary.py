"""Rotary embedding of queries and keys fused with the paged KV-cache write, as a Triton kernel.

For token t at position p = positions[t], every head x (head_dim wide, halves x1 and x2) of
qk[t] is rotated in HF's rotate_half layout, in float32 and rounded to qk's dtype:

    out = x * cos[p] + cat(-x2, x1) * sin[p]

The first num_heads heads are queries, returned as a new contiguous [T, num_heads, head_dim]
tensor; the rest are keys, stored with v[t] at cache slot s = slot_mapping[t] (page s // page_size,
offset s % page_size of caches shaped [num_kv_heads, num_pages, page_size, head_dim]). A negative
slot marks a padding row: its queries are still computed, nothing of it reaches the caches.
Positions must be below the tables' length and slots below num_pages * page_size; neither is checked,
as that would need a host sync.

The model's eager path (workers/engine/layers/rotary.py) rotates in the input dtype with cos and sin
rounded to it, so in bfloat16 it differs from this by rounding; the reference here rotates in
float32 like the kernel.

An FP8 cache (uint8 rows of kernels.attention.fp8_kv, [num_kv_heads, num_pages, page_size,
row_bytes(head_dim)]) gets the rotated key, rounded to qk's dtype, and v quantized in the same kernel
(kernels.fused.fp8_rows, bytes equal to quantize_rows'): its programs hold a head as scale groups, each
value beside its rotation partner (a scale group may span both halves), where the other kernel holds
the two halves. That kernel is compiled without floating-point contraction (no fused multiply-adds),
so on CUDA too its rotation rounds as the reference's separate torch ops do: its queries, and the keys
it quantizes, are bitwise the reference's, which a scale (each group's largest magnitude / FP8_MAX)
needs to be the same bytes.

Grid: (T, num_heads + num_kv_heads), one program per (token, head); a key head's program also
copies that head's value. Launch-only wrapper (no host syncs, grid from shapes): safe to capture in a
CUDA graph once a first call has compiled the kernel.
"""

import torch
import triton
import triton.language as tl

from kernels.attention.fp8_kv import row_bytes, scale_group
from kernels.attention.paged import is_fp8
from kernels.fused.fp8_rows import group_tile, store_fp8_row
from kernels.pdl import launch_options, pdl_prologue

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def rotary_and_cache_write_reference(
    qk: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_heads: int,
) -> torch.Tensor:
    """The same in plain torch (its boolean indexing syncs with the host)."""
    x = qk.float()
    half = x.shape[-1] // 2
    angle_cos, angle_sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    rotated = (x * angle_cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * angle_sin).to(qk.dtype)
    q, k = rotated[:, :num_heads], rotated[:, num_heads:]
    kv_heads, _, _, head_dim = k_cache.shape
    real = slot_mapping >= 0
    slots = slot_mapping[real]
    k_cache.view(kv_heads, -1, head_dim)[:, slots] = k[real].transpose(0, 1)
    v_cache.view(kv_heads, -1, head_dim)[:, slots] = v[real].transpose(0, 1)
    return q.contiguous()


def rotary_and_cache_write(
    qk: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_heads: int,
) -> torch.Tensor:
    """Rotated queries [T, num_heads, head_dim]; rotated keys and v written to the caches.

    positions and slot_mapping hold one int64 entry per row of qk, -1 slots for padding rows."""
    _check_inputs(qk, v, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads)
    tokens, heads, head_dim = qk.shape
    q = torch.empty((tokens, num_heads, head_dim), dtype=qk.dtype, device=qk.device)
    half = head_dim // 2
    args = (
        qk, qk.stride(0), qk.stride(1),
        v, v.stride(0), v.stride(1),
        positions, cos, sin,
        k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        slot_mapping, q, num_heads, k_cache.shape[2],
    )  # fmt: skip
    if is_fp8(k_cache):
        group = scale_group(head_dim)
        _rotary_fp8_cache_kernel[(tokens, heads)](
            *args, HALF=half, GROUP=group, BLOCK_GROUPS=triton.next_power_of_2(head_dim // group),
            num_warps=1, enable_fp_fusion=False, **launch_options(qk.device),
        )  # fmt: skip
    else:
        _rotary_cache_kernel[(tokens, heads)](
            *args, HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1, **launch_options(qk.device)
        )
    return q


def _check_inputs(
    qk: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
) -> None:
    if qk.dim() != 3:
        raise ValueError(f"qk must be [tokens, heads, head_dim], got shape {tuple(qk.shape)}")
    tokens, heads, head_dim = qk.shape
    if not 0 < num_heads < heads:
        raise ValueError(f"num_heads {num_heads} leaves no query or no key heads among qk's {heads}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even to rotate halves, got {head_dim}")
    kv_heads = heads - num_heads
    if v.shape != (tokens, kv_heads, head_dim):
        raise ValueError(f"v must be {(tokens, kv_heads, head_dim)}, got {tuple(v.shape)}")
    fp8 = is_fp8(k_cache)
    row = row_bytes(head_dim) if fp8 else head_dim  # an FP8 row: head_dim e4m3 bytes, then its scales
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[0::3] != (kv_heads, row):
        raise ValueError(
            f"k/v caches must both be [{kv_heads}, pages, page_size, {row}], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    for name, index in (("positions", positions), ("slot_mapping", slot_mapping)):
        if index.shape != (tokens,) or index.dtype != torch.int64:
            raise ValueError(f"{name} must be int64 of shape {(tokens,)}, got {index.dtype} {tuple(index.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != head_dim or table.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 [positions, {head_dim}], got {table.dtype} {tuple(table.shape)}")
        if not table.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ in shape")
    if qk.dtype not in FLOAT_DTYPES:
        raise ValueError(f"qk must be float32, float16 or bfloat16, got {qk.dtype}")
    if v.dtype != qk.dtype:
        raise ValueError(f"v is {v.dtype}, qk is {qk.dtype}")
    cache_dtype = torch.uint8 if fp8 else qk.dtype
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype != cache_dtype:
            raise ValueError(f"{name} is {cache.dtype}, expected {cache_dtype} (qk is {qk.dtype})")
    others = {
        "v": v,
        "positions": positions,
        "cos": cos,
        "sin": sin,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "slot_mapping": slot_mapping,
    }
    for name, tensor in others.items():
        if tensor.device != qk.device:
            raise ValueError(f"{name} is on {tensor.device}, qk on {qk.device}")
    for name, tensor in (("qk", qk), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous, got strides {tensor.stride()}")


@triton.jit
def _rotary_cache_kernel(
    qk_ptr, qk_token_stride, qk_head_stride,
    v_ptr, v_token_stride, v_head_stride,
    positions_ptr, cos_ptr, sin_ptr,
    kc_ptr, kc_head_stride, kc_page_stride, kc_offset_stride,
    vc_ptr, vc_head_stride, vc_page_stride, vc_offset_stride,
    slot_ptr, q_ptr, num_heads, page_size,
    HALF: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)  # kernels.pdl
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    mask = d < HALF
    table_row = tl.load(positions_ptr + token) * (2 * HALF)
    cos1 = tl.load(cos_ptr + table_row + d, mask=mask)
    cos2 = tl.load(cos_ptr + table_row + HALF + d, mask=mask)
    sin1 = tl.load(sin_ptr + table_row + d, mask=mask)
    sin2 = tl.load(sin_ptr + table_row + HALF + d, mask=mask)
    src = qk_ptr + token * qk_token_stride + head * qk_head_stride
    x1 = tl.load(src + d, mask=mask).to(tl.float32)
    x2 = tl.load(src + HALF + d, mask=mask).to(tl.float32)
    out1 = (x1 * cos1 - x2 * sin1).to(q_ptr.dtype.element_ty)
    out2 = (x2 * cos2 + x1 * sin2).to(q_ptr.dtype.element_ty)
    if head < num_heads:
        dst = q_ptr + (token * num_heads + head) * (2 * HALF)
        tl.store(dst + d, out1, mask=mask)
        tl.store(dst + HALF + d, out2, mask=mask)
    else:
        kv_head = (head - num_heads).to(tl.int64)
        slot = tl.load(slot_ptr + token)
        write = mask & (slot >= 0)
        page, offset = slot // page_size, slot % page_size
        k_dst = kc_ptr + kv_head * kc_head_stride + page * kc_page_stride + offset * kc_offset_stride
        tl.store(k_dst + d, out1, mask=write)
        tl.store(k_dst + HALF + d, out2, mask=write)
        v_src = v_ptr + token * v_token_stride + kv_head * v_head_stride
        v_dst = vc_ptr + kv_head * vc_head_stride + page * vc_page_stride + offset * vc_offset_stride
        tl.store(v_dst + d, tl.load(v_src + d, mask=write), mask=write)
        tl.store(v_dst + HALF + d, tl.load(v_src + HALF + d, mask=write), mask=write)


@triton.jit
def _rotary_fp8_cache_kernel(
    qk_ptr, qk_token_stride, qk_head_stride,
    v_ptr, v_token_stride, v_head_stride,
    positions_ptr, cos_ptr, sin_ptr,
    kc_ptr, kc_head_stride, kc_page_stride, kc_offset_stride,
    vc_ptr, vc_head_stride, vc_page_stride, vc_offset_stride,
    slot_ptr, q_ptr, num_heads, page_size,
    HALF: tl.constexpr, GROUP: tl.constexpr, BLOCK_GROUPS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_prologue(PDL)  # kernels.pdl
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = group_tile(GROUP, BLOCK_GROUPS)
    mask = dims < 2 * HALF
    first = dims < HALF
    table_row = tl.load(positions_ptr + token) * (2 * HALF)
    angle_cos = tl.load(cos_ptr + table_row + dims, mask=mask)
    angle_sin = tl.load(sin_ptr + table_row + dims, mask=mask)
    src = qk_ptr + token * qk_token_stride + head * qk_head_stride
    x = tl.load(src + dims, mask=mask).to(tl.float32)
    partner = tl.load(src + tl.where(first, dims + HALF, dims - HALF), mask=mask).to(tl.float32)
    # The other kernel's expressions, per element: x1 * cos1 - x2 * sin1 and x2 * cos2 + x1 * sin2.
    rotated = tl.where(first, x * angle_cos - partner * angle_sin, x * angle_cos + partner * angle_sin)
    rotated = rotated.to(q_ptr.dtype.element_ty)
    if head < num_heads:
        tl.store(q_ptr + (token * num_heads + head) * (2 * HALF) + dims, rotated, mask=mask)
    else:
        slot = tl.load(slot_ptr + token)
        if slot >= 0:
            kv_head = (head - num_heads).to(tl.int64)
            page, offset = slot // page_size, slot % page_size
            k_row = kc_ptr + kv_head * kc_head_stride + page * kc_page_stride + offset * kc_offset_stride
            store_fp8_row(k_row, rotated.to(tl.float32), dims, 2 * HALF, GROUP, BLOCK_GROUPS)
            value = tl.load(v_ptr + token * v_token_stride + kv_head * v_head_stride + dims, mask=mask)
            v_row = vc_ptr + kv_head * vc_head_stride + page * vc_page_stride + offset * vc_offset_stride
            store_fp8_row(v_row, value.to(tl.float32), dims, 2 * HALF, GROUP, BLOCK_GROUPS)
