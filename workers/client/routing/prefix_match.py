"""Prefix match at the entrypoint: a prompt's hit length in the global KV store, from the index alone.

The prompt's blocks are keyed with the engine's own chain (workers.kvstore.block_hash) and the same `extra`
(model and cache namespace, see `namespace_extra`), then the index walks the chain to the first
absent key. No block data is read, so routing can weigh a request's real prefill work cheaply.
"""

from collections.abc import Sequence

import numpy as np

from workers.kvstore.block_hash import hash_chain, reusable_blocks
from workers.kvstore.index import BlockIndex


def store_hit_tokens(
    index: BlockIndex, token_ids: Sequence[int] | np.ndarray, *, block_tokens: int, extra: bytes
) -> int:
    """Prompt tokens the store can serve: whole blocks from the start."""
    keys = hash_chain(token_ids, block_tokens, extra, max_blocks=reusable_blocks(len(token_ids), block_tokens))
    return index.match_prefix(keys) * block_tokens
