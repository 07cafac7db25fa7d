"""The reference backend: paged attention in plain torch over fixed key blocks, batch-invariant."""

from kernels.attention.torch_blockwise.attention import paged_attention_blockwise
from kernels.attention.torch_blockwise.backend import TorchBlockwiseBackend

__all__ = ["TorchBlockwiseBackend", "paged_attention_blockwise"]
