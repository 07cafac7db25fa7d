"""Which blocks make the SWA state at a prefix end: torch-free, so that the entrypoint routes by the same
rule the worker keeps and fetches state by (workers.engine.kv.swa_state).

A window counts the query itself (KVCacheSpec.window), so a request continuing at a block-aligned prefix
end reads the KV of the W - 1 tokens before it: `window_blocks` blocks of them.
"""

from collections.abc import Sequence

from workers.kvstore.block_hash import BlockHash


def window_blocks(window: int, block_tokens: int) -> int:
    """Blocks that hold the W - 1 tokens before a block-aligned prefix end: a continuation's window."""
    if window < 1 or block_tokens < 1:
        raise ValueError(f"window and block_tokens must be positive, got {window} and {block_tokens}")
    return -(-(window - 1) // block_tokens)


def window_keys(prefix_keys: Sequence[BlockHash], window: int, block_tokens: int) -> list[BlockHash]:
    """The keys whose runs make the SWA state at the end of the prefix `prefix_keys` (its block keys,
    in order): the last `window_blocks` of them, or all of a shorter prefix."""
    needed = window_blocks(window, block_tokens)
    return list(prefix_keys[max(0, len(prefix_keys) - needed) :]) if needed else []
