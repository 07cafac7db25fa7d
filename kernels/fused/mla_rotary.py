"""Multi-head latent attention's rotary embedding fused with its latent-cache write, as a Triton kernel.

For token t at position p = positions[t], the rope parts (R wide) of its H query heads and of its
one shared key are rotated in float32 and rounded to their dtype; pair i turns by frequency i, whose
angle is cos[p, i] / sin[p, i] (the tables are RotaryEmbedding's: [max_pos, R], the R/2 frequencies
repeated twice). Pair i is (x[i], x[i + R/2]) when interleave is False (HF's rotate_half layout)
and (x[2i], x[2i + 1]) when it is True (DeepSeek's). Either way the rotated vector is written in
halves, [x1 * cos - x2 * sin, x2 * cos + x1 * sin], as HF's apply_rotary_pos_emb_interleave returns
it: queries and keys share the layout, so their dot products are those of the pairwise rotation.

The queries are rotated in place (q_rope is usually a strided view into the full query); the key is
not written back to k_rope: [compressed[t], rotated key] goes to cache slot s = slot_mapping[t]
(page s // page_size, offset s % page_size of the latent cache [1, pages, page_size, C + R]). A
negative slot marks a padding row: its queries are still rotated, nothing of it reaches the cache.
Positions must be below the tables' length and slots below pages * page_size; neither is checked,
as that would need a host sync.

An FP8 latent cache (uint8 rows of kernels.attention.fp8_kv, [1, pages, page_size, row_bytes(C + R)])
gets the row quantized in the same kernel (kernels.fused.fp8_rows, bytes equal to quantize_rows'): the
key's program then holds the latent as scale groups (one may span the compressed part and the key),
each rope value computed beside its pair's. That variant is compiled without floating-point contraction
(no fused multiply-adds), so on CUDA too its rotation rounds as the reference's separate torch ops do and
the quantized key is bitwise the reference's.

Grid: (T, H + 1), one program per (token, query head), and one per token for the key and the
compressed latent. Launch-only wrapper (no host syncs, grid from shapes): safe to capture in a CUDA
graph once a first call has compiled the kernel.
"""

import torch
import triton
import triton.language as tl

from kernels.attention.fp8_kv import row_bytes, scale_group
from kernels.attention.paged import is_fp8
from kernels.fused.fp8_rows import group_tile, store_fp8_row

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _rotate(x: torch.Tensor, angle_cos: torch.Tensor, angle_sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [..., R] in float32 rotated pairwise, in halves layout; the angles [..., R/2] broadcast."""
    half = x.shape[-1] // 2
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    return torch.cat([x1 * angle_cos - x2 * angle_sin, x2 * angle_cos + x1 * angle_sin], dim=-1)


def mla_rope_and_cache_write_reference(
    q_rope: torch.Tensor,
    k_rope: torch.Tensor,
    compressed: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    interleave: bool,
) -> None:
    """The same in plain torch (its boolean indexing syncs with the host)."""
    half = q_rope.shape[-1] // 2
    angle_cos, angle_sin = cos[positions, :half], sin[positions, :half]  # [T, R/2]
    q_rope.copy_(_rotate(q_rope.float(), angle_cos[:, None], angle_sin[:, None], interleave).to(q_rope.dtype))
    key = _rotate(k_rope.float(), angle_cos, angle_sin, interleave).to(latent_cache.dtype)
    real = slot_mapping >= 0
    latent_cache.view(-1, latent_cache.shape[-1])[slot_mapping[real]] = torch.cat([compressed, key], dim=-1)[real]


def mla_rope_and_cache_write(
    q_rope: torch.Tensor,
    k_rope: torch.Tensor,
    compressed: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    interleave: bool,
) -> None:
    """Rotates q_rope [T, H, R] in place and writes [compressed [T, C], rotated k_rope [T, R]] to the
    latent cache at slot_mapping ([T] int64, -1: skip); positions: [T] int64."""
    _check_inputs(q_rope, k_rope, compressed, positions, cos, sin, latent_cache, slot_mapping)
    tokens, heads, rope_dim = q_rope.shape
    if tokens == 0:
        return
    compressed_dim = compressed.shape[1]
    group = scale_group(compressed_dim + rope_dim)
    fp8 = is_fp8(latent_cache)
    _mla_rope_cache_kernel[(tokens, heads + 1)](
        q_rope, q_rope.stride(0), q_rope.stride(1),
        k_rope, k_rope.stride(0),
        compressed, compressed.stride(0),
        positions, cos, sin, cos.stride(0),
        latent_cache, latent_cache.stride(2), slot_mapping, heads,
        HALF=rope_dim // 2, BLOCK_HALF=triton.next_power_of_2(rope_dim // 2),
        COMPRESSED=compressed_dim, BLOCK_C=triton.next_power_of_2(compressed_dim),
        INTERLEAVE=interleave, FP8=fp8,
        GROUP=group, BLOCK_GROUPS=triton.next_power_of_2((compressed_dim + rope_dim) // group),
        num_warps=1, enable_fp_fusion=not fp8,
    )  # fmt: skip


def _check_inputs(
    q_rope: torch.Tensor,
    k_rope: torch.Tensor,
    compressed: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if q_rope.dim() != 3:
        raise ValueError(f"q_rope must be [tokens, heads, rope_dim], got shape {tuple(q_rope.shape)}")
    tokens, _, rope_dim = q_rope.shape
    if rope_dim % 2:
        raise ValueError(f"rope_dim must be even to rotate pairs, got {rope_dim}")
    if k_rope.shape != (tokens, rope_dim):
        raise ValueError(f"k_rope must be {(tokens, rope_dim)}, got {tuple(k_rope.shape)}")
    if compressed.dim() != 2 or compressed.shape[0] != tokens:
        raise ValueError(f"compressed must be [{tokens}, kv_lora_rank], got {tuple(compressed.shape)}")
    latent_dim = compressed.shape[1] + rope_dim
    fp8 = is_fp8(latent_cache)
    row = row_bytes(latent_dim) if fp8 else latent_dim  # an FP8 row: latent_dim e4m3 bytes, then its scales
    if latent_cache.dim() != 4 or latent_cache.shape[0] != 1 or latent_cache.shape[3] != row:
        raise ValueError(
            f"latent_cache must be [1, pages, page_size, {row}] (compressed + rope"
            f"{', as FP8 rows' if fp8 else ''}), got {tuple(latent_cache.shape)}"
        )
    if not latent_cache.is_contiguous():
        raise ValueError("latent_cache must be contiguous")
    for name, index in (("positions", positions), ("slot_mapping", slot_mapping)):
        if index.shape != (tokens,) or index.dtype != torch.int64:
            raise ValueError(f"{name} must be int64 of shape {(tokens,)}, got {index.dtype} {tuple(index.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[1] != rope_dim or table.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 [positions, {rope_dim}], got {table.dtype} {tuple(table.shape)}")
        if not table.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ in shape")
    if q_rope.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q_rope must be float32, float16 or bfloat16, got {q_rope.dtype}")
    for name, tensor in (("k_rope", k_rope), ("compressed", compressed)):
        if tensor.dtype != q_rope.dtype:
            raise ValueError(f"{name} is {tensor.dtype}, q_rope is {q_rope.dtype}")
    cache_dtype = torch.uint8 if fp8 else q_rope.dtype
    if latent_cache.dtype != cache_dtype:
        raise ValueError(f"latent_cache is {latent_cache.dtype}, expected {cache_dtype} (q_rope is {q_rope.dtype})")
    others = {
        "k_rope": k_rope,
        "compressed": compressed,
        "positions": positions,
        "cos": cos,
        "sin": sin,
        "latent_cache": latent_cache,
        "slot_mapping": slot_mapping,
    }
    for name, tensor in others.items():
        if tensor.device != q_rope.device:
            raise ValueError(f"{name} is on {tensor.device}, q_rope on {q_rope.device}")
    for name, tensor in (("q_rope", q_rope), ("k_rope", k_rope), ("compressed", compressed)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name}'s last dimension must be contiguous, got strides {tuple(tensor.stride())}")


@triton.jit
def _rotate_halves(src, d, mask, angle_cos, angle_sin, HALF: tl.constexpr, INTERLEAVE: tl.constexpr):
    """The rotated halves (float32) of the R values at `src`, pairs as INTERLEAVE lays them out."""
    if INTERLEAVE:
        x1 = tl.load(src + 2 * d, mask=mask).to(tl.float32)
        x2 = tl.load(src + 2 * d + 1, mask=mask).to(tl.float32)
    else:
        x1 = tl.load(src + d, mask=mask).to(tl.float32)
        x2 = tl.load(src + HALF + d, mask=mask).to(tl.float32)
    return x1 * angle_cos - x2 * angle_sin, x2 * angle_cos + x1 * angle_sin


@triton.jit
def _fp8_latent_row(
    k_src, c_src, cos_row, sin_row,
    HALF: tl.constexpr, COMPRESSED: tl.constexpr, INTERLEAVE: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_GROUPS: tl.constexpr,
):  # fmt: skip
    """[compressed, rotated key] as float32 in a group_tile, the key rounded to its own dtype first:
    element COMPRESSED + r is pair i = r % HALF's first (r < HALF) or second rotated value."""
    dims = group_tile(GROUP, BLOCK_GROUPS)
    is_key = (dims >= COMPRESSED) & (dims < COMPRESSED + 2 * HALF)
    r = dims - COMPRESSED
    first = r < HALF
    pair = tl.where(first, r, r - HALF)
    if INTERLEAVE:
        x1 = tl.load(k_src + 2 * pair, mask=is_key).to(tl.float32)
        x2 = tl.load(k_src + 2 * pair + 1, mask=is_key).to(tl.float32)
    else:
        x1 = tl.load(k_src + pair, mask=is_key).to(tl.float32)
        x2 = tl.load(k_src + HALF + pair, mask=is_key).to(tl.float32)
    angle_cos = tl.load(cos_row + pair, mask=is_key)
    angle_sin = tl.load(sin_row + pair, mask=is_key)
    key = tl.where(first, x1 * angle_cos - x2 * angle_sin, x2 * angle_cos + x1 * angle_sin).to(k_src.dtype.element_ty)
    latent = tl.load(c_src + dims, mask=dims < COMPRESSED).to(tl.float32)
    return tl.where(is_key, key.to(tl.float32), latent), dims


@triton.jit
def _mla_rope_cache_kernel(
    q_ptr, q_token_stride, q_head_stride,
    k_ptr, k_token_stride,
    c_ptr, c_token_stride,
    positions_ptr, cos_ptr, sin_ptr, table_stride,
    cache_ptr, cache_slot_stride, slot_ptr, num_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    COMPRESSED: tl.constexpr, BLOCK_C: tl.constexpr,
    INTERLEAVE: tl.constexpr, FP8: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_GROUPS: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_HALF)
    mask = d < HALF
    table_row = tl.load(positions_ptr + token) * table_stride
    angle_cos = tl.load(cos_ptr + table_row + d, mask=mask)
    angle_sin = tl.load(sin_ptr + table_row + d, mask=mask)
    if head < num_heads:
        src = q_ptr + token * q_token_stride + head * q_head_stride
        out1, out2 = _rotate_halves(src, d, mask, angle_cos, angle_sin, HALF, INTERLEAVE)
        tl.debug_barrier()  # in place: every pair is read before any is overwritten
        tl.store(src + d, out1.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(src + HALF + d, out2.to(q_ptr.dtype.element_ty), mask=mask)
    else:
        slot = tl.load(slot_ptr + token)
        if slot >= 0:
            dst = cache_ptr + slot * cache_slot_stride  # the cache is contiguous: slots are consecutive rows
            k_src = k_ptr + token * k_token_stride
            c_src = c_ptr + token * c_token_stride
            if FP8:
                latent, dims = _fp8_latent_row(
                    k_src, c_src, cos_ptr + table_row, sin_ptr + table_row,
                    HALF, COMPRESSED, INTERLEAVE, GROUP, BLOCK_GROUPS,
                )  # fmt: skip
                store_fp8_row(dst, latent, dims, COMPRESSED + 2 * HALF, GROUP, BLOCK_GROUPS)
            else:
                out1, out2 = _rotate_halves(k_src, d, mask, angle_cos, angle_sin, HALF, INTERLEAVE)
                c = tl.arange(0, BLOCK_C)
                c_mask = c < COMPRESSED
                tl.store(dst + c, tl.load(c_src + c, mask=c_mask), mask=c_mask)
                tl.store(dst + COMPRESSED + d, out1.to(q_ptr.dtype.element_ty), mask=mask)
                tl.store(dst + COMPRESSED + HALF + d, out2.to(q_ptr.dtype.element_ty), mask=mask)
