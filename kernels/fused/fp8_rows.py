"""Writing FP8 KV rows (kernels.attention.fp8_kv's format) from a Triton kernel: the mirror of
kernels.attention.triton.decode's `load_rows`, for the fused ops that rotate and cache in one kernel.

A row's WIDTH values are held as a [BLOCK_GROUPS, GROUP] tile, one scale group per tile row, at the
element offsets `group_tile` gives (padding tile rows lie at or past WIDTH and are masked off). The
e4m3 bytes are stored through a float8e4nv pointer at the row's start, the float32 scales through a
float32 pointer at byte WIDTH of the row.

The arithmetic is quantize_rows's, operation for operation, so the bytes are the same: the group's
largest magnitude, at least MIN_AMAX, divided by FP8_MAX is the scale; each value is divided by its
scale, clamped to e4m3's range and rounded to nearest. Both divisions are IEEE (tl.div_rn), since
Triton's `/` on float32 is an approximate division on CUDA and would move some values by a rounding
step; a reciprocal multiply would too.
"""

import triton
import triton.language as tl

from kernels.attention.fp8_kv import FP8_MAX, MIN_AMAX

FP8_MAX_VALUE = tl.constexpr(FP8_MAX)
MIN_AMAX_VALUE = tl.constexpr(MIN_AMAX)


@triton.jit
def group_tile(GROUP: tl.constexpr, BLOCK_GROUPS: tl.constexpr):
    """Element offsets [BLOCK_GROUPS, GROUP] of a row's values, one scale group per tile row."""
    return tl.arange(0, BLOCK_GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]


@triton.jit
def store_fp8_row(
    row_ptr, values, dims, WIDTH: tl.constexpr, GROUP: tl.constexpr, BLOCK_GROUPS: tl.constexpr
):  # fmt: skip
    """Quantize float32 `values` (at `dims`, a group_tile) into the uint8 row at `row_ptr`."""
    mask = dims < WIDTH
    amax = tl.max(tl.where(mask, tl.abs(values), 0.0), axis=1)
    scales = tl.div_rn(tl.maximum(amax, MIN_AMAX_VALUE), tl.full(amax.shape, FP8_MAX_VALUE, tl.float32))
    scaled = tl.div_rn(values, tl.broadcast_to(scales[:, None], values.shape))
    quantized = tl.minimum(tl.maximum(scaled, -FP8_MAX_VALUE), FP8_MAX_VALUE).to(tl.float8e4nv)
    tl.store((row_ptr + dims).to(tl.pointer_type(tl.float8e4nv)), quantized, mask=mask)
    groups = tl.arange(0, BLOCK_GROUPS)
    tl.store((row_ptr + WIDTH).to(tl.pointer_type(tl.float32)) + groups, scales, mask=groups * GROUP < WIDTH)
