"""Triton paged attention over the engine's KV cache ([kv_heads, pages, page_size, head_dim] per layer),
and multi-head latent attention over a latent cache ([1, pages, page_size, latent_dim]).

Callers use only these wrappers: they check shapes, dtypes, devices and strides before launch.
"""

from kernels.attention.triton.decode import check_supported, paged_decode_attention
from kernels.attention.triton.mla_decode import check_mla_supported, paged_mla_decode
from kernels.attention.triton.mla_prefill import paged_mla_prefill
from kernels.attention.triton.prefill import paged_prefill_attention

__all__ = [
    "check_mla_supported",
    "check_supported",
    "paged_decode_attention",
    "paged_mla_decode",
    "paged_mla_prefill",
    "paged_prefill_attention",
]
