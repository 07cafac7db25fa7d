"""A latent (MLA) KV group in the device cache: one plane of one head of latent_width per token and
layer, in the same [layers, planes, heads, pages, page_size, width] layout as full attention's."""

from dataclasses import replace

import torch

from tests.workers.engine.hf_reference import TINY_CONFIGS
from workers.engine.config import MlaConfig
from workers.engine.kv.kv_cache import KVCache
from workers.engine.kv.spec import KVCacheSpec, KVCacheSpecs, KVKind
from workers.engine.models.registry import model_config

LAYERS, PAGES, PAGE, WIDTH = 3, 5, 16, 576  # DeepSeek's latent: kv_lora_rank 512 + qk_rope_head_dim 64


def latent_specs(dtype: torch.dtype = torch.bfloat16) -> KVCacheSpecs:
    return KVCacheSpecs((KVCacheSpec(KVKind.LATENT, tuple(range(LAYERS)), dtype, PAGE, latent_width=WIDTH),))


def test_a_latent_cache_keeps_one_plane_of_one_head_per_layer():
    cache = KVCache(latent_specs(), num_pages=PAGES, device=torch.device("cpu"))

    assert tuple(cache.pages.shape) == (LAYERS, 1, 1, PAGES, PAGE, WIDTH)
    assert all(len(planes) == 1 for planes in cache.layers)
    (latent,) = cache.layers[1]
    assert tuple(latent.shape) == (1, PAGES, PAGE, WIDTH)
    assert latent.data_ptr() == cache.pages[1, 0].data_ptr()  # a view of the group's tensor
    assert cache.specs.groups[0].bytes_per_token_per_layer == 1152  # 576 values of bfloat16
    assert cache.pages.nbytes == 1152 * LAYERS * PAGES * PAGE


def test_a_full_attention_cache_keeps_its_keys_and_values_as_two_planes():
    spec = KVCacheSpec(KVKind.FULL, tuple(range(LAYERS)), torch.float32, PAGE, num_kv_heads=2, head_dim=8)
    cache = KVCache(KVCacheSpecs((spec,)), num_pages=PAGES, device=torch.device("cpu"))

    assert tuple(cache.pages.shape) == (LAYERS, 2, 2, PAGES, PAGE, 8)
    keys, values = cache.layers[2]
    assert keys.data_ptr() == cache.pages[2, 0].data_ptr() and values.data_ptr() == cache.pages[2, 1].data_ptr()


def test_a_shareable_latent_cache_lives_in_shared_memory():
    cache = KVCache(latent_specs(torch.float32), num_pages=PAGES, device=torch.device("cpu"), shareable=True)

    assert cache.shared_memory is not None and cache.shared_memory.num_bytes == cache.pages.nbytes
    assert not cache.pages.any()


def test_a_model_with_latent_attention_is_one_latent_group_of_all_its_layers():
    config = model_config(TINY_CONFIGS["llama"])
    mla = MlaConfig(
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        softmax_scale=192**-0.5,
    )

    specs = KVCacheSpecs.of_model(replace(config, mla=mla), dtype=torch.bfloat16, page_size=PAGE)

    assert specs.groups == (
        KVCacheSpec(KVKind.LATENT, tuple(range(config.num_layers)), torch.bfloat16, PAGE, latent_width=576),
    )
    assert specs.bytes_per_token == 1152 * config.num_layers
