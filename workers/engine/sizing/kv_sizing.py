"""How many KV pages an engine gets, and how that was decided (the line the engine logs at start).

In order: --num-pages as given; else --kv-cache-bytes, as given or, off CUDA, CPU_KV_CACHE_BYTES;
else, on CUDA, what gpu_memory_utilization's share of the device leaves once the engine's other needs
are measured (workers.engine.sizing.memory_profile).

A hybrid model's sliding-window groups (workers.engine.kv.spec) need far fewer pages than its
full-attention group: between steps a running request holds at most ceil(window / page_size) + 1 of
them, and during a step the pages of the chunk it computes (`window_group_pages`). Each window group
gets that many (never more than the full group), and the full group the rest of the bytes; the
sizes above are the full group's page counts.

Pages are sized from the specs' bytes per token, so --kv-cache-dtype fp8 (rows of e4m3 bytes and
their scales, workers.engine.kv.spec) gets about twice bf16's pages from the same bytes.
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
    group_num_pages: tuple[int, ...]  # per KV group
    page_size: int
    group_page_bytes: tuple[int, ...]  # of one page of each group, over its layers
    sized_by: str  # how, as the log says it: "from num_pages", "= 0.45 of 79.1 GiB − weights ..."

    @property
    def num_pages(self) -> int:
        """Of the full group, which holds every token."""
        return self.group_num_pages[0]

    @property
    def num_bytes(self) -> int:
        return sum(pages * page_bytes for pages, page_bytes in zip(self.group_num_pages, self.group_page_bytes))

    @property
    def num_tokens(self) -> int:
        """Tokens the usable pages hold (one page is reserved)."""
        return (self.num_pages - 1) * self.page_size

    def __str__(self) -> str:
        windows = (
            f", sliding windows of {list(self.group_num_pages[1:])} pages" if len(self.group_num_pages) > 1 else ""
        )
        return f"{self.num_tokens:,} tokens{windows} ({format_bytes(self.num_bytes)}) {self.sized_by}"


def window_group_pages(window: int, *, page_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The pages a sliding-window group can have in use at once, the reserved one included: each of
    max_num_seqs running requests holds the pages its window spans, ceil(window / page_size) + 1, and
    a step's chunks (max_num_batched_tokens tokens) take their pages, one more per request whose
    chunk straddles a page boundary."""
    per_request = -(-window // page_size) + 1
    chunks = -(-max_num_batched_tokens // page_size) + max_num_seqs
    return 1 + max_num_seqs * per_request + chunks


def _group_pages(
    specs: KVCacheSpecs, config: EngineConfig, num_bytes: int | None, num_pages: int | None
) -> tuple[int, ...]:
    """Pages per group: each window group's bound, and the full group `num_pages` or the bytes they leave."""
    args = config.args
    bounds = [
        window_group_pages(
            group.window,
            page_size=args.page_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        for group in specs.groups[1:]
    ]
    if num_pages is None:
        windows_bytes = sum(bound * group.page_bytes for bound, group in zip(bounds, specs.groups[1:]))
        num_pages = max(num_bytes - windows_bytes, 0) // specs.groups[0].page_bytes
        if any(bound > num_pages for bound in bounds):
            # The windows would hold more than the full group: every group gets as many pages.
            num_pages = num_bytes // specs.page_bytes
    return (num_pages, *(min(bound, num_pages) for bound in bounds))


def kv_cache_size(
    loaded: LoadedModel, config: EngineConfig, *, dtype: torch.dtype, device: torch.device
) -> KVCacheSize:
    """The size of the engine's KV cache; on CUDA, ValueError or RuntimeError naming
    gpu_memory_utilization when its share of the device cannot hold one."""
    args = config.args
    specs = KVCacheSpecs.of_model(
        loaded.config, dtype=dtype, page_size=args.page_size, kv_cache_dtype=args.kv_cache_dtype
    )

    def size(group_num_pages: tuple[int, ...], sized_by: str) -> KVCacheSize:
        return KVCacheSize(
            group_num_pages=tuple(max(pages, 2) for pages in group_num_pages),
            page_size=args.page_size,
            group_page_bytes=tuple(group.page_bytes for group in specs.groups),
            sized_by=sized_by,
        )

    if args.num_pages is not None:
        return size(_group_pages(specs, config, None, args.num_pages), "from num_pages")
    if args.kv_cache_bytes is not None or device.type != "cuda":
        num_bytes = args.kv_cache_bytes or CPU_KV_CACHE_BYTES
        sized_by = "from kv_cache_bytes" if args.kv_cache_bytes else f"from {format_bytes(num_bytes)} off CUDA"
        return size(_group_pages(specs, config, num_bytes, None), sized_by)
    memory = profile_device_memory(loaded, config, dtype=dtype, device=device)
    group_num_pages = _group_pages(specs, config, memory.kv_bytes(), None)
    if group_num_pages[0] < 2:
        raise ValueError(
            f"gpu_memory_utilization={args.gpu_memory_utilization:g} leaves {format_bytes(memory.kv_bytes())} for "
            f"the KV cache ({memory.describe()}), less than two pages of {format_bytes(specs.page_bytes)}"
        )
    sized_by = f"= {memory.describe()}"
    addressable = MAX_HEAD_ELEMENTS // max(group.head_page_elements for group in specs.groups)
    if group_num_pages[0] > addressable:
        group_num_pages = tuple(min(pages, addressable) for pages in group_num_pages)
        sized_by = f"(of {format_bytes(memory.kv_bytes())} {sized_by}: the attention kernels address no more pages)"
    kv_size = size(group_num_pages, sized_by)
    check_room(memory, kv_size.num_bytes, device)
    return kv_size
