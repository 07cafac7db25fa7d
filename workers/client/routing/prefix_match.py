"""Prefix match at the entrypoint: a prompt's hit length in the global KV store, from the index alone.

The prompt's blocks are keyed with the engine's own chain (workers.kvstore.block_hash) and the same `extra`
(model and cache namespace, see `namespace_extra`), then the index walks the chain to the first
absent key. No block data is read, so routing can weigh a request's real prefill work cheaply.

A model with sliding-window layers uses a hit as its worker will (workers.kvstore.swa_replay): the
store keeps only the full-attention blocks, so the hit stands as it is only where a live worker holds
the SWA state at its end (one holder-index lookup of that end's window); otherwise it backs off one
block and prefill replays the window before it, which routing counts as work (`StoreHit.compute_from`).
"""

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from workers.kvstore.block_hash import BlockHash, hash_chain, reusable_blocks
from workers.kvstore.holders import HolderIndex
from workers.kvstore.index import BlockIndex
from workers.kvstore.swa_replay import SwaStateSource, swa_hit
from workers.kvstore.swa_window import window_keys
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


def stored_prefix(
    index: BlockIndex, token_ids: Sequence[int] | np.ndarray, *, block_tokens: int, extra: bytes
) -> list[BlockHash]:
    """The keys of the prompt's blocks the store holds, from the first: whole blocks."""
    keys = hash_chain(token_ids, block_tokens, extra, max_blocks=reusable_blocks(len(token_ids), block_tokens))
    return keys[: index.match_prefix(keys)]


def store_hit_tokens(
    index: BlockIndex, token_ids: Sequence[int] | np.ndarray, *, block_tokens: int, extra: bytes
) -> int:
    """Prompt tokens the store can serve: whole blocks from the start."""
    return len(stored_prefix(index, token_ids, block_tokens=block_tokens, extra=extra)) * block_tokens


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
