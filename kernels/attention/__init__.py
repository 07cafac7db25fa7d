"""Paged attention backends (see backend.AttentionBackend): each builds its own per-step metadata
and is called as (query, k_cache, v_cache, metadata, scale=, window=, sinks=)."""

import functools
import importlib
import importlib.util
from collections.abc import Callable

import torch

from kernels.attention.backend import AttentionBackend, DeviceStepTensors, StepBatch, layer_metadata
from kernels.attention.paged import NULL_PAGE, write_kv
from kernels.attention.torch_common.metadata import AttentionMetadata
from kernels.attention.torch_sdpa import paged_attention_sdpa

PagedAttention = Callable[..., torch.Tensor]

# Backend classes by name, as "module:Class" so that Triton is imported only when it is used.
BACKENDS: dict[str, str] = {
    "torch_blockwise": "kernels.attention.torch_blockwise.backend:TorchBlockwiseBackend",
    "torch_sdpa": "kernels.attention.torch_sdpa.backend:TorchSdpaBackend",
    "triton": "kernels.attention.triton.backend:TritonBackend",
}
# The backends that run on any device with torch alone.
TORCH_BACKENDS = ("torch_blockwise", "torch_sdpa")


def default_backend(device: torch.device) -> str:
    """The Triton kernels on CUDA (torch's SDPA where Triton is missing). On the CPU the blockwise
    reference: batch-invariant by construction and, with its 128-key blocks, faster than SDPA padded
    to its 512-key split for the short contexts a CPU serves."""
    if device.type != "cuda":
        return "torch_blockwise"
    return "triton" if importlib.util.find_spec("triton") is not None else "torch_sdpa"


def get_backend(name: str) -> AttentionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention_backend {name!r}; available: {sorted(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)()
    except ImportError as error:
        raise ValueError(f"attention_backend {name!r} is not available here: {error}") from None


@functools.cache
def sdpa_is_batch_invariant() -> bool:
    """Whether the SDPA backend gives bitwise-equal rows alone, batched, decoded and prefilled,
    with and without a window, on this torch build (it relies on the CPU kernel's key split)."""
    return all(
        batch_invariant(paged_attention_sdpa, window=window, seed=seed) for window in (None, 37) for seed in (0, 1)
    )


def batch_invariant(attend: PagedAttention, *, window: int | None, seed: int) -> bool:
    """One 700-token sequence's rows computed as a one-shot prefill, as a chunk, as a lone decode and
    as a decode among longer and shorter sequences: are they bitwise equal?"""
    generator = torch.Generator().manual_seed(seed)
    kv_heads, heads, head_dim, page, length = 2, 6, 16, 16, 700
    pages = -(-length // page)
    k_cache = torch.randn(kv_heads, 4 * pages + 1, page, head_dim, generator=generator)
    v_cache = torch.randn_like(k_cache).uniform_(-1, 1, generator=generator)
    query = torch.randn(length, heads, head_dim, generator=generator)
    table = list(range(1, pages + 1))

    def run(query_lens: list[int], seq_lens: list[int], tables: list[list[int]], rows: torch.Tensor) -> torch.Tensor:
        metadata = AttentionMetadata.build(
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=tables,
            page_size=page,
            device=torch.device("cpu"),
        )
        return attend(rows, k_cache, v_cache, metadata, scale=0.25, window=window)

    full = run([length], [length], [table], query)
    chunk = run([40], [530], [table], query[490:530])
    alone = run([1], [600], [table], query[599:600])
    others = [list(range(pages + 1, 2 * pages + 1)), list(range(2 * pages + 1, 3 * pages + 1))]
    mixed_rows = torch.cat([query[10:11], query[599:600], query[20:21]])
    mixed = run([1, 1, 1], [length, 600, 9], [others[0], table, others[1]], mixed_rows)
    return torch.equal(chunk, full[490:530]) and torch.equal(alone[0], full[599]) and torch.equal(mixed[1], full[599])


__all__ = [
    "BACKENDS",
    "TORCH_BACKENDS",
    "AttentionBackend",
    "DeviceStepTensors",
    "StepBatch",
    "NULL_PAGE",
    "AttentionMetadata",
    "PagedAttention",
    "batch_invariant",
    "default_backend",
    "get_backend",
    "layer_metadata",
    "sdpa_is_batch_invariant",
    "write_kv",
]
