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
    def token_shape(self) -> tuple[int, int, int]:
        """The KV of one token in one layer: [planes, heads, width]."""
        return (self.planes, self.heads, self.width)

    @property
    def bytes_per_token_per_layer(self) -> int:
        return math.prod(self.token_shape) * torch.empty((), dtype=self.dtype).element_size()

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
        return self.page_size * self.width

    @property
    def stored_globally(self) -> bool:
        """Whether the global store keeps this group's blocks: a sliding window's state is kept by the
        worker that computed it, never in the store."""
        return self.kind is not KVKind.SLIDING_WINDOW

    def run_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """A token-major run of the group's KV (a store block, a handoff): [layers, planes, heads,
        tokens, width]."""
        return (len(self.layers), self.planes, self.heads, num_tokens, self.width)

    def pages_shape(self, num_pages: int) -> tuple[int, int, int, int, int, int]:
        """The group's pages in the device cache: [layers, planes, heads, num_pages, page_size, width]."""
        return (len(self.layers), self.planes, self.heads, num_pages, self.page_size, self.width)

    @property
    def layout(self) -> str:
        """The fingerprint a stored block or a transfer records: kind, layers, per-token shape, dtype
        (not the page size, which token-major data does not depend on)."""
        kind = f"{self.kind} {self.window}" if self.window is not None else str(self.kind)
        if self.kind is KVKind.LATENT:
            shape = f"a latent of {self.latent_width}"
        else:
            shape = f"{self.num_kv_heads} KV heads of {self.head_dim}"
        return f"{kind} of layers {_ranges(self.layers)}: {shape} ({str(self.dtype).removeprefix('torch.')})"


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
    def of_model(cls, config: ModelConfig, *, dtype: torch.dtype, page_size: int) -> "KVCacheSpecs":
        """The groups of a model (see the module docstring)."""
        layers = range(config.num_layers)
        if config.mla is not None:
            return cls((latent(layers, config.mla.latent_width, dtype=dtype, page_size=page_size),))
        windows = config.layer_windows
        unwindowed = [layer for layer in layers if windows[layer] is None]
        if not unwindowed or len(unwindowed) == config.num_layers:
            return cls((full_attention(layers, config, dtype=dtype, page_size=page_size),))
        groups = [full_attention(unwindowed, config, dtype=dtype, page_size=page_size)]
        for window in sorted({w for w in windows if w is not None}):
            windowed = [layer for layer in layers if windows[layer] == window]
            groups.append(sliding_window(windowed, window, config, dtype=dtype, page_size=page_size))
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


def full_attention(layers: Sequence[int], config: ModelConfig, *, dtype: torch.dtype, page_size: int) -> KVCacheSpec:
    return KVCacheSpec(
        kind=KVKind.FULL,
        layers=tuple(layers),
        dtype=dtype,
        page_size=page_size,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
    )


def sliding_window(
    layers: Sequence[int], window: int, config: ModelConfig, *, dtype: torch.dtype, page_size: int
) -> KVCacheSpec:
    return KVCacheSpec(
        kind=KVKind.SLIDING_WINDOW,
        layers=tuple(layers),
        dtype=dtype,
        page_size=page_size,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        window=window,
    )


def latent(layers: Sequence[int], latent_width: int, *, dtype: torch.dtype, page_size: int) -> KVCacheSpec:
    return KVCacheSpec(
        kind=KVKind.LATENT, layers=tuple(layers), dtype=dtype, page_size=page_size, latent_width=latent_width
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
