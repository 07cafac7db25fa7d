"""The global store keeps a latent (MLA) group's blocks as it keeps full attention's: a block written
from one cache's pages reads back into another's pages equal. A block of one layout read by a cache
of the other is refused (BlockLayoutError) even when their sizes agree, and writes nothing."""

import random
import re

import pytest
import torch

from workers.engine.connectors.store import KVLoad, StoreConnector
from workers.engine.kv.block_manager import BlockManager
from workers.engine.kv.kv_cache import KVCache
from workers.engine.kv.spec import KVCacheSpec, KVCacheSpecs, KVKind
from workers.engine.request import Request
from workers.kvstore.block_files import BlockLayoutError
from workers.kvstore.hints import RetentionCaps
from workers.kvstore.store import open_store
from workers.protocol.sampling_params import SamplingParams

PAGE, BLOCK, PAGES, TOKENS = 16, 32, 8, 70  # two full blocks
LATENT = KVCacheSpec(KVKind.LATENT, (0, 1), torch.bfloat16, PAGE, latent_width=576)
# As many bytes per token as the latent: only the layouts tell them apart.
FULL = KVCacheSpec(KVKind.FULL, (0, 1), torch.bfloat16, PAGE, num_kv_heads=2, head_dim=144)
CAPS = RetentionCaps(max_tokens=0, max_retention_s=0)


def request_of(request_id: str) -> Request:
    rng = random.Random(0)
    tokens = [rng.randrange(128) for _ in range(TOKENS)]
    return Request(
        request_id=request_id, prompt_token_ids=tokens, params=SamplingParams(), max_tokens=4, hash_extra=b"m"
    )


def written_cache(spec: KVCacheSpec, store) -> tuple[KVCache, Request]:
    """A cache of `spec` whose request's blocks are in the store."""
    cache = KVCache(KVCacheSpecs((spec,)), num_pages=PAGES, device=torch.device("cpu"))
    cache.pages.copy_(torch.randn(cache.pages.shape))
    manager = BlockManager(num_pages=PAGES, page_size=PAGE, windows=(None,))
    request = request_of("written")
    assert manager.allocate(request, TOKENS)
    request.num_computed_tokens = TOKENS
    writer = StoreConnector(store, cache, manager, block_tokens=BLOCK, retention_caps=CAPS)
    writer.save([request])
    writer.close()
    return cache, request


def fetched(spec: KVCacheSpec, store) -> tuple[KVCache, Request, int]:
    """A fresh cache of `spec` that fetched the request's blocks from the store into its pages, and
    how many pages they filled."""
    cache = KVCache(KVCacheSpecs((spec,)), num_pages=PAGES, device=torch.device("cpu"))
    manager = BlockManager(num_pages=PAGES, page_size=PAGE, windows=(None,))
    # Other pages than the writer's, so a read into the wrong pages shows.
    assert manager.allocate(request_of("filler"), 2 * PAGE)
    request = request_of("read")
    assert manager.allocate(request, TOKENS)
    reader = StoreConnector(store, cache, manager, block_tokens=BLOCK, retention_caps=CAPS)
    reader.start_fetch(request, local_hit_tokens=0)
    loaded = request.store_fetch.result()
    if loaded.num_pages:  # as the scheduler copies in only what came
        reader.copy_in([KVLoad(pages=request.pages[: loaded.num_pages], blocks=loaded.blocks)])
    reader.close()
    return cache, request, loaded.num_pages


def test_a_latent_groups_blocks_read_back_into_other_pages_equal(tmp_path):
    store = open_store(tmp_path)
    written, request = written_cache(LATENT, store)
    assert all(store.files.stat(key)[0].layout == LATENT.layout for key in request.store_keys)

    read, into, num_pages = fetched(LATENT, store)

    assert num_pages == 2 * BLOCK // PAGE and into.pages != request.pages
    sent = written.pages[:, :, :, request.pages[:num_pages]]
    assert torch.equal(read.pages[:, :, :, into.pages[:num_pages]], sent)
    assert read.pages.count_nonzero() == sent.count_nonzero()  # and nothing else was written


@pytest.mark.parametrize("writer, reader", [(LATENT, FULL), (FULL, LATENT)])
def test_a_block_of_the_other_layout_is_refused_and_nothing_is_written(tmp_path, writer, reader, caplog):
    assert writer.bytes_per_token == reader.bytes_per_token
    store = open_store(tmp_path)
    _, request = written_cache(writer, store)
    refusal = f"holds {writer.layout}; the reader's KV is {reader.layout}"
    with pytest.raises(BlockLayoutError, match=re.escape(refusal)):
        store.files.read(request.store_keys[0], layout=reader.layout)

    read, _, num_pages = fetched(reader, store)

    assert num_pages == 0 and not read.pages.any()
    assert refusal in caplog.text
