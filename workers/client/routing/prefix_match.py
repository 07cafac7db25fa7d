"""Prefix match at the entrypoint: a prompt's hit length in the global KV store, from the index alone.

The prompt's blocks are keyed with the engine's own chain (workers.kvstore.block_hash) and the same `extra`
(model and cache namespace, see `namespace_extra`), then the index walks the chain to the first
absent key. No block data is read, so routing can weigh a request's real prefill work cheaply.

A prompt with images keys its blocks as the engine does (workers.kvstore.block_hash.image_block_extra):
each image's digest enters the extra of the block its first placeholder lies in and of every block
after it, so identical images in identical positions hit and different images never do. The
placeholders are found by the worker's image token (WorkerHeartbeat.image_token_id), the images' own
placeholder counts (ImageRef.num_tokens) telling where one image ends and the next begins.

A model with sliding-window layers uses a hit as its worker will (workers.kvstore.swa_replay): the
store keeps only the full-attention blocks, so the hit stands as it is only where a live worker holds
the SWA state at its end (one holder-index lookup of that end's window); otherwise it backs off one
block and prefill replays the window before it, which routing counts as work (`StoreHit.compute_from`).
"""

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from workers.kvstore.block_hash import (
    BlockHash,
    hash_chain,
    image_digest,
    image_hash_chain,
    image_placeholders,
    reusable_blocks,
)
from workers.kvstore.holders import HolderIndex
from workers.kvstore.index import BlockIndex
from workers.kvstore.swa_replay import SwaStateSource, swa_hit
from workers.kvstore.swa_window import window_keys
from workers.protocol.images import ImageRef
from workers.protocol.messages import SwaLayers


@dataclass(frozen=True, slots=True)
class StoreHit:
    hit_tokens: int  # prompt tokens the worker serves from the store (whole blocks)
    compute_from: int  # the first token prefill computes: hit_tokens, or earlier by a replayed window
    # The live workers that hold the SWA state at hit_tokens (a sliding-window model's hit that stands).
    holders: frozenset[str] = frozenset()

    @property
    def replayed_tokens(self) -> int:
        return self.hit_tokens - self.compute_from


@dataclass(frozen=True, slots=True)
class PromptImageKeys:
    """What a prompt's images add to its block keys: each image's first placeholder position
    (ascending) and its content hash as a block-extra digest."""

    starts: tuple[int, ...]
    digests: tuple[bytes, ...]

    @classmethod
    def of(
        cls, token_ids: Sequence[int] | np.ndarray, image_token_id: int, images: Sequence[ImageRef]
    ) -> "PromptImageKeys | None":
        """None when the prompt's placeholders do not add up to the images' (the worker refuses
        such a request, so it has no hit to weigh)."""
        try:
            _, starts = image_placeholders(token_ids, image_token_id, [image.num_tokens for image in images])
        except ValueError:
            return None
        return cls(
            starts=starts,
            digests=tuple(image_digest(image.content_hash) for image in images),
        )


def prompt_block_keys(
    token_ids: Sequence[int] | np.ndarray,
    block_tokens: int,
    extra: bytes,
    images: PromptImageKeys | None = None,
    *,
    max_blocks: int | None = None,
) -> list[BlockHash]:
    """The chained keys of the prompt's full blocks, as the engine keys them (with its images)."""
    if images is None:
        return hash_chain(token_ids, block_tokens, extra, max_blocks=max_blocks)
    return image_hash_chain(token_ids, block_tokens, extra, images.starts, images.digests, max_blocks=max_blocks)


def stored_prefix(
    index: BlockIndex,
    token_ids: Sequence[int] | np.ndarray,
    *,
    block_tokens: int,
    extra: bytes,
    images: PromptImageKeys | None = None,
) -> list[BlockHash]:
    """The keys of the prompt's blocks the store holds, from the first: whole blocks."""
    max_blocks = reusable_blocks(len(token_ids), block_tokens)
    keys = prompt_block_keys(token_ids, block_tokens, extra, images, max_blocks=max_blocks)
    return keys[: index.match_prefix(keys)]


def store_hit_tokens(
    index: BlockIndex,
    token_ids: Sequence[int] | np.ndarray,
    *,
    block_tokens: int,
    extra: bytes,
    images: PromptImageKeys | None = None,
) -> int:
    """Prompt tokens the store can serve: whole blocks from the start."""
    prefix = stored_prefix(index, token_ids, block_tokens=block_tokens, extra=extra, images=images)
    return len(prefix) * block_tokens


def swa_store_hit(
    prefix: Sequence[BlockHash],
    holders: HolderIndex | None,
    live: Collection[str],
    *,
    block_tokens: int,
    layers: SwaLayers,
) -> StoreHit:
    """The hit a sliding-window model's worker uses of the stored prefix `prefix` (its block keys): as
    it is when one of the `live` workers holds the SWA state at its end (by `holders`, None: no index
    to ask), else one block shorter, with the window before that replayed. One holder-index round
    trip, none when there is nothing to ask or no one live to find."""
    keys = window_keys(prefix, layers.window, block_tokens)
    found: frozenset[str] = frozenset()
    # A window of the query alone needs no state; with no stored prefix there is none to find.
    if keys and live and holders is not None:
        found = frozenset(holders.holders_of_all(keys)).intersection(live)
    source = SwaStateSource.REMOTE if found or not keys else SwaStateSource.NONE
    hit = swa_hit(
        len(prefix),
        source,
        block_tokens=block_tokens,
        window=layers.window,
        mode=layers.replay,
        num_swa_layers=layers.num_layers,
    )
    return StoreHit(hit.hit_tokens, hit.replay_start, found)
