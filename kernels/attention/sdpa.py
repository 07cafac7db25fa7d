"""Paged attention through torch's fused scaled_dot_product_attention: the fast torch backend.

Each sequence group's keys are gathered from the pages into a padded batch and attended in one
call with a boolean mask. Fast on CUDA, where SDPA dispatches to fused kernels; not batch-invariant.
"""

import torch
import torch.nn.functional as F

from kernels.attention.metadata import (
    AttentionMetadata,
    check_paged_inputs,
    gather_pages,
    visible_keys,
)


def paged_attention_sdpa(
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
    page_size = k_cache.shape[1]
    out = torch.zeros_like(query)
    for group in metadata.groups:
        num_keys = -(-group.max_seq_len // page_size) * page_size
        keys = gather_pages(k_cache, group.block_tables, num_keys)
        values = gather_pages(v_cache, group.block_tables, num_keys)
        q = query[group.token_index].transpose(1, 2)  # [n, heads, width, head_dim]
        k_pos = torch.arange(num_keys, device=query.device)
        mask = visible_keys(group.positions, k_pos, group.seq_lens, window).unsqueeze(1)
        # Padding rows see no key; let them see key 0 so no row is all -inf (NaN in some kernels).
        mask[:, :, :, 0] |= ~group.valid.unsqueeze(1)
        result = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[group.token_index[group.valid]] = result.transpose(1, 2)[group.valid]
    return out
