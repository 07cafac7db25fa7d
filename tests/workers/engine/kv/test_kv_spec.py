"""KV cache specs: a model's groups of layers, their sizes and the layouts that stored blocks and
transfers record."""

from dataclasses import replace

import pytest
import torch

from tests.workers.engine.hf_reference import TINY_CONFIGS
from workers.engine.kv.spec import KVCacheSpec, KVCacheSpecs, KVKind
from workers.engine.models.registry import model_config


def full(layers, *, heads=2, dim=32, dtype=torch.float32) -> KVCacheSpec:
    return KVCacheSpec(KVKind.FULL, tuple(layers), dtype, 16, num_kv_heads=heads, head_dim=dim)


def test_a_hybrid_model_has_a_full_group_first_then_a_group_per_window():
    config = model_config(TINY_CONFIGS["qwen3_qknorm_layer_types"])
    assert config.layer_windows == (6, None, 6)

    specs = KVCacheSpecs.of_model(config, dtype=torch.bfloat16, page_size=16)

    heads = dict(num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
    assert specs.groups == (
        KVCacheSpec(KVKind.FULL, (1,), torch.bfloat16, 16, **heads),
        KVCacheSpec(KVKind.SLIDING_WINDOW, (0, 2), torch.bfloat16, 16, **heads, window=6),
    )
    assert specs.group_of_layer == (1, 0, 1) and specs.windows == (None, 6)
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    assert specs.bytes_per_token == per_token and specs.page_bytes == 16 * per_token


def test_distinct_windows_are_groups_of_their_own():
    config = replace(model_config(TINY_CONFIGS["llama"]), num_layers=5, layer_windows=(8, None, 4, 8, None))

    specs = KVCacheSpecs.of_model(config, dtype=torch.float32, page_size=16)

    assert [(g.kind, g.layers, g.window) for g in specs.groups] == [
        (KVKind.FULL, (1, 4), None),
        (KVKind.SLIDING_WINDOW, (2,), 4),
        (KVKind.SLIDING_WINDOW, (0, 3), 8),
    ]


@pytest.mark.parametrize("windows", [(None, None, None), (8, 8, 4)])
def test_a_model_without_full_and_windowed_layers_both_is_one_full_group(windows):
    # Every layer sliding: no full group would key the prefix cache or the store, so every token is kept.
    config = replace(model_config(TINY_CONFIGS["llama"]), layer_windows=windows)

    specs = KVCacheSpecs.of_model(config, dtype=torch.float32, page_size=16)

    assert [(g.kind, g.layers) for g in specs.groups] == [(KVKind.FULL, (0, 1, 2))]


def test_each_kind_sizes_its_tokens():
    window = KVCacheSpec(KVKind.SLIDING_WINDOW, (1, 3), torch.float16, 16, num_kv_heads=4, head_dim=8, window=64)
    latent = KVCacheSpec(KVKind.LATENT, (0,), torch.bfloat16, 16, latent_width=576)

    assert window.token_shape == (2, 4, 8) and window.bytes_per_token == 2 * (2 * 4 * 8 * 2)
    assert latent.token_shape == (1, 1, 576) and latent.bytes_per_token == 576 * 2
    assert latent.run_shape(32) == (1, 1, 1, 32, 576) and window.run_shape(32) == (2, 2, 4, 32, 8)
    assert latent.head_page_elements == 16 * 576 and window.head_page_elements == 16 * 8
    assert not window.stored_globally and latent.stored_globally and full([0]).stored_globally


def test_a_layout_names_kind_layers_shape_and_dtype_and_differs_when_any_does():
    window = KVCacheSpec(KVKind.SLIDING_WINDOW, (1, 3), torch.float32, 16, num_kv_heads=2, head_dim=32, window=64)

    assert full([0, 1, 2, 5, 7, 8]).layout == "full attention of layers 0-2, 5, 7-8: 2 KV heads of 32 (float32)"
    assert window.layout == "sliding window 64 of layers 1, 3: 2 KV heads of 32 (float32)"
    assert KVCacheSpec(KVKind.LATENT, (0,), torch.bfloat16, 16, latent_width=576).layout == (
        "latent of layers 0: a latent of 576 (bfloat16)"
    )
    variants = [
        full([0, 1]),
        full([0, 2]),
        full([0, 1], heads=4),
        full([0, 1], dim=16),
        full([0, 1], dtype=torch.bfloat16),
    ]
    assert len({spec.layout for spec in variants}) == len(variants)
    # The page size is not part of it: token-major data does not depend on it.
    assert (
        KVCacheSpec(KVKind.FULL, (0, 1), torch.float32, 32, num_kv_heads=2, head_dim=32).layout == full([0, 1]).layout
    )


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: full([]), "distinct, ascending"),
        (lambda: full([1, 0]), "distinct, ascending"),
        (lambda: full([0], heads=0), "positive num_kv_heads"),
        (lambda: KVCacheSpec(KVKind.LATENT, (0,), torch.float32, 16, num_kv_heads=2, head_dim=8), "latent_width"),
        (lambda: KVCacheSpec(KVKind.SLIDING_WINDOW, (0,), torch.float32, 16, num_kv_heads=2, head_dim=8), "window"),
        (lambda: KVCacheSpec(KVKind.FULL, (0,), torch.float32, 16, num_kv_heads=2, head_dim=8, window=4), "window"),
        (lambda: KVCacheSpecs((full([0]), full([2]))), "cover layers"),
        (lambda: KVCacheSpecs((full([0]), full([0, 1]))), "cover layers"),
        (
            lambda: KVCacheSpecs(
                (full([0]), KVCacheSpec(KVKind.FULL, (1,), torch.float32, 32, num_kv_heads=2, head_dim=8))
            ),
            "same page size",
        ),
    ],
)
def test_an_inconsistent_spec_is_refused_clearly(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_gpt_oss_20b_shaped_model_stores_half_its_kv_per_block():
    # 24 layers alternating sliding (window 128) and full, 8 KV heads of 64, bf16: a store block of
    # 128 tokens holds the 12 full layers' keys and values, 3 MiB, against 6 MiB for every layer.
    config = replace(
        model_config(TINY_CONFIGS["llama"]),
        num_layers=24,
        num_kv_heads=8,
        head_dim=64,
        layer_windows=tuple(128 if layer % 2 == 0 else None for layer in range(24)),
    )

    specs = KVCacheSpecs.of_model(config, dtype=torch.bfloat16, page_size=16)

    stored = [group for group in specs.groups if group.stored_globally]
    assert [group.layers for group in stored] == [tuple(range(1, 24, 2))]
    assert stored[0].bytes_per_token * 128 == 3 << 20 and specs.bytes_per_token * 128 == 6 << 20
