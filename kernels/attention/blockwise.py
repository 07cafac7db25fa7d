"""Paged attention in plain torch with online softmax over fixed key blocks: the reference backend.

It is also batch-invariant on the CPU: a query row's output is bitwise the same whatever else is
in the batch, however its prompt was chunked, and whether its token came from prefill or decode.
Three choices make that so:
- keys are visited in blocks of a fixed KEY_BLOCK from position 0, each padded to the full block,
  so every matmul a row takes part in has the same reduction length;
- a block a row may not see is a no-op (exp(-inf) = 0 exactly, alpha = 1), so extra blocks that
  other sequences need change nothing;
- each per-KV-head query matrix has at least MIN_ROWS rows, past the size under which the CPU
  BLAS switches kernels (and rounding) for small matrices.
"""

import torch

from kernels.attention.metadata import (
    AttentionMetadata,
    SequenceGroup,
    check_paged_inputs,
    gather_pages,
    visible_keys,
)

KEY_BLOCK = 256
MIN_ROWS = 16


def paged_attention_blockwise(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    *,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of each new token over its sequence's cached keys: [tokens, heads, head_dim]."""
    check_paged_inputs(query, k_cache, v_cache, metadata)
    if KEY_BLOCK % k_cache.shape[1]:
        raise ValueError(f"page size {k_cache.shape[1]} must divide the key block {KEY_BLOCK}")
    out = torch.zeros_like(query)
    for group in metadata.groups:
        _attend_group(query, out, k_cache, v_cache, group, scale, window)
    return out


def _attend_group(
    query: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: SequenceGroup,
    scale: float,
    window: int | None,
) -> None:
    n, width = group.token_index.shape
    heads, head_dim = query.shape[1], query.shape[2]
    kv_heads = k_cache.shape[2]
    per_kv = heads // kv_heads
    rows = max(width * per_kv, MIN_ROWS)

    # A KV head's query matrix has one row per (token, head sharing that KV head), token-major.
    q = query[group.token_index].view(n, width, kv_heads, per_kv, head_dim)
    q = q.permute(0, 2, 1, 3, 4).reshape(n, kv_heads, width * per_kv, head_dim)
    row_pos = group.positions.repeat_interleave(per_kv, dim=1)
    if rows > width * per_kv:
        q = torch.cat([q, q.new_zeros(n, kv_heads, rows - width * per_kv, head_dim)], dim=2)
        row_pos = torch.cat([row_pos, row_pos.new_full((n, rows - width * per_kv), -1)], dim=1)
    row_pos = row_pos.unsqueeze(1)  # broadcast over kv heads

    num_keys = -(-group.max_seq_len // KEY_BLOCK) * KEY_BLOCK
    # Blocks wholly before every row's window are no-ops; skipping them changes no bit.
    first = 0 if window is None else max(group.min_context_start - window + 1, 0) // KEY_BLOCK * KEY_BLOCK
    keys = gather_pages(k_cache, group.block_tables, num_keys)
    values = gather_pages(v_cache, group.block_tables, num_keys)

    neg_inf = torch.tensor(float("-inf"), dtype=q.dtype, device=q.device)
    running_max = torch.full((n, kv_heads, rows, 1), float("-inf"), dtype=q.dtype, device=q.device)
    denom = torch.zeros_like(running_max)
    acc = torch.zeros_like(q)
    for start in range(first, num_keys, KEY_BLOCK):
        k_pos = torch.arange(start, start + KEY_BLOCK, device=q.device)
        scores = torch.matmul(q, keys[:, :, start : start + KEY_BLOCK].transpose(-1, -2)) * scale
        scores = torch.where(visible_keys(row_pos, k_pos, group.seq_lens, window), scores, neg_inf)
        new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        # A row that has seen no key yet keeps max -inf; shift by 0 so exp() gives 0, not NaN.
        shift = torch.where(new_max == neg_inf, torch.zeros_like(new_max), new_max)
        probs = torch.exp(scores - shift)
        alpha = torch.exp(running_max - shift)
        denom = denom * alpha + probs.sum(dim=-1, keepdim=True)
        acc = acc * alpha + torch.matmul(probs, values[:, :, start : start + KEY_BLOCK])
        running_max = new_max

    result = (acc[:, :, : width * per_kv] / denom[:, :, : width * per_kv]).view(n, kv_heads, width, per_kv, head_dim)
    result = result.permute(0, 2, 1, 3, 4).reshape(n, width, heads, head_dim)
    out[group.token_index[group.valid]] = result[group.valid]
