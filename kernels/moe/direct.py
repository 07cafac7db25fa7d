"""The routed experts for a few tokens (decode at small batch): the aligned path's grouped GEMMs
without its sort, three launches in all.

Each (token, choice) pair p gets a column of programs. A program first reads all T * k slots (a few
hundred bytes): unless p is the first pair naming its slot, and that slot is held here, it exits
before touching weights. The program of a slot's first pair gathers every pair naming that slot,
in pair order, into BLOCK_M-row tiles (one tile unless a slot has more than BLOCK_M pairs) and
multiplies them by that slot's weights, so each live slot's weights are streamed once per column
block, as in the aligned path.

1. Gate-up GEMM + SiLU·mul: per slot and block of I columns, hidden's rows of the slot's pairs times
   its gate and up rows (float32 accumulators), silu(gate) * up stored in the hidden dtype at the
   pair's row of a [T * k, I] buffer.
2. Down GEMM: per slot and block of H columns, those rows times the slot's w2, scaled by the pair's
   routing weight and stored in float32 at the pair's row of a [T * k, H] buffer.
3. Combine (combine.py): each token sums its held pairs' rows in float32.

FP8 experts quantize each activation tile per token and group in both GEMMs, as the aligned path
does (fused.py's docstring).

No host syncs and fixed grids (T * k by column blocks), so CUDA graphs can capture it.
"""

import torch
import triton
import triton.language as tl

from kernels.moe.combine import combine_pairs
from kernels.moe.configs import DIRECT, TileConfig, block_k_for
from kernels.moe.scales import BlockScales, scale_args
from kernels.quant.fp8_activations import quantize_group


def direct_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    config: TileConfig = DIRECT,
    *,
    scales: BlockScales | None = None,
) -> torch.Tensor:
    """What kernels.moe.experts_reference computes; inputs checked, contiguous routing, tokens >= 1
    (kernels.moe.fused.fused_experts sees to all three)."""
    tokens, hidden_size = hidden.shape
    num_slots, intermediate = w13.shape[0], w13.shape[1] // 2
    top_k = topk_slots.shape[1]
    num_pairs = tokens * top_k
    pairs_block = triton.next_power_of_2(num_pairs)
    block_k = block_k_for(config, hidden.element_size()) if scales is None else scales.block[1]
    scale_block_n = 1 if scales is None else scales.block[0]
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"

    activations = torch.empty((num_pairs, intermediate), dtype=hidden.dtype, device=hidden.device)
    _direct_gate_up_kernel[(num_pairs, triton.cdiv(intermediate, config.gate_up_columns))](
        hidden,
        w13,
        activations,
        topk_slots,
        num_pairs,
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
        PAIRS=pairs_block,
        BLOCK_M=config.block_m,
        BLOCK_N=config.gate_up_columns,
        BLOCK_K=block_k,
        PRECISION=precision,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    pair_out = torch.empty((num_pairs, hidden_size), dtype=torch.float32, device=hidden.device)
    _direct_down_kernel[(num_pairs, triton.cdiv(hidden_size, config.block_n))](
        activations,
        w2,
        pair_out,
        topk_slots,
        topk_weights,
        num_pairs,
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
        PAIRS=pairs_block,
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


@triton.jit
def _slot_group(slots_ptr, num_pairs, num_slots, PAIRS: tl.constexpr):
    """(slot, leads, match, rank, count) for this program's pair: its slot; whether it is held and
    this pair is the first naming it; which pairs name it, each one's rank among them, how many."""
    pair = tl.program_id(0)
    slot = tl.load(slots_ptr + pair)
    pairs = tl.arange(0, PAIRS)
    slots = tl.load(slots_ptr + pairs, mask=pairs < num_pairs, other=-1)
    match = slots == slot
    first = tl.min(tl.where(match, pairs, PAIRS), axis=0)
    leads = (slot >= 0) & (slot < num_slots) & (first == pair)
    ranks = tl.cumsum(match.to(tl.int32), axis=0) - 1
    count = tl.sum(match.to(tl.int32), axis=0)
    return slot, leads, match, ranks, count


@triton.jit
def _tile_pairs(match, ranks, start, count, PAIRS: tl.constexpr, BLOCK_M: tl.constexpr):
    """(pairs, mask) of the tile of a slot's pairs ranked start .. start + BLOCK_M - 1."""
    rows = start + tl.arange(0, BLOCK_M)
    chosen = match[None, :] & (ranks[None, :] == rows[:, None])
    pairs = tl.sum(tl.where(chosen, tl.arange(0, PAIRS)[None, :], 0), axis=1).to(tl.int64)
    return pairs, rows < count


@triton.jit
def _direct_gate_up_kernel(
    hidden_ptr,
    w13_ptr,
    act_ptr,
    slots_ptr,
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
    PAIRS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    slot, leads, match, ranks, count = _slot_group(slots_ptr, num_pairs, num_slots, PAIRS)
    if not leads:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < intermediate
    gate_ptrs = w13_ptr + slot * w13_slot_stride + cols[None, :] * w13_row_stride
    up_ptrs = gate_ptrs + intermediate * w13_row_stride
    if FP8:
        # One scale per column: a column block may straddle weight tiles, and so may gate and up.
        slot_scales = scale_ptr + slot * scale_slot_stride
        gate_scale_ptrs = slot_scales + (cols // SCALE_BLOCK_N) * scale_row_stride
        up_scale_ptrs = slot_scales + ((intermediate + cols) // SCALE_BLOCK_N) * scale_row_stride
    for start in range(0, count, BLOCK_M):
        pairs, row_mask = _tile_pairs(match, ranks, start, count, PAIRS, BLOCK_M)
        x_ptrs = hidden_ptr + (pairs // top_k)[:, None] * hidden_row_stride
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
        out_ptrs = act_ptr + pairs[:, None] * act_row_stride + cols[None, :]
        tl.store(out_ptrs, act.to(act_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _direct_down_kernel(
    act_ptr,
    w2_ptr,
    out_ptr,
    slots_ptr,
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
    PAIRS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    slot, leads, match, ranks, count = _slot_group(slots_ptr, num_pairs, num_slots, PAIRS)
    if not leads:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden_size
    w_ptrs = w2_ptr + slot * w2_slot_stride + cols[None, :] * w2_row_stride
    if FP8:
        w_scale_ptrs = scale_ptr + slot * scale_slot_stride + (cols // SCALE_BLOCK_N) * scale_row_stride
    for start in range(0, count, BLOCK_M):
        pairs, row_mask = _tile_pairs(match, ranks, start, count, PAIRS, BLOCK_M)
        a_ptrs = act_ptr + pairs[:, None] * act_row_stride
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
        weight = tl.load(weights_ptr + pairs, mask=row_mask, other=0.0)
        out_ptrs = out_ptr + pairs[:, None] * out_row_stride + cols[None, :]
        tl.store(out_ptrs, acc * weight[:, None], mask=row_mask[:, None] & col_mask[None, :])
