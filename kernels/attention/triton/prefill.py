"""Paged variable-length causal attention (chunked prefill / extend) as a Triton kernel, and its wrapper.

`_prefill_kernel` computes, for one sequence b, one kv head and one tile of BLOCK_Q of the step's
new tokens, causal softmax attention of those tokens' query heads over the sequence's cached keys
(prefix pages plus the new tokens, whose K/V are already in the cache). The tile's BLOCK_M rows
are (token, head of the kv head's GQA group) pairs, BLOCK_Q = BLOCK_M // group tokens (the last
BLOCK_M % group rows idle), so each K/V tile is loaded once for the whole group. It walks key
tiles of BLOCK_N from the first key the tile's earliest token may see (0, or the start of its
window: earlier tiles are skipped) to the tile's last token, masking per row for causality and
the window, with an online softmax in fp32 whose running maximum starts at the row's attention
sink (kernels.attention.sinks) and its running sum at 1, where a model has sinks.
Grid: (cdiv(max_query_len, BLOCK_Q), B, kv_heads); tiles past a sequence's new tokens return at once.
An FP8 cache's rows are read as the decode kernel reads them (decode.load_rows).
"""

import torch
import triton
import triton.language as tl

from kernels.attention.triton.decode import (
    DOT_PRECISION,
    LOG2_E,
    cache_rows,
    check_paged_inputs,
    load_rows,
    sinks_log2,
)

KEY_TILE = 32  # keys per K/V tile (see decode.key_tile on how block sizes were chosen)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    max_query_len: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    first_keys: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each new token over its sequence's cached keys: [T, heads, head_dim] in q.dtype.

    q: [T, heads, head_dim], the new tokens of all sequences concatenated; sequence b owns rows
    query_start[b]:query_start[b + 1] ([B + 1] int32) and its i-th new token sits at position
    seq_lens[b] - q_len_b + i. seq_lens: [B] int32, cached + new tokens. max_query_len: the
    longest q_len_b (sizes the grid only; longer sequences would be cut short). sinks: [heads]
    logits or None. Rows past query_start[B] are left as they are in `out` (zeros when `out` is None).
    first_keys: [B] int32, the first key each sequence's queries may read (a window replay's start),
    None for 0.
    """
    check_paged_inputs(q, k_cache, v_cache, block_tables, seq_lens, out)
    sinks = sinks_log2(sinks, q)
    if query_start.dtype != torch.int32:
        raise ValueError(f"query_start must be int32, got {query_start.dtype}")
    if query_start.shape != (block_tables.shape[0] + 1,) or query_start.device != q.device:
        raise ValueError(
            f"query_start must be [B + 1] = [{block_tables.shape[0] + 1}] on {q.device}, "
            f"got {tuple(query_start.shape)} on {query_start.device}"
        )
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a non-negative host int, got {max_query_len!r}")
    if window is not None and window < 1:
        raise ValueError(f"window must be a positive number of keys, got {window}")
    tokens, heads, head_dim = q.shape
    kv_heads, _, page_size, _ = k_cache.shape
    batch, max_pages = block_tables.shape
    out = torch.zeros_like(q) if out is None else out
    if batch == 0 or tokens == 0 or max_query_len == 0:
        return out
    group = heads // kv_heads
    block_m = max(64 if head_dim <= 128 else 32, triton.next_power_of_2(group))
    block_q = block_m // group
    _prefill_kernel[(triton.cdiv(max_query_len, block_q), batch, kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start,
        seq_lens,
        out,
        q if sinks is None else sinks,  # never read without sinks
        scale * LOG2_E,
        window or 0,
        max_pages,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_N=KEY_TILE,
        USE_WINDOW=window is not None,
        HAS_SINKS=sinks is not None,
        first_keys_ptr=first_keys if first_keys is not None else seq_lens,
        USE_FIRST_KEYS=first_keys is not None,
        **cache_rows(k_cache, head_dim),
    )
    return out


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    block_tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    out_ptr,
    sinks_ptr,  # [heads] fp32 sink logits * log2(e), read only with HAS_SINKS
    scale_log2,  # softmax scale * log2(e): scores go through exp2
    window,
    max_pages,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kh,  # k and v caches are contiguous and share strides
    stride_kp,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    first_keys_ptr,
    USE_FIRST_KEYS: tl.constexpr,
    FP8: tl.constexpr,  # the caches hold FP8 rows (decode.load_rows)
    ROW: tl.constexpr,  # elements of one cached row: HEAD_DIM, or an FP8 row's bytes
    SCALE_GROUP: tl.constexpr,
):
    q_tile = tl.program_id(0)
    b = tl.program_id(1)
    kv_head = tl.program_id(2)

    first_row = tl.load(query_start_ptr + b)
    query_len = tl.load(query_start_ptr + b + 1) - first_row
    first_token = q_tile * BLOCK_Q
    if first_token >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    context_len = seq_len - query_len  # tokens cached before this step's

    rows = tl.arange(0, BLOCK_M)
    tokens = first_token + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tokens < query_len)
    positions = context_len + tokens
    dims = tl.arange(0, HEAD_DIM)
    token_rows = (first_row + tokens).to(tl.int64)
    q = tl.load(
        q_ptr + token_rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_kh
    table = block_tables_ptr + b.to(tl.int64) * stride_bt

    last_pos = context_len + tl.minimum(first_token + BLOCK_Q, query_len) - 1
    num_keys = tl.minimum(last_pos + 1, max_pages * PAGE_SIZE)  # causal limit; never past the block table
    start = 0
    if USE_WINDOW:
        first_visible = tl.maximum(context_len + first_token - window + 1, 0)
        start = first_visible // BLOCK_N * BLOCK_N  # prune tiles before the earliest token's window
    first_readable = 0
    if USE_FIRST_KEYS:
        first_readable = tl.load(first_keys_ptr + b)
        start = tl.maximum(start, first_readable // BLOCK_N * BLOCK_N)

    if HAS_SINKS:
        # The sink is the first "key" seen: exp2(sink - sink) = 1 in the sum, nothing in acc.
        row_max = tl.load(sinks_ptr + heads, mask=row_ok, other=float("-inf"))
        row_sum = tl.where(row_max > float("-inf"), 1.0, 0.0)
    else:
        row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for tile_start in range(start, num_keys, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        key_ok = keys < num_keys
        pages = tl.load(table + keys // PAGE_SIZE, mask=key_ok, other=0)
        row_starts = pages * stride_kp + (keys % PAGE_SIZE) * ROW
        k = load_rows(k_head, row_starts, dims, key_ok, HEAD_DIM, SCALE_GROUP, FP8).to(q.dtype)
        v = load_rows(v_head, row_starts, dims, key_ok, HEAD_DIM, SCALE_GROUP, FP8).to(q.dtype)
        visible = key_ok[None, :] & (keys[None, :] <= positions[:, None])
        if USE_WINDOW:
            visible &= keys[None, :] > positions[:, None] - window
        if USE_FIRST_KEYS:
            visible &= keys[None, :] >= first_readable
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        scores = tl.where(visible, scores * scale_log2, float("-inf"))

        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with no key yet stays at zero
        probs = tl.exp2(scores - shift[:, None])
        rescale = tl.exp2(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max

    result = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    tl.store(
        out_ptr + token_rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )
