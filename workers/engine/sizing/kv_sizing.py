"""How many KV pages an engine gets, and how that was decided (the line the engine logs at start).

In order: --num-pages as given; else --kv-cache-bytes, as given or, off CUDA, CPU_KV_CACHE_BYTES;
else, on CUDA, what gpu_memory_utilization's share of the device leaves once the engine's other needs
are measured (workers.engine.sizing.memory_profile).
"""

from dataclasses import dataclass

import torch

from workers.args import CPU_KV_CACHE_BYTES
from workers.engine.config import EngineConfig
from workers.engine.kv.spec import KVCacheSpecs
from workers.engine.model_loader import LoadedModel
from workers.engine.sizing.memory_profile import check_room, format_bytes, profile_device_memory

# The Triton attention kernels address a KV head's pages with 32-bit offsets (page id × page_size ×
# head_dim): a small model's cache sized from a large device stops short of that.
MAX_HEAD_ELEMENTS = 2**31 - 1


@dataclass(frozen=True, slots=True)
class KVCacheSize:
    num_pages: int
    page_size: int
    page_bytes: int  # of one page over every layer
    sized_by: str  # how, as the log says it: "from num_pages", "= 0.45 of 79.1 GiB − weights ..."

    @property
    def num_tokens(self) -> int:
        """Tokens the usable pages hold (one page is reserved)."""
        return (self.num_pages - 1) * self.page_size

    def __str__(self) -> str:
        return f"{self.num_tokens:,} tokens ({format_bytes(self.num_pages * self.page_bytes)}) {self.sized_by}"


def kv_cache_size(
    loaded: LoadedModel, config: EngineConfig, *, dtype: torch.dtype, device: torch.device
) -> KVCacheSize:
    """The size of the engine's KV cache; on CUDA, ValueError or RuntimeError naming
    gpu_memory_utilization when its share of the device cannot hold one."""
    args = config.args
    specs = KVCacheSpecs.of_model(loaded.config, dtype=dtype, page_size=args.page_size)
    page_bytes = specs.page_bytes

    def size(num_pages: int, sized_by: str) -> KVCacheSize:
        return KVCacheSize(num_pages=num_pages, page_size=args.page_size, page_bytes=page_bytes, sized_by=sized_by)

    if args.num_pages is not None:
        return size(args.num_pages, "from num_pages")
    if args.kv_cache_bytes is not None or device.type != "cuda":
        num_bytes = args.kv_cache_bytes or CPU_KV_CACHE_BYTES
        sized_by = "from kv_cache_bytes" if args.kv_cache_bytes else f"from {format_bytes(num_bytes)} off CUDA"
        num_pages = max(num_bytes // page_bytes, 2)
        return size(num_pages, sized_by)
    memory = profile_device_memory(loaded, config, dtype=dtype, device=device)
    num_pages = memory.kv_bytes() // page_bytes
    if num_pages < 2:
        raise ValueError(
            f"gpu_memory_utilization={args.gpu_memory_utilization:g} leaves {format_bytes(memory.kv_bytes())} for "
            f"the KV cache ({memory.describe()}), less than two pages of {format_bytes(page_bytes)}"
        )
    sized_by = f"= {memory.describe()}"
    addressable = MAX_HEAD_ELEMENTS // max(group.head_page_elements for group in specs.groups)
    if num_pages > addressable:
        num_pages = addressable
        sized_by = f"(of {format_bytes(memory.kv_bytes())} {sized_by}: the attention kernels address no more pages)"
    check_room(memory, num_pages * page_bytes, device)
    return size(num_pages, sized_by)
