"""Triton paged attention over the engine's KV cache ([kv_heads, pages, page_size, head_dim] per layer).

Callers use only these wrappers: they check shapes, dtypes, devices and strides before launch.
"""

from kernels.attention.triton.decode import check_supported, paged_decode_attention
from kernels.attention.triton.prefill import paged_prefill_attention

__all__ = ["check_supported", "paged_decode_attention", "paged_prefill_attention"]
