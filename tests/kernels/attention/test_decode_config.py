"""The decode kernel's configs per cache dtype (kernels.attention.triton.decode.decode_config), the
checks on a config passed in, and where the kernels may use PTX's e4m3 conversion."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, so set it first
pytest.importorskip("triton")

from kernels.attention.fp8_kv import quantize_rows  # noqa: E402
from kernels.attention.triton.decode import (  # noqa: E402
    FP8_TILE_BYTES,
    SUPPORTED_HEAD_DIMS,
    DecodeConfig,
    decode_config,
    fp8_cvt_instructions,
    paged_decode_attention,
)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("fp8", [False, True])
def test_every_supported_head_gets_a_config_whose_splits_are_whole_tiles(head_dim, fp8):
    config = decode_config(head_dim, fp8=fp8)
    assert config.split_keys % config.block_n == 0 and config.block_n >= 16
    if fp8:
        assert config.block_n * head_dim <= FP8_TILE_BYTES
        # Half the bytes of a bf16 row: an FP8 split is longer than bf16's.
        assert config.split_keys > decode_config(head_dim, fp8=False).split_keys


def test_a_config_whose_split_is_not_whole_tiles_is_refused_naming_both():
    kv_heads, pages, page, head_dim = 2, 3, 8, 16
    k_cache = quantize_rows(torch.randn(kv_heads, pages, page, head_dim))
    q = torch.randn(1, 4, head_dim, dtype=torch.bfloat16)
    tables = torch.tensor([[1, 2]], dtype=torch.int32)
    lens = torch.tensor([9], dtype=torch.int32)
    bad = DecodeConfig(split_keys=96, block_n=64, num_warps=2, num_stages=2)
    with pytest.raises(ValueError, match="split_keys must be a positive multiple of block_n 64, got 96"):
        paged_decode_attention(q, k_cache, k_cache.clone(), tables, lens, scale=0.25, config=bad)


def test_e4m3_cvt_instructions_are_used_only_in_compiled_cuda_kernels(monkeypatch):
    assert not fp8_cvt_instructions(torch.device("cpu"))
    # The interpreter runs no PTX; asking must not touch a GPU.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not fp8_cvt_instructions(torch.device("cuda", 0))
