"""A request's hit in the global KV store as routing weighs it (workers.client.routing.prefix_match), read
off the event loop, and the holders of its SWA state the worker that computes it is told of.

A prompt with images is keyed with them (prefix_match.PromptImageKeys) by the worker's image token; a
worker that does not name one, or a prompt whose placeholders do not add up to its images, is routed
as a miss rather than keyed as text, which would count blocks of other images as hits.

"Live" holders are the workers this client holds healthy (their heartbeats keep coming) that advertise
an SWA state endpoint: a registration of a worker that died, before anyone dropped it, is not one.
"""

import asyncio
import logging
from collections.abc import Sequence

from workers.client.routing.prefix_match import PromptImageKeys, StoreHit, stored_prefix, swa_store_hit
from workers.kvstore.block_hash import namespace_extra
from workers.kvstore.holders import HolderIndex
from workers.kvstore.index import BlockIndex
from workers.protocol.messages import MAX_SWA_HOLDERS, GenerateRequest, SwaHolder, WorkerHeartbeat

log = logging.getLogger(__name__)

NO_HIT = StoreHit(0, 0)


def live_swa_endpoints(healthy: Sequence[WorkerHeartbeat]) -> dict[str, str]:
    """Worker id → SWA state endpoint of the healthy workers that serve their SWA state."""
    return {
        beat.worker_id: beat.swa_layers.state_endpoint
        for beat in healthy
        if beat.swa_layers is not None and beat.swa_layers.state_endpoint
    }


async def read_store_hit(
    index: BlockIndex | None,
    holders: HolderIndex | None,
    request: GenerateRequest,
    worker: WorkerHeartbeat,
    live: dict[str, str],
) -> StoreHit:
    """The prompt's hit as `worker` (its model, its block length) will use it; none when this client
    cannot read the store's index, or the read fails."""
    if index is None or not worker.kv_block_tokens:
        return NO_HIT
    try:
        # The indexes may be a network round trip each (Redis): not on the event loop.
        return await asyncio.to_thread(_read, index, holders, request, worker, live)
    except Exception as error:
        log.warning("reading the KV store index failed; routing as a miss: %s", error)
        return NO_HIT


def swa_holders(hit: StoreHit, live: dict[str, str]) -> tuple[SwaHolder, ...]:
    """What the request tells its worker of the live holders of its SWA state."""
    return tuple(SwaHolder(worker_id, live[worker_id]) for worker_id in sorted(hit.holders)[:MAX_SWA_HOLDERS])


def _read(
    index: BlockIndex,
    holders: HolderIndex | None,
    request: GenerateRequest,
    worker: WorkerHeartbeat,
    live: dict[str, str],
) -> StoreHit:
    block_tokens = worker.kv_block_tokens
    extra = namespace_extra(worker.kv_model_id, request.cache_namespace)
    images = None
    if request.images:
        if worker.image_token_id is None:
            return NO_HIT
        images = PromptImageKeys.of(request.prompt_token_ids, worker.image_token_id, request.images)
        if images is None:
            return NO_HIT
    prefix = stored_prefix(index, request.prompt_token_ids, block_tokens=block_tokens, extra=extra, images=images)
    if worker.swa_layers is None:
        return StoreHit(len(prefix) * block_tokens, len(prefix) * block_tokens)
    try:
        return swa_store_hit(prefix, holders, live, block_tokens=block_tokens, layers=worker.swa_layers)
    except Exception as error:
        # The holder index is down: the worker will not find a holder either, and replays.
        log.warning("reading the SWA holder index failed; routing as a replay: %s", error)
        return swa_store_hit(prefix, None, {}, block_tokens=block_tokens, layers=worker.swa_layers)
