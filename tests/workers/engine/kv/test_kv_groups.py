"""A model of two KV groups, full attention and a sliding window, proves the seam between the specs and
what holds KV: pages are allocated per group, and the global store writes only the full-attention
group (a window's state is never stored globally) and serves such a model no hits where it cannot
replay its windows (kv.window_replay); a block of another layout is refused there."""

import random

import msgspec
import torch

from workers.engine.connectors.store import StoreConnector
from workers.engine.kv.block_manager import BlockManager
from workers.engine.kv.kv_cache import KVCache
from workers.engine.kv.spec import KVCacheSpec, KVCacheSpecs, KVKind
from workers.engine.request import Request
from workers.kvstore.hints import RetentionCaps
from workers.kvstore.store import open_store
from workers.protocol.sampling_params import SamplingParams

PAGE, BLOCK = 16, 32
FULL = KVCacheSpec(KVKind.FULL, (0, 2), torch.float32, PAGE, num_kv_heads=2, head_dim=8)
WINDOW = KVCacheSpec(KVKind.SLIDING_WINDOW, (1, 3), torch.float32, PAGE, num_kv_heads=2, head_dim=8, window=20)
SPECS = KVCacheSpecs((FULL, WINDOW))
ONE_GROUP = KVCacheSpecs((KVCacheSpec(KVKind.FULL, (0, 1, 2, 3), torch.float32, PAGE, num_kv_heads=2, head_dim=8),))
CAPS = RetentionCaps(max_tokens=0, max_retention_s=0)


def computed_request(manager: BlockManager, num_tokens: int) -> Request:
    rng = random.Random(0)
    tokens = [rng.randrange(128) for _ in range(num_tokens)]
    request = Request(request_id="r", prompt_token_ids=tokens, params=SamplingParams(), max_tokens=4, hash_extra=b"m")
    assert manager.allocate(request, num_tokens)
    request.num_computed_tokens = num_tokens
    return request


def test_the_store_writes_only_the_full_attention_group(tmp_path):
    cache = KVCache(SPECS, num_pages=8, device=torch.device("cpu"))
    assert [tuple(keys.shape) for keys, _ in cache.layers] == [(2, 8, PAGE, 8)] * 4
    for pages in cache.group_pages:
        pages.copy_(torch.randn(pages.shape))
    manager = BlockManager(num_pages=8, page_size=PAGE, windows=SPECS.windows)
    request = computed_request(manager, 40)
    assert request.pages == [1, 2, 3] and manager.pages_of(request, 1) == [1, 2, 3]
    store = open_store(tmp_path)
    connector = StoreConnector(store, cache, manager, block_tokens=BLOCK, retention_caps=CAPS)

    connector.save([request])
    connector.close()

    assert connector.swa_stats.store_bytes_not_written == WINDOW.bytes_per_token * BLOCK
    (key,) = request.store_keys
    assert store.files.stat(key)[0].layout == FULL.layout
    stored = torch.frombuffer(bytearray(store.files.read(key)), dtype=torch.float32)
    pages = torch.tensor(request.pages[:2])
    expected = torch.stack(
        [
            torch.stack([cache.layers[layer][kind][:, pages].reshape(2, BLOCK, 8) for kind in (0, 1)])
            for layer in FULL.layers
        ]
    )
    assert torch.equal(stored.view(FULL.run_shape(BLOCK)), expected)


def test_a_hybrid_model_that_cannot_replay_its_windows_takes_no_hit_from_the_store(tmp_path):
    cache = KVCache(SPECS, num_pages=8, device=torch.device("cpu"))
    manager = BlockManager(num_pages=8, page_size=PAGE, windows=SPECS.windows)
    request = computed_request(manager, 70)
    store = open_store(tmp_path)
    connector = StoreConnector(store, cache, manager, block_tokens=BLOCK, retention_caps=CAPS)
    connector.save([request])
    again = Request(
        request_id="again",
        prompt_token_ids=request.prompt_token_ids,
        params=SamplingParams(),
        max_tokens=4,
        hash_extra=b"m",
    )

    connector.start_fetch(again, local_hit_tokens=0)
    connector.close()

    assert store.match(request.store_keys) == 2 and again.store_fetch is None


def test_a_stored_block_of_another_layout_ends_the_fetch_there(tmp_path, caplog):
    cache = KVCache(ONE_GROUP, num_pages=8, device=torch.device("cpu"))
    manager = BlockManager(num_pages=8, page_size=PAGE)
    request = computed_request(manager, 70)
    store = open_store(tmp_path)
    writer = StoreConnector(store, cache, manager, block_tokens=BLOCK, retention_caps=CAPS)
    writer.save([request])
    writer.close()
    # The same tokens' blocks as a cache of another dtype would have written them (same key, say a
    # model served under one name with another KV format): the second block's file.
    second = request.store_keys[1]
    meta = store.files.stat(second)[0]
    data = store.files.read(second)
    store.files.delete([second])
    other = KVCacheSpec(KVKind.FULL, (0, 1, 2, 3), torch.bfloat16, PAGE, num_kv_heads=4, head_dim=2)
    store.files.write(second, data, msgspec.structs.replace(meta, layout=other.layout))
    again = Request(
        request_id="again",
        prompt_token_ids=request.prompt_token_ids,
        params=SamplingParams(),
        max_tokens=4,
        hash_extra=b"m",
    )

    reader = StoreConnector(store, cache, manager, block_tokens=BLOCK, retention_caps=CAPS)
    reader.start_fetch(again, local_hit_tokens=0)
    loaded = again.store_fetch.result()
    reader.close()

    assert loaded.num_pages == BLOCK // PAGE  # the first block only: the rest is recomputed
    assert f"holds {other.layout}; the reader's KV is {ONE_GROUP.layout}" in caplog.text
