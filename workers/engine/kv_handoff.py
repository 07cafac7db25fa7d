"""What a prefill engine hands a decode engine: a request's state after its first token, and its KV.

The sampler needs no state of its own here: a seeded row's draw depends only on its seed and the
number of tokens sampled so far (see sampler), and output_token_ids carries that count, so prefill
on one engine plus decode on another samples exactly what one engine would. A sampled request
without a seed of its own is given one at admission (engine.resumption.with_seed), so that holds
for every request.

A draining decode engine hands its running requests to another decode engine the same way (a
migration): the handoff of a request suspended between two decode steps has the same shape.

The KV travels in one of two ways (workers.transfer). As host copies, one tensor per layer, [planes,
heads, num_computed_tokens, width] (workers.engine.kv.spec: keys and values, or a latent):
token-major, independent of either engine's page size. The handoff names the layout of its KV
(`kv_layout`, the sender's KVCacheSpecs.layout), and a receiver whose cache is laid out otherwise
refuses it. `PagedLayers` copies a layer out of the prefill engine's pages only when it is read, so a
sender can ship layer i while layer i + 1 is still being copied; `write_layers` puts received
layers into the decode engine's pages. A hybrid model's layers are read from and written to their own
KV group's pages (workers.engine.kv.spec); a sliding-window layer's tokens behind its window, whose
pages were released, travel as zeros, which no query reads. Or page to page, between engines of one
host: the export names its pages (`pages`) and the decode side copies them straight into the pages it
reserved (LLMEngine.reservation); such a handoff carries no layers. A hybrid model's cache is one
tensor per group, which no peer maps: its KV always travels as layers (LLMEngine.info.kv_transfer).
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import overload

import torch

from kernels.attention import NULL_PAGE
from workers.engine.kv.kv_cache import KVCache
from workers.engine.kv.kv_pages import gather_tokens, scatter_tokens
from workers.engine.request import Request
from workers.protocol.errors import InvalidRequestError
from workers.protocol.images import ImageEmbeddings
from workers.protocol.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class KVHandoff:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # sampled by the prefill engine (the first token)
    params: SamplingParams
    # Tokens whose KV `layers` holds: every token but the last sampled one, whose KV decode computes.
    num_computed_tokens: int
    num_cached_tokens: int  # prompt tokens the prefill side served from a cache; reported by decode
    traffic_class: str
    cache_namespace: str
    # The model and dtype the KV was computed with (LLMEngine.kv_model_id): KV of another never fits.
    kv_model_id: str
    kv_dtype: torch.dtype
    kv_layout: str  # the sender's KVCacheSpecs.layout
    token_shape: tuple[int, int, int]  # of one token in one layer: (planes, heads, width)
    num_layers: int
    # Per layer: [planes, heads, num_computed_tokens, width] of kv_dtype, contiguous, on the CPU;
    # none when the KV goes page to page.
    layers: Sequence[torch.Tensor] = ()
    # The exporting engine's pages that hold the KV, in token order (an export only).
    pages: tuple[int, ...] = ()
    # From a draining decode engine (a migration) rather than a prefill engine.
    migrated: bool = False
    # A vision-language model's prompt images: the receiver keys the prompt's blocks with them and
    # recomputes the prompt with them after a preemption.
    images: tuple[ImageEmbeddings, ...] = ()

    @property
    def layer_shape(self) -> tuple[int, int, int, int]:
        planes, heads, width = self.token_shape
        return (planes, heads, self.num_computed_tokens, width)

    def materialized(self) -> "KVHandoff":
        """The same handoff with every layer copied out now (a PagedLayers reads pages lazily)."""
        return replace(self, layers=list(self.layers))


class PagedLayers(Sequence[torch.Tensor]):
    """A pinned request's KV, one layer copied to the host per read.

    Valid until the engine releases the request's pages (LLMEngine.release_transfer); reading a
    layer afterwards raises instead of returning whatever the reused pages then hold.
    """

    def __init__(
        self, kv_cache: KVCache, pages: list[int], num_tokens: int, *, window_pages: Sequence[list[int]] = ()
    ) -> None:
        """`pages`: the request's pages of the first KV group; `window_pages`: its page tables of the
        others (sliding windows), whose released pages (NULL_PAGE, which holds zeros) read as zeros:
        tokens no query of the receiver reads, which its own window releases at its first step."""
        groups = kv_cache.specs.groups
        if len({group.token_shape for group in groups}) != 1 or len(window_pages) != len(groups) - 1:
            raise ValueError(f"a handoff carries KV of one token shape, with a page table per group: {groups}")
        self._layers = kv_cache.layers
        self.dtype = kv_cache.storage_dtype
        self.layout = kv_cache.specs.layout
        self.token_shape = groups[0].token_shape
        indices = [torch.tensor(table, device=kv_cache.device) for table in (pages, *window_pages)]
        self._index_of_layer = [indices[group] for group in kv_cache.specs.group_of_layer]
        self._num_tokens = num_tokens
        self._closed = False

    def close(self) -> None:
        self._closed = True

    def __len__(self) -> int:
        return len(self._layers)

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, index: slice) -> list[torch.Tensor]: ...

    def __getitem__(self, index: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if self._closed:
            raise RuntimeError("the request's pages were released; export the KV before release_transfer")
        with torch.inference_mode():
            pages = self._index_of_layer[index]
            planes = [gather_tokens(plane, pages, self._num_tokens) for plane in self._layers[index]]
            # torch.stack makes a fresh contiguous tensor; on the CPU it is the only copy.
            return torch.stack(planes).to("cpu")


def export_handoff(request: Request, layers: "PagedLayers", kv_model_id: str) -> KVHandoff:
    """The handoff of a finished prefill, its KV read from the request's pages through `layers`."""
    return KVHandoff(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        output_token_ids=list(request.output_token_ids),
        params=request.params,
        num_computed_tokens=request.num_computed_tokens,
        num_cached_tokens=request.num_cached_tokens,
        traffic_class=request.traffic_class,
        cache_namespace=request.cache_namespace,
        kv_model_id=kv_model_id,
        kv_dtype=layers.dtype,
        kv_layout=layers.layout,
        token_shape=layers.token_shape,
        num_layers=len(layers),
        layers=layers,
        pages=tuple(request.pages),
        images=request.images.embeddings if request.images is not None else (),
    )


def check_handoff(handoff: KVHandoff, *, kv_model_id: str, vocab_size: int, max_tokens: int, kv_cache: KVCache) -> None:
    """That the handoff's model, tokens and KV layout fit an engine with this cache (the engine has
    checked the prompt and sampling params); else InvalidRequestError. Its layers, if any, are
    checked by check_layers."""
    name = handoff.request_id
    if handoff.kv_model_id != kv_model_id:
        raise InvalidRequestError(
            f"handoff {name!r} holds KV of {handoff.kv_model_id!r}; this engine serves {kv_model_id!r}"
        )
    prompt, output = handoff.prompt_token_ids, handoff.output_token_ids
    if not output or any(not isinstance(t, int) or not 0 <= t < vocab_size for t in output):
        raise InvalidRequestError(f"handoff {name!r} needs its sampled tokens, each in [0, {vocab_size})")
    if len(output) >= max_tokens:
        raise InvalidRequestError(
            f"handoff {name!r} already has {len(output)} of its {max_tokens} tokens: nothing to decode"
        )
    num_tokens = len(prompt) + len(output)
    if handoff.num_computed_tokens != num_tokens - 1:
        raise InvalidRequestError(
            f"handoff {name!r} has KV for {handoff.num_computed_tokens} tokens; "
            f"its {num_tokens} tokens need KV for all but the last ({num_tokens - 1})"
        )
    if not 0 <= handoff.num_cached_tokens <= len(prompt):
        raise InvalidRequestError(
            f"handoff {name!r} reports {handoff.num_cached_tokens} cached tokens for a prompt of {len(prompt)}"
        )
    ours = kv_cache.specs
    if handoff.kv_layout != ours.layout:
        raise InvalidRequestError(
            f"handoff {name!r} holds KV laid out as {handoff.kv_layout!r}; this engine's cache holds {ours.layout!r}"
        )
    shape = (handoff.num_layers, handoff.kv_dtype, tuple(handoff.token_shape))
    if shape != (ours.num_layers, kv_cache.storage_dtype, ours.groups[0].token_shape):
        raise InvalidRequestError(
            f"handoff {name!r} has {handoff.num_layers} layers of {handoff.kv_dtype} {handoff.token_shape} per token, "
            f"which is not its layout {handoff.kv_layout!r}"
        )


def check_layers(handoff: KVHandoff) -> list[torch.Tensor]:
    """The handoff's host layers, each of the shape and dtype the handoff says; else InvalidRequestError."""
    name = handoff.request_id
    layers = list(handoff.layers)
    if len(layers) != handoff.num_layers:
        raise InvalidRequestError(f"handoff {name!r} has {len(layers)} layers of KV; it says {handoff.num_layers}")
    for index, layer in enumerate(layers):
        if (
            not isinstance(layer, torch.Tensor)
            or layer.dtype != handoff.kv_dtype
            or tuple(layer.shape) != handoff.layer_shape
        ):
            got = f"{layer.dtype} {tuple(layer.shape)}" if isinstance(layer, torch.Tensor) else type(layer).__name__
            raise InvalidRequestError(
                f"handoff {name!r} layer {index} is {got}; expected {handoff.kv_dtype} {handoff.layer_shape}"
            )
    return layers


@torch.inference_mode()
def write_layers(
    kv_cache: KVCache,
    pages: list[int],
    layers: Sequence[torch.Tensor],
    *,
    start: int,
    window_pages: Sequence[list[int]] = (),
) -> None:
    """Write tokens [start, num_computed_tokens) of `layers` into the request's `pages` (all of them,
    from the first; `start` is page-aligned: the pages before it came from the prefix cache) and, for
    the layers of further KV groups, into its `window_pages` tables from their first page that is not
    NULL_PAGE (those before lie behind the window; the others were all given fresh)."""
    page_size = kv_cache.page_size
    firsts, indices = [], []
    for group, table in enumerate((pages, *window_pages)):
        skip = start // page_size if group == 0 else 0
        first = next((i for i in range(skip, len(table)) if table[i] != NULL_PAGE), len(table))
        firsts.append(first * page_size)
        indices.append(torch.tensor(table[first:], device=kv_cache.device))
    for group, planes, layer in zip(kv_cache.specs.group_of_layer, kv_cache.layers, layers, strict=True):
        for plane, data in zip(planes, layer, strict=True):
            scatter_tokens(plane, indices[group], data[:, firsts[group] :])
