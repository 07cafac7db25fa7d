"""The chained block hash: the one key function for every KV block, engine page or store block.

`h_i = H(h_{i-1}, tokens of block i, extra)`. A block's key therefore names its whole prefix, so a
prefix match is a walk along the chain that stops at the first unknown key, and a hit on block i
implies hits on every block before it. The engine's local prefix cache (pages of `page_size`
tokens) and the global KV store (blocks of a multiple of that) both key blocks with this function;
only the block length differs.

`extra` carries what besides the tokens decides the KV: the model, the tenant's cache namespace,
image hashes. It is folded into every block, not only the first, so that two chains that differ
only in `extra` never share a key.

BLAKE2b is used rather than Python's `hash()` because keys must agree across processes and hosts
(Python salts `hash()` per process) and must not collide by accident or on purpose: a collision
would serve one prompt's KV to another.
"""

from bisect import bisect_left
from collections.abc import Sequence
from hashlib import blake2b

import numpy as np

BlockHash = bytes

DIGEST_BYTES = 16
ROOT_HASH: BlockHash = bytes(DIGEST_BYTES)


def hash_block(parent: BlockHash, token_ids: Sequence[int] | np.ndarray, extra: bytes = b"") -> BlockHash:
    """Key of one block given its parent's key (ROOT_HASH for the first block)."""
    h = blake2b(parent, digest_size=DIGEST_BYTES)
    h.update(np.asarray(token_ids, dtype=np.int32).tobytes())
    # The length prefix keeps `extra` from being confused with token bytes.
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    return h.digest()


def hash_chain(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    extra: bytes = b"",
    *,
    parent: BlockHash = ROOT_HASH,
    max_blocks: int | None = None,
) -> list[BlockHash]:
    """Keys of the full blocks of `token_ids`, in order; a trailing partial block has no key."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens = np.asarray(token_ids, dtype=np.int32)
    num_blocks = len(tokens) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    data = memoryview(tokens.tobytes())
    stride = block_size * tokens.itemsize
    suffix = len(extra).to_bytes(4, "little") + extra
    keys: list[BlockHash] = []
    for i in range(num_blocks):
        h = blake2b(parent, digest_size=DIGEST_BYTES)
        h.update(data[i * stride : (i + 1) * stride])
        h.update(suffix)
        parent = h.digest()
        keys.append(parent)
    return keys


# Between a block's namespace extra and the digests of the images before its end; a namespace holds
# no NUL of its own (namespace_extra, scoped_namespace), so no namespace spells it.
IMAGES_EXTRA = b"\x00images:"


def image_digest(content_hash: bytes) -> bytes:
    """An image's content hash (any length) as the fixed-size digest block extras carry."""
    return blake2b(content_hash, digest_size=DIGEST_BYTES).digest()


def image_block_extra(
    extra: bytes, image_starts: Sequence[int], image_digests: Sequence[bytes], index: int, block_size: int
) -> bytes:
    """The `extra` of block `index` (blocks of `block_size` tokens) of a prompt with images: `extra`
    and the digests of the images whose first placeholder (ascending `image_starts`) lies in this
    block or an earlier one. So a prefix with image X keys apart from one with image Y from the block
    where the image starts, and blocks before it key as the same text's do."""
    started = bisect_left(image_starts, (index + 1) * block_size)
    if not started:
        return extra
    return extra + IMAGES_EXTRA + b"".join(image_digests[:started])


def image_hash_chain(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    extra: bytes,
    image_starts: Sequence[int],
    image_digests: Sequence[bytes],
    *,
    parent: BlockHash = ROOT_HASH,
    first_block: int = 0,
    max_blocks: int | None = None,
) -> list[BlockHash]:
    """hash_chain of a prompt with images: each block's extra from image_block_extra. `token_ids` are
    the prompt's from block `first_block` on, the chain continuing from `parent`."""
    tokens = np.asarray(token_ids, dtype=np.int32)
    num_blocks = len(tokens) // block_size
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    keys: list[BlockHash] = []
    for i in range(num_blocks):
        block_extra = image_block_extra(extra, image_starts, image_digests, first_block + i, block_size)
        parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size], block_extra)
        keys.append(parent)
    return keys


def image_placeholders(
    token_ids: Sequence[int] | np.ndarray, image_token_id: int, num_tokens: Sequence[int]
) -> tuple[np.ndarray, tuple[int, ...]]:
    """Where a prompt's images go: every placeholder's position (ascending), and each image's first
    one, image i taking `num_tokens[i]` placeholders in turn. ValueError when they do not add up."""
    positions = np.flatnonzero(np.asarray(token_ids, dtype=np.int64) == image_token_id)
    if len(positions) != sum(num_tokens) or any(count < 1 for count in num_tokens):
        raise ValueError(f"{len(positions)} image placeholders for images of {list(num_tokens)} tokens")
    firsts = np.cumsum([0, *num_tokens[:-1]])
    return positions, tuple(int(positions[first]) for first in firsts)


def reusable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading blocks of a prompt a cache may serve: at least one token is always computed,
    since its logits sample the next token."""
    return max(num_tokens - 1, 0) // block_size


def kv_model_id(model_name: str, dtype: str, kv_cache_dtype: str = "auto", weight_dtype: str | None = None) -> str:
    """What decides a KV block's bytes besides its tokens, as it enters every block's `extra`: the
    model, its compute dtype, weights stored otherwise than in it (fp8: KV computed by other weights),
    and the KV storage (--kv-cache-dtype): an FP8 cache's blocks key apart from the same model's bf16
    ones, so neither prefix cache nor store ever matches one for the other."""
    weights = f":{weight_dtype}-weights" if weight_dtype not in (None, dtype) else ""
    storage = "" if kv_cache_dtype == "auto" else f":kv-{kv_cache_dtype}"
    return f"{model_name}:{dtype}{weights}{storage}"


def namespace_extra(model_id: str, cache_namespace: str = "") -> bytes:
    """The `extra` that separates models and tenants' cache namespaces."""
    return f"{model_id}\x00{cache_namespace}".encode()


def scoped_namespace(cache_namespace: str, prompt_cache_key: str | None) -> str:
    """A tenant's cache namespace narrowed by a client's prompt_cache_key (recipe.cache_hints):
    requests with the same key share cached prefixes, and no others do. The key enters as a digest
    after a NUL, which no tenant's namespace holds (PostgreSQL text cannot), so no key spells another
    tenant's namespace or a key of its own."""
    if not prompt_cache_key:
        return cache_namespace
    digest = blake2b(prompt_cache_key.encode(), digest_size=DIGEST_BYTES).hexdigest()
    return f"{cache_namespace}\x00key:{digest}"
