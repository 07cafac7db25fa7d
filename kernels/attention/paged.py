"""The paged KV cache's conventions, shared by every backend and by the engine: the null page that
padded block-table entries point at, and the plain-torch write of new keys and values at their slots.

A cache of uint8 holds FP8 rows (kernels.attention.fp8_kv): writes quantize into them, reads
dequantize out of them (torch_common.metadata.gather_kv, triton.decode.load_rows). Every backend
reads a step's new keys back from the cache after they are written, so a chunk attends to its own
tokens' quantized KV, exactly as later chunks, decode steps and prefix hits read it."""

import torch

from kernels.attention.fp8_kv import quantize_rows, row_bytes

NULL_PAGE = 0  # page 0 is never handed out: padded block-table entries point at it


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether a page tensor holds FP8 rows: the only uint8 caches there are."""
    return cache.dtype == torch.uint8


def to_cache_rows(values: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """`values` [..., width] as the rows `cache` stores: FP8 rows, or the cache's dtype."""
    return quantize_rows(values) if is_fp8(cache) else values.to(cache.dtype)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' keys and values ([tokens, kv_heads, head_dim]) at their cache slots; a
    token of slot -1 writes nothing. An FP8 cache gets each row quantized (fp8_kv.quantize_rows)."""
    n = slot_mapping.shape[0]
    kv_heads, _, _, row_width = k_cache.shape
    head_dim = key.shape[-1]
    expected = row_bytes(head_dim) if is_fp8(k_cache) else head_dim
    if key.shape[0] < n or key.shape[1] != kv_heads or row_width != expected:
        raise ValueError(f"keys {tuple(key.shape)} do not fit cache {tuple(k_cache.shape)} for {n} slots")
    for cache, new in ((k_cache, key), (v_cache, value)):
        flat = cache.view(kv_heads, -1, row_width)
        # Without reading the slots back to the host: a skipped token rewrites the null page's first
        # slot with what it holds.
        skipped = slot_mapping < 0
        slots = slot_mapping.masked_fill(skipped, NULL_PAGE * cache.shape[2])
        rows = torch.where(skipped.view(1, -1, 1), flat[:, slots], to_cache_rows(new[:n].transpose(0, 1), cache))
        flat.index_copy_(1, slots, rows)
