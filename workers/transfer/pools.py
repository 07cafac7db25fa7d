"""KV pools: an engine's whole KV cache (KVCache.pages, one tensor) mapped by another worker on the same
host, so that a request's pages are copied device to device (CUDA IPC) or memory to memory (a CPU
cache in shared memory) instead of travelling as frames through host memory and ZMQ.

The exporting side describes its pool once (`PoolExport.of`) and offers a request's pages in it with
each transfer (`PoolExport.offer`). The receiving side maps each pool once (`PoolMaps.open`, cached by
pool id; a worker's older pools are unmapped when it offers a new one) after checking that the handle
maps at least the bytes the offer's shape says, so no offer makes it read past the memory it mapped;
`usable` says whether an offer can be mapped here at all (same host, a visible device), else the
caller asks for frames.

Same host means the same running kernel: its boot id (`host_id`). Containers of one host share it,
and CUDA IPC and /proc/<pid>/fd work between them only when they share the GPU and a PID namespace:
where mapping fails the caller falls back to frames too.
"""

import logging
import math
import os
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from functools import cache

import torch

from workers.engine.dtypes import KV_STORAGE_DTYPES, kv_storage_name
from workers.engine.kv.kv_cache import SHARED_MEMORY_NAME, KVCache
from workers.protocol.messages import CudaIpcHandle, HostMemoryHandle, KVPoolOffer

log = logging.getLogger(__name__)

CUDA_IPC, HOST_MEMORY = "cuda_ipc", "host_memory"  # the backends, as metrics and logs name them
MAX_MAPPED_POOLS = 16  # the oldest mapping is dropped past this many (one per prefill worker seen)


class PoolError(Exception):
    """An offer that cannot be mapped or does not describe what it maps."""


@cache
def host_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as boot_id:
        return boot_id.read().strip()


def backend_of(offer: KVPoolOffer) -> str:
    return CUDA_IPC if isinstance(offer.handle, CudaIpcHandle) else HOST_MEMORY


@dataclass(frozen=True, slots=True)
class PoolExport:
    """An engine's KV cache as other processes of this host map it; None from `of` when it cannot be
    (a CPU cache not allocated shareable)."""

    exporter: str
    pool_id: str
    handle: CudaIpcHandle | HostMemoryHandle
    shape: tuple[int, int, int, int, int, int]
    dtype: str
    kv_layout: str  # KVCacheSpecs.layout

    @classmethod
    def of(cls, kv_cache: KVCache, exporter: str) -> "PoolExport | None":
        pages = kv_cache.pages
        if pages.device.type == "cuda":
            handle = _cuda_ipc_handle(pages)
        elif kv_cache.shared_memory is not None:
            memory = kv_cache.shared_memory
            handle = HostMemoryHandle(pid=memory.pid, fd=memory.fd, num_bytes=memory.num_bytes)
        else:
            return None
        pool_id = f"{exporter}/{uuid.uuid4().hex}"
        return cls(exporter, pool_id, handle, tuple(pages.shape), kv_storage_name(pages.dtype), kv_cache.specs.layout)

    def offer(self, pages: list[int], hold_s: float) -> KVPoolOffer:
        """An offer of `pages`, which the exporter keeps pinned for `hold_s` from now at least."""
        return KVPoolOffer(
            exporter=self.exporter,
            pool_id=self.pool_id,
            host_id=host_id(),
            handle=self.handle,
            shape=self.shape,
            dtype=self.dtype,
            kv_layout=self.kv_layout,
            pages=pages,
            expires_at=time.monotonic() + hold_s,
        )


class PoolMaps:
    """The pools this worker has mapped, by pool id, most recently used last."""

    def __init__(self, max_pools: int = MAX_MAPPED_POOLS) -> None:
        self.max_pools = max_pools
        self._pools: OrderedDict[str, tuple[str, torch.Tensor]] = OrderedDict()  # pool id → (exporter, tensor)

    def __len__(self) -> int:
        """Pools mapped now."""
        return len(self._pools)

    def usable(self, offer: KVPoolOffer) -> str:
        """ "" when `offer` can be mapped in this process, else why not (another host, no such device)."""
        if offer.host_id != host_id():
            return "the pool is on another host"
        if isinstance(offer.handle, CudaIpcHandle) and _device_index(offer.handle.device_uuid) is None:
            return f"GPU {offer.handle.device_uuid} is not visible to this worker"
        return ""

    def open(self, offer: KVPoolOffer, kv_layout: str) -> torch.Tensor:
        """The offer's pool tensor, mapped once; PoolError when it is not laid out as `kv_layout` (the
        receiving cache's), cannot be mapped, or its handle maps fewer bytes than its shape needs."""
        check_layout(offer, kv_layout)
        mapped = self._pools.get(offer.pool_id)
        if mapped is not None:
            self._pools.move_to_end(offer.pool_id)
            return mapped[1]
        dtype = KV_STORAGE_DTYPES.get(offer.dtype)
        if dtype is None:
            raise PoolError(f"unknown dtype {offer.dtype!r}; choose from {sorted(KV_STORAGE_DTYPES)}")
        if len(offer.shape) != 6 or any(size < 1 for size in offer.shape) or offer.shape[1] not in (1, 2):
            raise PoolError(f"pool shape {offer.shape} is not [layers, 1 or 2 planes, heads, pages, page_size, width]")
        numel = math.prod(offer.shape)
        try:
            if isinstance(offer.handle, CudaIpcHandle):
                pool = _open_cuda_ipc(offer.handle, dtype, numel)
            else:
                pool = _open_host_memory(offer.handle, dtype, numel)
        except (OSError, RuntimeError) as error:
            raise PoolError(f"mapping pool {offer.pool_id} failed: {error}") from None
        pool = pool.view(offer.shape)
        for pool_id in [pid for pid, (exporter, _) in self._pools.items() if exporter == offer.exporter]:
            del self._pools[pool_id]  # the exporter restarted: its old pool is gone
        self._pools[offer.pool_id] = (offer.exporter, pool)
        while len(self._pools) > self.max_pools:
            self._pools.popitem(last=False)
        log.info("mapped KV pool %s (%s, %d bytes)", offer.pool_id, backend_of(offer), numel * dtype.itemsize)
        return pool


def check_layout(offer: KVPoolOffer, kv_layout: str) -> None:
    """PoolError unless the offered pool is laid out as `kv_layout` (the receiving cache's)."""
    if offer.kv_layout != kv_layout:
        raise PoolError(f"the pool holds KV laid out as {offer.kv_layout!r}; this worker's cache holds {kv_layout!r}")


def _cuda_ipc_handle(pages: torch.Tensor) -> CudaIpcHandle:
    storage = pages.untyped_storage()
    (
        device,
        handle,
        storage_size_bytes,
        storage_offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = storage._share_cuda_()
    return CudaIpcHandle(
        device_uuid=str(torch.cuda.get_device_properties(device).uuid),
        handle=handle,
        storage_size_bytes=storage_size_bytes,
        storage_offset_bytes=storage_offset_bytes,
        ref_counter_handle=ref_counter_handle,
        ref_counter_offset=ref_counter_offset,
        event_handle=event_handle,
        event_sync_required=event_sync_required,
        tensor_offset=pages.storage_offset(),
    )


def _device_index(device_uuid: str) -> int | None:
    if not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device_uuid:
            return index
    return None


def _open_cuda_ipc(handle: CudaIpcHandle, dtype: torch.dtype, numel: int) -> torch.Tensor:
    if (handle.tensor_offset + numel) * dtype.itemsize > handle.storage_size_bytes or handle.tensor_offset < 0:
        raise PoolError(
            f"the pool's handle maps {handle.storage_size_bytes} bytes; its shape needs "
            f"{(handle.tensor_offset + numel) * dtype.itemsize}"
        )
    device = _device_index(handle.device_uuid)
    if device is None:
        raise PoolError(f"GPU {handle.device_uuid} is not visible to this worker")
    torch.cuda.init()
    storage = torch.UntypedStorage._new_shared_cuda(
        device,
        handle.handle,
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle,
        handle.event_sync_required,
    )
    return torch.empty(0, dtype=dtype, device=f"cuda:{device}").set_(storage, handle.tensor_offset, (numel,))


def _open_host_memory(handle: HostMemoryHandle, dtype: torch.dtype, numel: int) -> torch.Tensor:
    path = f"/proc/{handle.pid}/fd/{handle.fd}"
    # A process that reused a dead exporter's pid holds something else under that descriptor.
    if not os.readlink(path).startswith(f"/memfd:{SHARED_MEMORY_NAME}"):
        raise PoolError(f"{path} is not a KV cache's memory")
    needed = numel * dtype.itemsize
    size = os.stat(path).st_size
    if needed > size or needed > handle.num_bytes:
        raise PoolError(f"the pool's memory holds {size} bytes; its shape needs {needed}")
    return torch.from_file(path, shared=True, size=numel, dtype=dtype)
