"""The paged KV cache tensors of one engine."""

import math
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.engine.config import ModelConfig
from workers.engine.kv.spec import KVCacheSpecs

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
    """Per layer, its planes' page tensors, each [heads, num_pages, page_size, row_width] of the
    specs' storage dtype (see workers.engine.kv.spec: FP8 rows are uint8): `layers[i]` is (key,
    value) for a full-attention layer, (latent,) for a latent one.

    Head-major, so gathering a sequence's pages yields each head's tokens contiguously. Each KV group's
    layers are views of one tensor, [group layers, planes, heads, num_pages, page_size, row_width]; a
    model of one group has its whole cache in `pages`, which is shared with a
    process on the same host by one handle (workers.transfer.pools): a CUDA IPC handle on a GPU; on
    the CPU, a `shareable` cache lives in shared memory (`shared_memory`).
    """

    def __init__(
        self,
        specs: KVCacheSpecs,
        *,
        num_pages: int | Sequence[int],
        device: torch.device,
        shareable: bool = False,
    ):
        """`num_pages`: of every group, or per group (a sliding window's pool is smaller than the full
        group's: see workers.engine.sizing.kv_sizing)."""
        if shareable and len(specs.groups) > 1:
            raise ValueError(f"a cache of {len(specs.groups)} KV groups is not one tensor to share")
        self.specs = specs
        self.group_num_pages = per_group(num_pages, len(specs.groups))
        self.shared_memory: SharedHostMemory | None = None
        self.group_pages: list[torch.Tensor] = []
        by_layer: dict[int, tuple[torch.Tensor, ...]] = {}
        for spec, group_num_pages in zip(specs.groups, self.group_num_pages, strict=True):
            shape = spec.pages_shape(group_num_pages)
            # Zero-filled so padded, masked slots can never hold NaN (0 * NaN would leak into outputs);
            # a fresh memfd reads as zeros.
            if shareable and device.type == "cpu":
                pages, self.shared_memory = _shared_host_tensor(shape, spec.storage_dtype)
                # The descriptor is how peers find the memory: open while the cache lives.
                weakref.finalize(self, os.close, self.shared_memory.fd)
            else:
                pages = torch.zeros(shape, dtype=spec.storage_dtype, device=device)
            self.group_pages.append(pages)
            for i, layer in enumerate(spec.layers):
                by_layer[layer] = tuple(pages[i].unbind(0))
        self.layers = [by_layer[layer] for layer in range(specs.num_layers)]
        self.num_pages = self.group_num_pages[0]
        self.page_size = specs.page_size

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        *,
        num_pages: int | Sequence[int],
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        shareable: bool = False,
        kv_cache_dtype: str = "auto",
    ) -> "KVCache":
        specs = KVCacheSpecs.of_model(config, dtype=dtype, page_size=page_size, kv_cache_dtype=kv_cache_dtype)
        return cls(specs, num_pages=num_pages, device=device, shareable=shareable)

    @property
    def pages(self) -> torch.Tensor:
        """The whole cache as one tensor, [layers, planes, heads, num_pages, page_size, width]: a cache
        of one KV group."""
        if len(self.group_pages) != 1:
            raise ValueError(f"a cache of {len(self.group_pages)} KV groups is not one tensor")
        return self.group_pages[0]

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: what attention reads the cache as."""
        return self.specs.groups[0].dtype

    @property
    def storage_dtype(self) -> torch.dtype:
        """The page tensors' dtype: uint8 for FP8 rows, else `dtype`."""
        return self.group_pages[0].dtype

    @property
    def device(self) -> torch.device:
        return self.group_pages[0].device


def per_group(num_pages: int | Sequence[int], num_groups: int) -> tuple[int, ...]:
    """Pages of each of `num_groups` groups, from one count for all or one per group."""
    counts = (num_pages,) * num_groups if isinstance(num_pages, int) else tuple(num_pages)
    if len(counts) != num_groups or min(counts) < 2:
        raise ValueError(f"need at least 2 pages (one is reserved) for each of {num_groups} KV groups, got {num_pages}")
    return counts


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
