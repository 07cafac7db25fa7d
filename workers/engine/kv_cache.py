"""The paged KV cache tensors of one engine."""

import torch

from workers.engine.config import ModelConfig


class KVCache:
    """Per-layer key and value page tensors: [kv_heads, num_pages, page_size, head_dim].

    Head-major, so gathering a sequence's pages yields each KV head's keys contiguously.
    """

    def __init__(
        self, config: ModelConfig, *, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device
    ):
        shape = (config.num_kv_heads, num_pages, page_size, config.head_dim)
        # Zero-filled so padded, masked slots can never hold NaN (0 * NaN would leak into outputs).
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(config.num_layers)
        ]
        self.num_pages = num_pages
        self.page_size = page_size

    @staticmethod
    def page_bytes(config: ModelConfig, *, page_size: int, dtype: torch.dtype) -> int:
        """Bytes of one page over every layer, keys and values."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * page_size * config.num_kv_heads * config.head_dim * element

    @staticmethod
    def pages_for_bytes(config: ModelConfig, *, num_bytes: int, page_size: int, dtype: torch.dtype) -> int:
        return max(num_bytes // KVCache.page_bytes(config, page_size=page_size, dtype=dtype), 2)
