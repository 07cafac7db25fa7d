"""The ideal prefix-cache hit rate of a run: what a cache that never evicts would have served.

Prompts are cut into whole blocks of `block_size` tokens (the server's cache granularity: 16 for
vLLM's default block size and our page size); block i of a prompt is a hit when an earlier request of
the run had the same first i + 1 blocks. A prompt hits at most all but its last token's block, since
a server computes at least the last prompt token to sample from it (vLLM and our engine both do).
The rate is hit tokens over all prompt tokens, in dataset order, which is send order up to the
concurrency's reordering. For chat and messages the server re-tokenizes the decoded text inside a
chat template, so there the rate is the ids' and only approximates what the server can hit.
"""

from collections.abc import Iterable

import numpy as np


def ideal_hit_rate(prompts: Iterable[np.ndarray], block_size: int) -> float | None:
    seen: set[int] = set()
    hit_tokens = prompt_tokens = 0
    for prompt in prompts:
        prompt_tokens += len(prompt)
        chain = _block_chain(prompt, block_size)
        hittable = (len(prompt) - 1) // block_size
        hits = 0
        while hits < hittable and chain[hits] in seen:
            hits += 1
        hit_tokens += hits * block_size
        seen.update(chain)
    return hit_tokens / prompt_tokens if prompt_tokens else None


def _block_chain(prompt: np.ndarray, block_size: int) -> list[int]:
    """One hash per whole block, each covering the blocks before it, so equal hashes mean equal prefixes."""
    chain = []
    previous = 0
    tokens = np.ascontiguousarray(prompt, dtype=np.int64)
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = hash((previous, tokens[start : start + block_size].tobytes()))
        chain.append(previous)
    return chain
