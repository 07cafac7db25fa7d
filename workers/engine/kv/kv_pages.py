"""Copies between a request's KV pages and token-major tensors.

Each plane of a layer's cache (its keys, its values, or its latent) is [heads, num_pages, page_size,
width] (see kv_cache); the global KV store's blocks and the prefill → decode handoff both carry a
plane as [heads, tokens, width] runs, so both move it through these two functions.
"""

import torch


def gather_tokens(cache: torch.Tensor, pages: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[heads, num_tokens, width]: the first `num_tokens` tokens held by `pages`, in order."""
    heads, _, page_size, width = cache.shape
    return cache[:, pages].reshape(heads, len(pages) * page_size, width)[:, :num_tokens]


def scatter_tokens(cache: torch.Tensor, pages: torch.Tensor, data: torch.Tensor) -> None:
    """Write `data` [heads, tokens, width] into `pages` from their first slot; a last page that the
    tokens do not fill keeps its remaining slots."""
    heads, num_tokens, width = data.shape
    page_size = cache.shape[2]
    full, rest = divmod(num_tokens, page_size)
    data = data.to(cache.device)
    if full:
        cache[:, pages[:full]] = data[:, : full * page_size].reshape(heads, full, page_size, width)
    if rest:
        cache[:, pages[full : full + 1], :rest] = data[:, full * page_size :].unsqueeze(1)
