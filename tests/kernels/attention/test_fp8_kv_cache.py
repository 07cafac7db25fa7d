"""The FP8 KV cache (kernels.attention.fp8_kv rows in uint8 pages) through every attention backend.

The torch backends must give on an FP8 cache exactly what they give on a cache of the values its rows
dequantize to; the Triton kernels (under Triton's interpreter without CUDA) must match the torch
backend on the same FP8 cache, since they dequantize to the same values.
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, so set it first
triton = pytest.importorskip("triton")

from kernels.attention import NULL_PAGE, AttentionMetadata, write_kv  # noqa: E402
from kernels.attention.fp8_kv import ROW_ALIGN, dequantize_rows, quantize_rows, row_bytes, scales_end  # noqa: E402
from kernels.attention.torch_blockwise import paged_attention_blockwise  # noqa: E402
from kernels.attention.torch_sdpa import paged_attention_sdpa  # noqa: E402
from kernels.attention.triton import (  # noqa: E402
    paged_decode_attention,
    paged_mla_decode,
    paged_mla_prefill,
    paged_prefill_attention,
)
from kernels.fused.mla_rotary import mla_rope_and_cache_write, mla_rope_and_cache_write_reference  # noqa: E402
from kernels.fused.rotary import rotary_and_cache_write, rotary_and_cache_write_reference  # noqa: E402
from workers.engine.config import RopeConfig  # noqa: E402
from workers.engine.layers.rotary import RotaryEmbedding  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def fp8_pages(seq_lens, *, kv_heads, width, page, seed=0):
    """FP8 K/V caches of random values, each sequence's pages shuffled over the pool, with the
    caches of what their rows dequantize to (float32), the tables as lists and int32 block tables."""
    pages_per_seq = [-(-s // page) for s in seq_lens]
    num_pages = 1 + sum(pages_per_seq) + 2
    generator = torch.Generator().manual_seed(seed)
    values = [3 * torch.randn(kv_heads, num_pages, page, width, generator=generator) for _ in range(2)]
    fp8 = [quantize_rows(v) for v in values]
    for cache in fp8:
        cache[:, NULL_PAGE] = 0
    dequantized = [dequantize_rows(c, width, torch.float32) for c in fp8]
    free = list(range(1, num_pages))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in pages_per_seq]
    block_tables = torch.full((len(seq_lens), max(pages_per_seq)), NULL_PAGE, dtype=torch.int32)
    for row, table in enumerate(tables):
        block_tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return fp8, dequantized, tables, block_tables


@pytest.mark.parametrize(("width", "stored"), [(16, 32), (64, 80), (128, 144), (576, 624)])
def test_rows_are_values_scales_then_zeros_to_whole_16_byte_vectors(width, stored):
    x = torch.randn(3, width, generator=torch.Generator().manual_seed(width))
    rows = quantize_rows(x)
    assert rows.shape == (3, stored) and stored == row_bytes(width) and stored % ROW_ALIGN == 0
    assert not rows[:, scales_end(width) :].any()
    group = min(width, 128) if width % 128 == 0 or width < 128 else 64
    scales = rows[:, width : scales_end(width)].contiguous().view(torch.float32)
    assert torch.equal(scales, x.unflatten(-1, (-1, group)).abs().amax(-1) / torch.finfo(torch.float8_e4m3fn).max)
    torch.testing.assert_close(dequantize_rows(rows, width, torch.float32), x, rtol=0.07, atol=1e-6)


def metadata(query_lens, seq_lens, tables, page):
    return AttentionMetadata.build(
        query_lens=query_lens, seq_lens=seq_lens, block_tables=tables, page_size=page, device=torch.device("cpu")
    )


@pytest.mark.parametrize("attend", [paged_attention_blockwise, paged_attention_sdpa])
@pytest.mark.parametrize("window", [None, 5])
def test_torch_backends_read_fp8_rows_as_the_values_they_dequantize_to(attend, window):
    query_lens, seq_lens, page = [1, 7, 12], [19, 7, 30], 4
    fp8, dequantized, tables, _ = fp8_pages(seq_lens, kv_heads=2, width=16, page=page)
    query = torch.randn(sum(query_lens), 6, 16, generator=torch.Generator().manual_seed(1))
    meta = metadata(query_lens, seq_lens, tables, page)

    got = attend(query, *fp8, meta, scale=0.25, window=window)
    expected = attend(query, *dequantized, meta, scale=0.25, window=window)

    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("attend", [paged_attention_blockwise, paged_attention_sdpa])
def test_mla_values_are_the_leading_columns_of_the_dequantized_latent(attend):
    """MLA's value cache is a view of the latent's first v bytes: its first v FP8 values."""
    query_lens, seq_lens, page, latent_width, v_dim = [1, 9], [13, 9], 4, 48, 32
    (latent, _), (dequantized, _), tables, _ = fp8_pages(seq_lens, kv_heads=1, width=latent_width, page=page)
    query = torch.randn(sum(query_lens), 4, latent_width, generator=torch.Generator().manual_seed(2))
    meta = metadata(query_lens, seq_lens, tables, page)

    got = attend(query, latent, latent[..., :v_dim], meta, scale=0.2)
    expected = attend(query, dequantized, dequantized[..., :v_dim], meta, scale=0.2)

    assert got.shape == (sum(query_lens), 4, v_dim)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_write_kv_quantizes_each_row_and_skips_minus_one_slots():
    kv_heads, width, page = 2, 16, 4
    k_cache = torch.zeros(kv_heads, 3, page, row_bytes(width), dtype=torch.uint8)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(3, kv_heads, width), torch.randn(3, kv_heads, width)
    slots = torch.tensor([5, -1, 9])

    write_kv(k_cache, v_cache, key, value, slots)

    flat_k = k_cache.view(kv_heads, -1, row_bytes(width))
    assert torch.equal(flat_k[:, [5, 9]], quantize_rows(key[[0, 2]].transpose(0, 1)))
    assert torch.equal(v_cache.view(kv_heads, -1, row_bytes(width))[:, 9], quantize_rows(value[2]))
    assert not flat_k[:, NULL_PAGE * page :].any(dim=-1)[:, [0, 1, 2, 3, 6, 7, 8, 10, 11]].any()
    # What is stored reads back within e4m3's rounding of the written keys.
    back = dequantize_rows(flat_k[:, 5], width, torch.float32)
    torch.testing.assert_close(back, key[0], rtol=0.07, atol=1e-3)


def triton_vs_torch(seq_lens, query_lens, *, kv_heads, heads, width, page, dtype, window, scale=0.3):
    fp8, _, tables, block_tables = fp8_pages(seq_lens, kv_heads=kv_heads, width=width, page=page)
    query = torch.randn(sum(query_lens), heads, width, generator=torch.Generator().manual_seed(3)).to(dtype)
    torch_out = paged_attention_blockwise(
        query, *fp8, metadata(query_lens, seq_lens, tables, page), scale=scale, window=window
    )
    k_cache, v_cache = (c.to(DEVICE) for c in fp8)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    if all(q == 1 for q in query_lens):
        out = paged_decode_attention(
            query.to(DEVICE), k_cache, v_cache, block_tables.to(DEVICE), lens, scale=scale, window=window
        )
    else:
        starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        out = paged_prefill_attention(
            query.to(DEVICE),
            k_cache,
            v_cache,
            block_tables.to(DEVICE),
            starts,
            lens,
            max_query_len=max(query_lens),
            scale=scale,
            window=window,
        )
    return out.cpu(), torch_out


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("heads", [2, 4])  # one query head per kv head (no tl.dot), and GQA
def test_triton_decode_on_fp8_rows_matches_the_torch_backend(window, heads):
    out, expected = triton_vs_torch(
        [21, 9, 40], [1, 1, 1], kv_heads=2, heads=heads, width=16, page=8, dtype=torch.float32, window=window
    )
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("query_magnitude", [1e-3, 1.0, 3e4])
def test_triton_decode_with_bf16_queries_on_fp8_rows_matches_fp32_attention(query_magnitude):
    """bf16 queries over FP8 rows multiply in fp16 (q scaled by a power of two, values by their
    tile's largest scale): at any query magnitude, closer to fp32 attention than bf16 operands."""
    seq_lens, kv_heads, heads, width, page = [21, 9, 40, 130], 2, 4, 16, 8
    fp8, dequantized, tables, block_tables = fp8_pages(seq_lens, kv_heads=kv_heads, width=width, page=page)
    # Values a thousand times smaller in one kv head: scales far from 1.
    fp8[1][1] = quantize_rows(dequantized[1][1] * 1e-3)
    dequantized[1][1] = dequantize_rows(fp8[1][1], width, torch.float32)
    query = query_magnitude * torch.randn(len(seq_lens), heads, width, generator=torch.Generator().manual_seed(5))
    query = query.to(torch.bfloat16)
    scale = 0.3 / query_magnitude
    expected = paged_attention_blockwise(
        query.float(), *dequantized, metadata([1] * len(seq_lens), seq_lens, tables, page), scale=scale, window=None
    )
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(
        query.to(DEVICE), *(c.to(DEVICE) for c in fp8), block_tables.to(DEVICE), lens, scale=scale
    )
    # Each row's error against its largest output: 0.0070 at every magnitude here, where bf16 operands
    # (the kernel before fp16 ones) gave 0.0093 (mostly probabilities rounded to bf16).
    error = (out.float().cpu() - expected).abs().amax(dim=-1) / expected.abs().amax(dim=-1)
    assert error.max() < 8e-3


@pytest.mark.parametrize("window", [None, 6])
def test_triton_prefill_on_fp8_rows_matches_the_torch_backend(window):
    out, expected = triton_vs_torch(
        [21, 9, 40], [5, 9, 3], kv_heads=2, heads=4, width=16, page=8, dtype=torch.float32, window=window
    )
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [200, 1, 37, 64]])
def test_triton_on_fp8_rows_matches_the_torch_backend_at_llama_sizes_in_bf16(query_lens):
    seq_lens = [700, 129, 300, 64]
    # Scores of unit spread (keys are 3 x randn): sharper ones turn bf16's rounding of q.k into a
    # different winning key, between two correct implementations.
    out, expected = triton_vs_torch(
        seq_lens,
        query_lens,
        kv_heads=8,
        heads=32,
        width=128,
        page=16,
        dtype=torch.bfloat16,
        window=None,
        scale=128**-0.5 / 3,
    )
    # bf16 outputs of two summation orders: on an H100 one element in 1.2 million differed by 0.023.
    torch.testing.assert_close(out, expected.cpu(), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("query_lens", [[1, 1], [4, 9]])  # decode, prefill
def test_triton_mla_on_fp8_latents_matches_the_torch_backend(query_lens):
    seq_lens, page, latent_width, v_dim = [37, 9], 8, 48, 32  # a value part and a rope part of powers of two
    (latent, _), _, tables, block_tables = fp8_pages(seq_lens, kv_heads=1, width=latent_width, page=page)
    query = torch.randn(sum(query_lens), 4, latent_width, generator=torch.Generator().manual_seed(4))
    expected = paged_attention_blockwise(
        query, latent, latent[..., :v_dim], metadata(query_lens, seq_lens, tables, page), scale=0.2
    )
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    cache, tables_on_device = latent.to(DEVICE), block_tables.to(DEVICE)
    if query_lens == [1, 1]:
        out = paged_mla_decode(query.to(DEVICE), cache, tables_on_device, lens, v_dim=v_dim, scale=0.2)
    else:
        starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        out = paged_mla_prefill(
            query.to(DEVICE),
            cache,
            tables_on_device,
            starts,
            lens,
            max_query_len=max(query_lens),
            v_dim=v_dim,
            scale=0.2,
        )
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [100, 1, 33]])
def test_triton_mla_on_fp8_latents_matches_the_torch_backend_at_deepseek_v3_sizes_in_bf16(query_lens):
    seq_lens, page, latent_width, v_dim = [600, 130, 64], 16, 576, 512
    (latent, _), _, tables, block_tables = fp8_pages(seq_lens, kv_heads=1, width=latent_width, page=page)
    query = torch.randn(sum(query_lens), 16, latent_width, generator=torch.Generator().manual_seed(5))
    query = query.to(torch.bfloat16) / 8
    expected = paged_attention_blockwise(
        query, latent, latent[..., :v_dim], metadata(query_lens, seq_lens, tables, page), scale=0.07
    )
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    cache, tables_on_device = latent.to(DEVICE), block_tables.to(DEVICE)
    if max(query_lens) == 1:
        out = paged_mla_decode(query.to(DEVICE), cache, tables_on_device, lens, v_dim=v_dim, scale=0.07)
    else:
        starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        out = paged_mla_prefill(
            query.to(DEVICE),
            cache,
            tables_on_device,
            starts,
            lens,
            max_query_len=max(query_lens),
            v_dim=v_dim,
            scale=0.07,
        )
    torch.testing.assert_close(out.cpu(), expected, rtol=2e-2, atol=2e-2)


# Page size 4: a prompt across pages, a decode token, and two padding rows (slot -1) that write nothing.
FUSED_SLOTS = [12, 13, 14, 15, 4, 5, 9, -1, -1]
FUSED_POSITIONS = [0, 1, 2, 3, 4, 5, 17, 0, 0]


def written_rows(cache: torch.Tensor, slots: list[int]) -> torch.Tensor:
    return cache.view(cache.shape[0], -1, cache.shape[-1])[:, [s for s in slots if s >= 0]]


def rotation_tables(width: int) -> tuple[torch.Tensor, torch.Tensor]:
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), width, max_positions=64)
    return rotary.cos, rotary.sin


# (query heads, kv heads, head_dim, dtype): GQA with one scale group per row; groups of 32 that
# straddle the rotated halves (48 each); two groups of 128, one per half. float16, not bfloat16: Triton's
# interpreter truncates float32 -> bfloat16 where torch rounds, which would move the rounded keys.
# Exact on CUDA too: the kernels round as the torch reference does (no fused multiply-adds).
ROTARY_SHAPES = [(4, 2, 32, torch.float32), (6, 2, 96, torch.float16), (2, 1, 256, torch.float32)]


@pytest.mark.parametrize(("num_heads", "kv_heads", "head_dim", "dtype"), ROTARY_SHAPES)
def test_the_fused_rotary_write_quantizes_what_the_reference_writes(num_heads, kv_heads, head_dim, dtype):
    tokens = len(FUSED_SLOTS)
    generator = torch.Generator().manual_seed(6)
    qk = (4 * torch.randn(tokens, num_heads + kv_heads, head_dim, generator=generator)).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=generator).to(dtype)
    v[4] = 0  # all-zero groups take MIN_AMAX's scale
    cos, sin = rotation_tables(head_dim)
    positions, slots = torch.tensor(FUSED_POSITIONS), torch.tensor(FUSED_SLOTS)
    k_ref, v_ref = (
        torch.zeros(kv_heads, 5, 4, head_dim, dtype=dtype),
        torch.zeros(kv_heads, 5, 4, head_dim, dtype=dtype),
    )
    q_ref = rotary_and_cache_write_reference(qk, v, positions, cos, sin, k_ref, v_ref, slots, num_heads=num_heads)
    k_fp8 = torch.zeros(kv_heads, 5, 4, row_bytes(head_dim), dtype=torch.uint8, device=DEVICE)
    v_fp8 = torch.zeros_like(k_fp8)

    inputs = (t.to(DEVICE) for t in (qk, v, positions, cos, sin))
    q = rotary_and_cache_write(*inputs, k_fp8, v_fp8, slots.to(DEVICE), num_heads=num_heads).cpu()
    k_fp8, v_fp8 = k_fp8.cpu(), v_fp8.cpu()

    torch.testing.assert_close(q, q_ref, rtol=0, atol=0)
    assert torch.equal(written_rows(k_fp8, FUSED_SLOTS), quantize_rows(written_rows(k_ref, FUSED_SLOTS)))
    assert torch.equal(written_rows(v_fp8, FUSED_SLOTS), quantize_rows(written_rows(v_ref, FUSED_SLOTS)))
    for cache in (k_fp8, v_fp8):  # nothing else, padding rows (slot -1) included
        assert int(cache.view(kv_heads, -1, row_bytes(head_dim)).any(dim=-1).sum()) == kv_heads * 7


def test_the_fused_rotary_write_names_a_cache_that_is_not_fp8_rows():
    qk, v = torch.randn(2, 3, 16), torch.randn(2, 1, 16)
    cos, sin = rotation_tables(16)
    cache = torch.zeros(1, 2, 4, 16, dtype=torch.uint8)  # head_dim bytes: no room for the scales
    with pytest.raises(ValueError, match=rf"\[1, pages, page_size, {row_bytes(16)}\]"):
        rotary_and_cache_write(qk, v, torch.tensor([0, 1]), cos, sin, cache, cache, torch.tensor([0, 1]), num_heads=2)


# (compressed, rope): three groups of 16; DeepSeek-V3's 512 + 64, nine groups of 64 (the last the key).
@pytest.mark.parametrize(("compressed_dim", "rope_dim"), [(32, 16), (512, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleave", [False, True])
def test_the_fused_mla_rope_write_quantizes_what_the_reference_writes(compressed_dim, rope_dim, dtype, interleave):
    tokens, heads = len(FUSED_SLOTS), 3
    generator = torch.Generator().manual_seed(7)
    q_rope = torch.randn(tokens, heads, rope_dim, generator=generator).to(dtype)
    k_rope = (5 * torch.randn(tokens, rope_dim, generator=generator)).to(dtype)
    compressed = torch.randn(tokens, compressed_dim, generator=generator).to(dtype)
    compressed[5] = 0  # all-zero groups take MIN_AMAX's scale
    cos, sin = rotation_tables(rope_dim)
    positions, slots = torch.tensor(FUSED_POSITIONS), torch.tensor(FUSED_SLOTS)
    reference_cache = torch.zeros(1, 5, 4, compressed_dim + rope_dim, dtype=dtype)
    q_expected = q_rope.clone()
    mla_rope_and_cache_write_reference(
        q_expected, k_rope, compressed, positions, cos, sin, reference_cache, slots, interleave=interleave
    )
    latent = torch.zeros(1, 5, 4, row_bytes(compressed_dim + rope_dim), dtype=torch.uint8, device=DEVICE)
    q_rope = q_rope.to(DEVICE)

    inputs = (t.to(DEVICE) for t in (k_rope, compressed, positions, cos, sin))
    mla_rope_and_cache_write(q_rope, *inputs, latent, slots.to(DEVICE), interleave=interleave)
    q_rope, latent = q_rope.cpu(), latent.cpu()

    torch.testing.assert_close(q_rope, q_expected, rtol=0, atol=0)
    assert torch.equal(written_rows(latent, FUSED_SLOTS), quantize_rows(written_rows(reference_cache, FUSED_SLOTS)))
    assert int(latent.view(-1, latent.shape[-1]).any(dim=-1).sum()) == 7
