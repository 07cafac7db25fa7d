"""The paged KV cache tensors of one engine."""

import math
import os
import weakref
from dataclasses import dataclass

import torch

from workers.engine.config import ModelConfig

SHARED_MEMORY_NAME = "sluice-kv-cache"  # a shareable CPU cache's memfd, as /proc/<pid>/fd/ shows it


@dataclass(frozen=True, slots=True)
class SharedHostMemory:
    """Where a CPU cache's memory can be mapped by another process of this host: an anonymous
    in-memory file (memfd) of process `pid`, open as its descriptor `fd` (/proc/<pid>/fd/<fd>). It
    lives as long as the cache, or as a process that mapped it keeps the mapping, never longer: a
    crashed worker leaves nothing behind, as a named file in /dev/shm would."""

    pid: int
    fd: int
    num_bytes: int


class KVCache:
    """Per-layer key and value page tensors: [kv_heads, num_pages, page_size, head_dim].

    Head-major, so gathering a sequence's pages yields each KV head's keys contiguously. Every layer's
    keys and values are views of one tensor, `pages` ([layers, 2, kv_heads, num_pages, page_size,
    head_dim]), so the whole cache is shared with a process on the same host by one handle
    (workers.transfer.pools): a CUDA IPC handle on a GPU; on the CPU, a `shareable` cache lives in
    shared memory (`shared_memory`).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        shareable: bool = False,
    ):
        shape = (config.num_layers, 2, config.num_kv_heads, num_pages, page_size, config.head_dim)
        self.shared_memory: SharedHostMemory | None = None
        # Zero-filled so padded, masked slots can never hold NaN (0 * NaN would leak into outputs);
        # a fresh memfd reads as zeros.
        if shareable and device.type == "cpu":
            self.pages, self.shared_memory = _shared_host_tensor(shape, dtype)
            # The descriptor is how peers find the memory: open while the cache lives.
            weakref.finalize(self, os.close, self.shared_memory.fd)
        else:
            self.pages = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [(self.pages[i, 0], self.pages[i, 1]) for i in range(config.num_layers)]
        self.num_pages = num_pages
        self.page_size = page_size

    @property
    def dtype(self) -> torch.dtype:
        return self.pages.dtype

    @property
    def device(self) -> torch.device:
        return self.pages.device

    @staticmethod
    def page_bytes(config: ModelConfig, *, page_size: int, dtype: torch.dtype) -> int:
        """Bytes of one page over every layer, keys and values."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * page_size * config.num_kv_heads * config.head_dim * element

    @staticmethod
    def pages_for_bytes(config: ModelConfig, *, num_bytes: int, page_size: int, dtype: torch.dtype) -> int:
        return max(num_bytes // KVCache.page_bytes(config, page_size=page_size, dtype=dtype), 2)


def _shared_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, SharedHostMemory]:
    numel = math.prod(shape)
    num_bytes = numel * torch.empty((), dtype=dtype).element_size()
    fd = os.memfd_create(SHARED_MEMORY_NAME, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, num_bytes)
        tensor = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=dtype).view(shape)
    except BaseException:
        os.close(fd)
        raise
    return tensor, SharedHostMemory(pid=os.getpid(), fd=fd, num_bytes=num_bytes)
