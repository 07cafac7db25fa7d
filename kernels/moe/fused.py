"""The routed experts as grouped GEMMs in Triton. For a few pairs `fused_experts` takes the direct
path (direct.py: no sort, three launches); otherwise the aligned path below: each (token, choice)
pair is sorted by its slot, every slot's pairs padded to whole BLOCK_M tiles, and each tile
multiplies its rows by that slot's weights only.

1. Align (torch ops): the T * k pairs sorted by slot (stable, so a slot's pairs stay in token
   order), each slot's run padded to a multiple of BLOCK_M; `sorted_pairs[i]` is the pair at padded
   position i (T * k for padding) and `tile_slots[b]` the slot of tile b (S past the last tile).
   Pairs whose slot is outside [0, S) (-1: held by another process) get no position.
2. Gate-up GEMM + SiLU·mul: per tile and block of I columns, the tile's token rows of hidden times
   the slot's gate and up rows, both accumulated in float32, silu(gate) * up stored in the hidden
   dtype at the tile's padded positions.
3. Down GEMM: per tile and block of H columns, those activations times the slot's w2, scaled by the
   pair's routing weight and stored at the pair's row of a [T * k, H] buffer.
4. Combine: each token sums its held pairs' rows in float32 (pairs not held are skipped, never
   read), rounding once to the hidden dtype.

FP8 experts (kernels.moe.scales): w13 and w2 in e4m3 with block scales. Both GEMMs then step one
block_k-wide activation group at a time, quantize each row's group to e4m3 in registers and scale
each group's product by the row's and the weight tile's scales, as kernels.quant.fp8_gemm does; an
FP8 constexpr compiles that branch in, and the bf16 kernels are the same as without it.

No host syncs: every buffer and grid is sized from shapes (T * k pairs plus at most BLOCK_M - 1 of
padding per slot), tiles past the last one exit at once, so the op is safe to capture in a CUDA graph.
Paths and tile sizes: kernels.moe.configs.
"""

import torch
import triton
import triton.language as tl

from kernels.moe.checks import check_experts_inputs
from kernels.moe.combine import combine_pairs
from kernels.moe.configs import TileConfig, aligned_config, block_k_for, tile_config
from kernels.moe.direct import direct_experts
from kernels.moe.scales import BlockScales, scale_args
from kernels.quant.fp8_activations import quantize_group


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    scales: BlockScales | None = None,
) -> torch.Tensor:
    """What kernels.moe.experts_reference computes: the direct path (direct.py) for a few pairs,
    else the aligned grouped GEMMs (the module docstring), as kernels.moe.configs chooses. With
    scales, w13 and w2 are e4m3 (kernels.moe.scales)."""
    check_experts_inputs(hidden, w13, w2, topk_slots, topk_weights, scales)
    if hidden.shape[0] == 0:
        return torch.empty_like(hidden)
    topk_slots = topk_slots.contiguous()
    topk_weights = topk_weights.contiguous()
    config = tile_config(topk_slots.numel(), w13.shape[0])
    if config.direct:
        return direct_experts(hidden, w13, w2, topk_slots, topk_weights, config, scales=scales)
    return aligned_experts(hidden, w13, w2, topk_slots, topk_weights, config, scales=scales)


def aligned_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    config: TileConfig | None = None,
    *,
    scales: BlockScales | None = None,
) -> torch.Tensor:
    """The aligned path at any token count (the benchmark's baseline for the direct one); inputs
    checked, contiguous routing, tokens >= 1 (fused_experts sees to all three)."""
    tokens, hidden_size = hidden.shape
    num_slots, intermediate = w13.shape[0], w13.shape[1] // 2
    top_k = topk_slots.shape[1]
    config = config or aligned_config(tokens * top_k, num_slots)
    block_k = block_k_for(config, hidden.element_size()) if scales is None else scales.block[1]
    scale_block_n = 1 if scales is None else scales.block[0]
    sorted_pairs, tile_slots = align_pairs(topk_slots, num_slots, config.block_m)
    padded = sorted_pairs.shape[0]
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"

    activations = torch.empty((padded, intermediate), dtype=hidden.dtype, device=hidden.device)
    grid = (tile_slots.shape[0] * triton.cdiv(intermediate, config.block_n),)
    _gate_up_kernel[grid](
        hidden,
        w13,
        activations,
        sorted_pairs,
        tile_slots,
        tokens * top_k,
        top_k,
        num_slots,
        intermediate,
        hidden_size,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        activations.stride(0),
        *scale_args(scales.w13 if scales else None),
        SCALE_BLOCK_N=scale_block_n,
        FP8=scales is not None,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        PRECISION=precision,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    pair_out = torch.empty((tokens * top_k, hidden_size), dtype=hidden.dtype, device=hidden.device)
    grid = (tile_slots.shape[0] * triton.cdiv(hidden_size, config.block_n),)
    _down_kernel[grid](
        activations,
        w2,
        pair_out,
        sorted_pairs,
        tile_slots,
        topk_weights,
        tokens * top_k,
        num_slots,
        hidden_size,
        intermediate,
        activations.stride(0),
        w2.stride(0),
        w2.stride(1),
        pair_out.stride(0),
        *scale_args(scales.w2 if scales else None),
        SCALE_BLOCK_N=scale_block_n,
        FP8=scales is not None,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        PRECISION=precision,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    out = torch.empty_like(hidden)
    combine_pairs(pair_out, topk_slots, num_slots, out)
    return out


def align_pairs(topk_slots: torch.Tensor, num_slots: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [P], tile_slots [P / block_m]) for P = T * k + S * (block_m - 1) rounded up to
    block_m: the padded sort of step 1, with fixed shapes and no host syncs."""
    flat = topk_slots.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    held = (flat >= 0) & (flat < num_slots)
    key = torch.where(held, flat, num_slots)  # pairs not held sort last, under slot S
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded_counts = (counts[:num_slots] + block_m - 1) // block_m * block_m
    padded_ends = padded_counts.cumsum(0)
    padded_starts = padded_ends - padded_counts
    starts = counts.cumsum(0) - counts
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    rank = torch.arange(num_pairs, device=device) - starts[sorted_key]
    capacity = triton.cdiv(num_pairs + num_slots * (block_m - 1), block_m) * block_m
    # Pairs not held go to one extra position past the end, dropped below.
    position = torch.where(sorted_key < num_slots, padded_starts[sorted_key.clamp(max=num_slots - 1)] + rank, capacity)
    sorted_pairs = torch.full((capacity + 1,), num_pairs, dtype=torch.int64, device=device)
    sorted_pairs.scatter_(0, position, order)
    tile_starts = torch.arange(0, capacity, block_m, device=device)
    tile_slots = torch.searchsorted(padded_ends, tile_starts, right=True)
    return sorted_pairs[:capacity], tile_slots


@triton.jit
def _gate_up_kernel(
    hidden_ptr,
    w13_ptr,
    act_ptr,
    sorted_pairs_ptr,
    tile_slots_ptr,
    num_pairs,
    top_k,
    num_slots,
    intermediate,
    hidden_size,
    hidden_row_stride,
    w13_slot_stride,
    w13_row_stride,
    act_row_stride,
    scale_ptr,
    scale_slot_stride,
    scale_row_stride,
    scale_col_stride,
    SCALE_BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Consecutive programs share a tile (its rows stay in cache) and walk its column blocks.
    pid = tl.program_id(0)
    column_blocks = tl.cdiv(intermediate, BLOCK_N)
    tile = pid // column_blocks
    slot = tl.load(tile_slots_ptr + tile)
    if slot >= num_slots:
        return
    rows = tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + rows)
    row_mask = pair < num_pairs
    token = pair // top_k
    cols = (pid % column_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < intermediate
    gate_ptrs = w13_ptr + slot * w13_slot_stride + cols[None, :] * w13_row_stride
    up_ptrs = gate_ptrs + intermediate * w13_row_stride
    x_ptrs = hidden_ptr + token[:, None] * hidden_row_stride
    if FP8:
        # One scale per column: a column block may straddle weight tiles, and so may gate and up.
        slot_scales = scale_ptr + slot * scale_slot_stride
        gate_scale_ptrs = slot_scales + (cols // SCALE_BLOCK_N) * scale_row_stride
        up_scale_ptrs = slot_scales + ((intermediate + cols) // SCALE_BLOCK_N) * scale_row_stride
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < hidden_size
        x = tl.load(x_ptrs + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        w_gate = tl.load(gate_ptrs + ks[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(up_ptrs + ks[:, None], mask=w_mask, other=0.0)
        if FP8:
            # BLOCK_K is block_k: this tile is one activation group of each row (fp8_gemm.py).
            x_values, x_scale = quantize_group(x)
            scale_offset = (k0 // BLOCK_K) * scale_col_stride
            gate_scale = tl.load(gate_scale_ptrs + scale_offset, mask=col_mask, other=0.0)
            up_scale = tl.load(up_scale_ptrs + scale_offset, mask=col_mask, other=0.0)
            gate += tl.dot(x_values, w_gate) * (x_scale[:, None] * gate_scale[None, :])
            up += tl.dot(x_values, w_up) * (x_scale[:, None] * up_scale[None, :])
        else:
            gate = tl.dot(x, w_gate, gate, input_precision=PRECISION)
            up = tl.dot(x, w_up, up, input_precision=PRECISION)
    act = gate / (1.0 + tl.exp(-gate)) * up
    out_ptrs = act_ptr + rows[:, None] * act_row_stride + cols[None, :]
    tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _down_kernel(
    act_ptr,
    w2_ptr,
    out_ptr,
    sorted_pairs_ptr,
    tile_slots_ptr,
    weights_ptr,
    num_pairs,
    num_slots,
    hidden_size,
    intermediate,
    act_row_stride,
    w2_slot_stride,
    w2_row_stride,
    out_row_stride,
    scale_ptr,
    scale_slot_stride,
    scale_row_stride,
    scale_col_stride,
    SCALE_BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    column_blocks = tl.cdiv(hidden_size, BLOCK_N)
    tile = pid // column_blocks
    slot = tl.load(tile_slots_ptr + tile)
    if slot >= num_slots:
        return
    rows = tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + rows)
    row_mask = pair < num_pairs
    cols = (pid % column_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden_size
    a_ptrs = act_ptr + rows[:, None] * act_row_stride
    w_ptrs = w2_ptr + slot * w2_slot_stride + cols[None, :] * w2_row_stride
    if FP8:
        w_scale_ptrs = scale_ptr + slot * scale_slot_stride + (cols // SCALE_BLOCK_N) * scale_row_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, intermediate, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < intermediate
        a = tl.load(a_ptrs + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        if FP8:
            a_values, a_scale = quantize_group(a)
            w_scale = tl.load(w_scale_ptrs + (k0 // BLOCK_K) * scale_col_stride, mask=col_mask, other=0.0)
            acc += tl.dot(a_values, w) * (a_scale[:, None] * w_scale[None, :])
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
    weight = tl.load(weights_ptr + pair, mask=row_mask, other=0.0)
    acc = acc * weight[:, None]
    out_ptrs = out_ptr + pair[:, None] * out_row_stride + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
