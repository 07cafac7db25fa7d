"""The paged KV cache's conventions, shared by every backend and by the engine: the null page that
padded block-table entries point at, and the plain-torch write of new keys and values at their slots."""

import torch

NULL_PAGE = 0  # page 0 is never handed out: padded block-table entries point at it


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' keys and values ([tokens, kv_heads, head_dim]) at their cache slots; a
    token of slot -1 writes nothing."""
    n = slot_mapping.shape[0]
    kv_heads, _, _, head_dim = k_cache.shape
    if key.shape[0] < n or key.shape[1:] != (kv_heads, head_dim):
        raise ValueError(f"keys {tuple(key.shape)} do not fit cache {tuple(k_cache.shape)} for {n} slots")
    for cache, new in ((k_cache, key), (v_cache, value)):
        flat = cache.view(kv_heads, -1, head_dim)
        # Without reading the slots back to the host: a skipped token rewrites the null page's first
        # slot with what it holds.
        skipped = slot_mapping < 0
        slots = slot_mapping.masked_fill(skipped, NULL_PAGE * cache.shape[2])
        rows = torch.where(skipped.view(1, -1, 1), flat[:, slots], new[:n].transpose(0, 1))
        flat.index_copy_(1, slots, rows)
