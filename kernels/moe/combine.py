"""The MoE op's last step, shared by both paths: each token sums its held pairs' rows of a
[T * k, H] buffer in float32, in choice order (pairs not held are skipped, never read), rounding
once to the output's dtype."""

import torch
import triton
import triton.language as tl

COMBINE_BLOCK = 1024


def combine_pairs(pair_out: torch.Tensor, topk_slots: torch.Tensor, num_slots: int, out: torch.Tensor) -> None:
    """out[t] = sum over k of pair_out[t * k + choice] where topk_slots[t, choice] is in [0, S)."""
    tokens, top_k = topk_slots.shape
    hidden_size = out.shape[1]
    grid = (tokens, triton.cdiv(hidden_size, COMBINE_BLOCK))
    _combine_kernel[grid](
        pair_out,
        topk_slots,
        out,
        top_k,
        num_slots,
        hidden_size,
        pair_out.stride(0),
        out.stride(0),
        BLOCK=COMBINE_BLOCK,
    )


@triton.jit
def _combine_kernel(
    pair_out_ptr,
    slots_ptr,
    out_ptr,
    top_k,
    num_slots,
    hidden_size,
    pair_row_stride,
    out_row_stride,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_mask = cols < hidden_size
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for choice in range(top_k):
        pair = token * top_k + choice
        slot = tl.load(slots_ptr + pair)
        held = (slot >= 0) & (slot < num_slots)
        row = tl.load(pair_out_ptr + pair * pair_row_stride + cols, mask=col_mask & held, other=0.0)
        acc += row.to(tl.float32)
    tl.store(out_ptr + token * out_row_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)
