"""Paged variable-length causal multi-head latent attention (absorbed MLA: chunked prefill / extend)
as a Triton kernel, and its wrapper. mla_decode.py describes the latent layout.

`_mla_prefill_kernel` computes, for one sequence b, one block of HEAD_BLOCK query heads and one tile
of BLOCK_Q of the step's new tokens, causal softmax attention over the sequence's cached latents
(prefix plus the new tokens, whose latents are already in the cache). The tile's BLOCK_M rows are
(token, head) pairs, BLOCK_Q = BLOCK_M // HEAD_BLOCK tokens, so each latent tile is loaded once for
all of them; scores add the value part's and the rope part's products, the output accumulates
probs @ latent[:, :Dv]. It walks key tiles up to the tile's last token, masking per row for
causality, with an online softmax in fp32. Grid: (cdiv(max_query_len, BLOCK_Q), B, head_blocks);
tiles past a sequence's new tokens return at once. Decode rows are sequences of one new token.
An FP8 latent cache is read as the decode kernel reads it (decode.load_rows).
"""

import torch
import triton
import triton.language as tl

from kernels.attention.triton.decode import DOT_PRECISION, LOG2_E, cache_rows, load_rows
from kernels.attention.triton.mla_decode import check_mla_inputs

# Not timed on a GPU yet: sized like the decode kernel's tiles; compiled for sm_90 (bf16, 512 + 64)
# 32 rows x 32 keys at 8 warps takes 244 registers and no spill.
PREFILL_ROWS = 32  # (token, head) rows per program
PREFILL_KEY_TILE = 32  # keys per latent tile
PREFILL_WARPS = 8


def paged_mla_prefill(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    max_query_len: int,
    v_dim: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA of each new token over its sequence's cached latents: [T, H, v_dim] in query's dtype.

    query: [T, H, Dk], the new tokens of all sequences concatenated; sequence b owns rows
    query_start[b]:query_start[b + 1] ([B + 1] int32) and its i-th new token sits at position
    seq_lens[b] - q_len_b + i. latent_cache: [1, pages, page_size, Dk]; seq_lens: [B] int32,
    cached + new tokens. max_query_len: the longest q_len_b (sizes the grid only). Rows past
    query_start[B] are left as they are in `out` (zeros when `out` is None).
    """
    check_mla_inputs(query, latent_cache, block_tables, seq_lens, out, v_dim)
    if query_start.dtype != torch.int32:
        raise ValueError(f"query_start must be int32, got {query_start.dtype}")
    if query_start.shape != (block_tables.shape[0] + 1,) or query_start.device != query.device:
        raise ValueError(
            f"query_start must be [B + 1] = [{block_tables.shape[0] + 1}] on {query.device}, "
            f"got {tuple(query_start.shape)} on {query_start.device}"
        )
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a non-negative host int, got {max_query_len!r}")
    tokens, heads, head_dim = query.shape
    _, _, page_size, _ = latent_cache.shape
    batch, max_pages = block_tables.shape
    out = torch.zeros(tokens, heads, v_dim, dtype=query.dtype, device=query.device) if out is None else out
    if batch == 0 or tokens == 0 or max_query_len == 0:
        return out
    head_block = min(triton.next_power_of_2(heads), PREFILL_ROWS)
    block_q = PREFILL_ROWS // head_block
    _mla_prefill_kernel[(triton.cdiv(max_query_len, block_q), batch, triton.cdiv(heads, head_block))](
        query,
        latent_cache,
        block_tables,
        query_start,
        seq_lens,
        out,
        scale * LOG2_E,
        heads,
        max_pages,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        latent_cache.stride(1),
        block_tables.stride(0),
        HEAD_BLOCK=head_block,
        BLOCK_Q=block_q,
        V_DIM=v_dim,
        ROPE_DIM=head_dim - v_dim,
        PAGE_SIZE=page_size,
        BLOCK_N=PREFILL_KEY_TILE,
        **cache_rows(latent_cache, head_dim),
        num_warps=PREFILL_WARPS,
    )
    return out


@triton.jit
def _mla_prefill_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,  # softmax scale * log2(e): scores go through exp2
    heads_total,
    max_pages,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cp,
    stride_bt,
    HEAD_BLOCK: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    V_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,  # the cache holds FP8 rows (decode.load_rows)
    ROW: tl.constexpr,  # elements of one cached row: Dk, or an FP8 row's bytes
    SCALE_GROUP: tl.constexpr,
):
    q_tile = tl.program_id(0)
    b = tl.program_id(1)
    head_block = tl.program_id(2)

    first_row = tl.load(query_start_ptr + b)
    query_len = tl.load(query_start_ptr + b + 1) - first_row
    first_token = q_tile * BLOCK_Q
    if first_token >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    context_len = seq_len - query_len  # tokens cached before this step's

    head_dim: tl.constexpr = V_DIM + ROPE_DIM
    rows = tl.arange(0, BLOCK_Q * HEAD_BLOCK)
    tokens = first_token + rows // HEAD_BLOCK
    heads = head_block * HEAD_BLOCK + rows % HEAD_BLOCK
    row_ok = (tokens < query_len) & (heads < heads_total)
    positions = context_len + tokens
    v_dims = tl.arange(0, V_DIM)
    r_dims = V_DIM + tl.arange(0, ROPE_DIM)
    token_rows = (first_row + tokens).to(tl.int64)
    q_rows = q_ptr + token_rows[:, None] * stride_qt + heads[:, None] * stride_qh
    q_nope = tl.load(q_rows + v_dims[None, :], mask=row_ok[:, None], other=0.0)
    q_rope = tl.load(q_rows + r_dims[None, :], mask=row_ok[:, None], other=0.0)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt

    last_pos = context_len + tl.minimum(first_token + BLOCK_Q, query_len) - 1
    num_keys = tl.minimum(last_pos + 1, max_pages * PAGE_SIZE)  # causal limit; never past the block table

    row_max = tl.full([BLOCK_Q * HEAD_BLOCK], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_Q * HEAD_BLOCK], tl.float32)
    acc = tl.zeros([BLOCK_Q * HEAD_BLOCK, V_DIM], tl.float32)
    for tile_start in range(0, num_keys, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        key_ok = keys < num_keys
        pages = tl.load(table + keys // PAGE_SIZE, mask=key_ok, other=0)
        row_starts = pages * stride_cp + (keys % PAGE_SIZE) * ROW
        latent = load_rows(cache_ptr, row_starts, v_dims, key_ok, head_dim, SCALE_GROUP, FP8).to(q_nope.dtype)
        k_rope = load_rows(cache_ptr, row_starts, r_dims, key_ok, head_dim, SCALE_GROUP, FP8).to(q_rope.dtype)
        scores = tl.dot(q_nope, tl.trans(latent), input_precision=DOT_PRECISION)
        scores = tl.dot(q_rope, tl.trans(k_rope), scores, input_precision=DOT_PRECISION)
        visible = key_ok[None, :] & (keys[None, :] <= positions[:, None])
        scores = tl.where(visible, scores * scale_log2, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with no key yet stays at zero
        probs = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(latent.dtype), latent, input_precision=DOT_PRECISION)
        row_max = new_max

    result = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    tl.store(
        out_ptr + token_rows[:, None] * stride_ot + heads[:, None] * stride_oh + v_dims[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )
