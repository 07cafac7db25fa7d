"""Paged attention backends. Each takes (query, k_cache, v_cache, metadata, scale=, window=)."""

from collections.abc import Callable

import torch

from kernels.attention.blockwise import paged_attention_blockwise
from kernels.attention.metadata import NULL_PAGE, AttentionMetadata, write_kv
from kernels.attention.sdpa import paged_attention_sdpa

PagedAttention = Callable[..., torch.Tensor]

BACKENDS: dict[str, PagedAttention] = {
    "torch_blockwise": paged_attention_blockwise,
    "torch_sdpa": paged_attention_sdpa,
}


def default_backend(device: torch.device) -> str:
    # The blockwise reference is batch-invariant on the CPU; on CUDA the fused SDPA kernels win.
    return "torch_sdpa" if device.type == "cuda" else "torch_blockwise"


def get_backend(name: str) -> PagedAttention:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(BACKENDS)}")
    return BACKENDS[name]


__all__ = [
    "BACKENDS",
    "NULL_PAGE",
    "AttentionMetadata",
    "PagedAttention",
    "default_backend",
    "get_backend",
    "write_kv",
]
