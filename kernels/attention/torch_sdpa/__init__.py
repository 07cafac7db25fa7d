"""Paged attention through torch's fused scaled_dot_product_attention over gathered pages."""

from kernels.attention.torch_sdpa.attention import paged_attention_sdpa
from kernels.attention.torch_sdpa.backend import TorchSdpaBackend

__all__ = ["TorchSdpaBackend", "paged_attention_sdpa"]
