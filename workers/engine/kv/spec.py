"""KV cache specs: what one group of layers keeps per token, from which every holder of KV (the device
cache, the block manager, the store's block files, the handoff) sizes and lays out its data.

A model's layers fall into groups, each keeping its KV one way (KVCacheSpec.kind), and every group
keeps per token and layer `planes` × `heads` × `width` values, so that one layout serves them all:
- full attention: every token's keys and values, 2 planes (key, value) of kv_heads heads of head_dim;
- sliding window: the same per token, but a query reads only the last `window` tokens, so pages
  that fall out of the window go back to the pool, and the group is not stored globally (its state
  stays with the worker that computed it);
- latent (MLA): one latent vector of `latent_width` per token and layer, read by every query head:
  1 plane of 1 head of latent_width.

`KVCacheSpec.layout` is the spec's fingerprint, a short readable string: stored blocks and transfers
record it, and a reader whose layout differs refuses the data instead of misreading its bytes.

Storage (`--kv-cache-dtype`): "auto" keeps each head's `width` values in `dtype`; "fp8" keeps each
as one uint8 row of kernels.attention.fp8_kv.row_bytes(width) (e4m3 values, then their float32
scales), so pages, runs and frames are uint8 of `row_width` and hold about twice the tokens of bf16.
`dtype` stays the compute dtype: what the attention kernels dequantize to and produce. The layout
names the storage, so a bf16 reader refuses fp8 data and the other way round.

A model's groups (KVCacheSpecs.of_model):
- multi-head latent attention (ModelConfig.mla): one latent group of every layer;
- a hybrid model, some layers windowed (ModelConfig.layer_windows) and some not: a full-attention group
  of the unwindowed layers first (its pages are the ones the prefix cache and the store key), then one
  sliding-window group per distinct window, whose pages behind the window go back to its pool;
- else one full-attention group of every layer. That includes a model whose every layer slides: its
  windowed layers keep every token in the device cache and only mask what they read. With no full
  group, nothing would hold a prompt's KV beyond the last window, so neither the prefix cache nor the
  store could serve a hit of it, nor a handoff carry it; keeping every token keeps all three working
  for the price of memory such models (Mistral-7B-v0.1's era) were sized for anyway.
"""

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.attention.fp8_kv import row_bytes, scale_group
from workers.args import KV_CACHE_DTYPES
from workers.engine.config import ModelConfig


class KVKind(enum.StrEnum):
    FULL = "full attention"
    SLIDING_WINDOW = "sliding window"
    LATENT = "latent"


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    kind: KVKind
    layers: tuple[int, ...]  # the model's layer indices in this group, ascending
    dtype: torch.dtype
    page_size: int  # tokens per page
    num_kv_heads: int = 0  # full attention and sliding window
    head_dim: int = 0
    window: int | None = None  # sliding window: tokens a query reads, itself included
    latent_width: int = 0  # latent
    fp8: bool = False  # stored as FP8 rows (kernels.attention.fp8_kv) instead of `dtype`

    def __post_init__(self) -> None:
        if not self.layers or list(self.layers) != sorted(set(self.layers)) or self.layers[0] < 0:
            raise ValueError(f"a KV group's layers must be distinct, ascending indices, got {self.layers}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if self.kind is KVKind.LATENT:
            if self.latent_width < 1 or self.num_kv_heads or self.head_dim:
                raise ValueError(f"a latent KV group has a positive latent_width and no heads, got {self}")
        elif self.num_kv_heads < 1 or self.head_dim < 1 or self.latent_width:
            raise ValueError(f"a {self.kind} KV group has positive num_kv_heads and head_dim, got {self}")
        if (self.kind is KVKind.SLIDING_WINDOW) != (self.window is not None) or (
            self.window is not None and self.window < 1
        ):
            raise ValueError(f"a sliding-window KV group, and only one, has a positive window, got {self}")
        if self.fp8 and not self.dtype.is_floating_point:
            raise ValueError(f"an FP8 KV cache dequantizes to a floating compute dtype, got {self.dtype}")
        if self.fp8 and self.width % 4:
            raise ValueError(
                f"kv_cache_dtype='fp8' keeps a head's values with float32 scales beside them, so its width must be a "
                f"multiple of 4; this {self.kind} KV group's is {self.width}"
            )

    @property
    def planes(self) -> int:
        """Tensors a layer keeps per token: 2 (key, value), or 1 (the latent)."""
        return 1 if self.kind is KVKind.LATENT else 2

    @property
    def heads(self) -> int:
        """Heads of each plane: the KV heads, or 1 (the latent, read by every query head)."""
        return 1 if self.kind is KVKind.LATENT else self.num_kv_heads

    @property
    def width(self) -> int:
        """Values of one head of one plane: head_dim, or latent_width."""
        return self.latent_width if self.kind is KVKind.LATENT else self.head_dim

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype of the page tensors, runs and frames: uint8 rows for FP8, else `dtype`."""
        return torch.uint8 if self.fp8 else self.dtype

    @property
    def row_width(self) -> int:
        """Elements of storage_dtype one head of one plane takes per token: FP8's row bytes, or width."""
        return row_bytes(self.width) if self.fp8 else self.width

    @property
    def token_shape(self) -> tuple[int, int, int]:
        """The stored KV of one token in one layer: [planes, heads, row_width]."""
        return (self.planes, self.heads, self.row_width)

    @property
    def bytes_per_token_per_layer(self) -> int:
        return math.prod(self.token_shape) * torch.empty((), dtype=self.storage_dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """Over the group's layers."""
        return self.bytes_per_token_per_layer * len(self.layers)

    @property
    def page_bytes(self) -> int:
        """One page over the group's layers."""
        return self.bytes_per_token * self.page_size

    @property
    def head_page_elements(self) -> int:
        """Elements of one page of one KV head (of the latent): the attention kernels address a head's
        pages with 32-bit offsets of page id × this."""
        return self.page_size * self.row_width

    @property
    def stored_globally(self) -> bool:
        """Whether the global store keeps this group's blocks: a sliding window's state is kept by the
        worker that computed it, never in the store."""
        return self.kind is not KVKind.SLIDING_WINDOW

    def run_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """A token-major run of the group's KV (a store block, a handoff): [layers, planes, heads,
        tokens, row_width], of storage_dtype."""
        return (len(self.layers), self.planes, self.heads, num_tokens, self.row_width)

    def pages_shape(self, num_pages: int) -> tuple[int, int, int, int, int, int]:
        """The group's pages in the device cache: [layers, planes, heads, num_pages, page_size,
        row_width], of storage_dtype."""
        return (len(self.layers), self.planes, self.heads, num_pages, self.page_size, self.row_width)

    @property
    def layout(self) -> str:
        """The fingerprint a stored block or a transfer records: kind, layers, per-token shape, dtype
        and storage (not the page size, which token-major data does not depend on)."""
        kind = f"{self.kind} {self.window}" if self.window is not None else str(self.kind)
        if self.kind is KVKind.LATENT:
            shape = f"a latent of {self.latent_width}"
        else:
            shape = f"{self.num_kv_heads} KV heads of {self.head_dim}"
        dtype = str(self.dtype).removeprefix("torch.")
        if self.fp8:
            dtype += f" as fp8 e4m3 rows of {self.row_width} bytes, a float32 scale per {scale_group(self.width)}"
        return f"{kind} of layers {_ranges(self.layers)}: {shape} ({dtype})"


@dataclass(frozen=True, slots=True)
class KVCacheSpecs:
    """A model's KV groups. The first one's pages are the request's `pages`, which the prefix cache and
    the store key by block hash."""

    groups: tuple[KVCacheSpec, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a KV cache needs at least one group of layers")
        layers = sorted(layer for group in self.groups for layer in group.layers)
        if layers != list(range(len(layers))):
            raise ValueError(f"KV groups must cover layers 0..n-1 once each, got {[g.layers for g in self.groups]}")
        if len({group.page_size for group in self.groups}) != 1:
            raise ValueError("every KV group has the same page size")

    @classmethod
    def of_model(
        cls, config: ModelConfig, *, dtype: torch.dtype, page_size: int, kv_cache_dtype: str = "auto"
    ) -> "KVCacheSpecs":
        """The groups of a model (see the module docstring); kv_cache_dtype: "auto" or "fp8"."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose from {list(KV_CACHE_DTYPES)}")
        fp8 = kv_cache_dtype == "fp8"
        layers = range(config.num_layers)
        if config.mla is not None:
            return cls((latent(layers, config.mla.latent_width, dtype=dtype, page_size=page_size, fp8=fp8),))
        windows = config.layer_windows
        unwindowed = [layer for layer in layers if windows[layer] is None]
        if not unwindowed or len(unwindowed) == config.num_layers:
            return cls((full_attention(layers, config, dtype=dtype, page_size=page_size, fp8=fp8),))
        groups = [full_attention(unwindowed, config, dtype=dtype, page_size=page_size, fp8=fp8)]
        for window in sorted({w for w in windows if w is not None}):
            windowed = [layer for layer in layers if windows[layer] == window]
            groups.append(sliding_window(windowed, window, config, dtype=dtype, page_size=page_size, fp8=fp8))
        return cls(tuple(groups))

    @property
    def num_layers(self) -> int:
        return sum(len(group.layers) for group in self.groups)

    @property
    def page_size(self) -> int:
        return self.groups[0].page_size

    @property
    def page_bytes(self) -> int:
        """One page of every group."""
        return sum(group.page_bytes for group in self.groups)

    @property
    def bytes_per_token(self) -> int:
        return sum(group.bytes_per_token for group in self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per group, the tokens a query reads (None: all): what the block manager keeps pages for."""
        return tuple(group.window for group in self.groups)

    @property
    def layout(self) -> str:
        return "; ".join(group.layout for group in self.groups)

    @property
    def group_of_layer(self) -> tuple[int, ...]:
        """Per layer, the index of its group: which block table and slots its attention uses."""
        group_of = {layer: index for index, group in enumerate(self.groups) for layer in group.layers}
        return tuple(group_of[layer] for layer in range(self.num_layers))


def full_attention(
    layers: Sequence[int], config: ModelConfig, *, dtype: torch.dtype, page_size: int, fp8: bool = False
) -> KVCacheSpec:
    return KVCacheSpec(
        kind=KVKind.FULL,
        layers=tuple(layers),
        dtype=dtype,
        page_size=page_size,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        fp8=fp8,
    )


def sliding_window(
    layers: Sequence[int], window: int, config: ModelConfig, *, dtype: torch.dtype, page_size: int, fp8: bool = False
) -> KVCacheSpec:
    return KVCacheSpec(
        kind=KVKind.SLIDING_WINDOW,
        layers=tuple(layers),
        dtype=dtype,
        page_size=page_size,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        window=window,
        fp8=fp8,
    )


def latent(
    layers: Sequence[int], latent_width: int, *, dtype: torch.dtype, page_size: int, fp8: bool = False
) -> KVCacheSpec:
    return KVCacheSpec(
        kind=KVKind.LATENT,
        layers=tuple(layers),
        dtype=dtype,
        page_size=page_size,
        latent_width=latent_width,
        fp8=fp8,
    )


def _ranges(layers: Sequence[int]) -> str:
    """ "0-2, 5, 7-8" for layers 0, 1, 2, 5, 7, 8."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)
