"""The Triton paged attention kernels against a float64 torch reference and the engine's blockwise backend.

Without CUDA the kernels run in Triton's interpreter on the CPU, so shapes stay tiny; the `gpu`
tests repeat the comparisons at SmolLM2-like sizes on a CUDA device.
"""

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, so set it first
triton = pytest.importorskip("triton")

from kernels.attention import NULL_PAGE, AttentionMetadata  # noqa: E402
from kernels.attention.torch_blockwise import paged_attention_blockwise  # noqa: E402
from kernels.attention.triton import check_supported, paged_decode_attention, paged_prefill_attention  # noqa: E402
from kernels.attention.triton.decode import SPLIT_KEYS, arrival_counters  # noqa: E402
from kernels.attention.triton.prefill import KEY_TILE  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def paged_cache(seq_lens, *, kv_heads, head_dim, page, dtype, seed=0, extra_columns=0, poison_null_page=True):
    """Random K/V caches with each sequence's pages shuffled over the pool, and int32 block tables
    padded with NULL_PAGE (plus `extra_columns`, like a graph bucket's wider table). Page 0 holds
    NaN unless told otherwise: a kernel that reads a padding entry's keys poisons its output."""
    pages_per_seq = [-(-s // page) for s in seq_lens]
    num_pages = 1 + sum(pages_per_seq) + 3
    generator = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(kv_heads, num_pages, page, head_dim, generator=generator)
    v_cache = torch.randn(kv_heads, num_pages, page, head_dim, generator=generator)
    if poison_null_page:
        k_cache[:, NULL_PAGE] = float("nan")
        v_cache[:, NULL_PAGE] = float("nan")
    free = list(range(1, num_pages))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in pages_per_seq]
    block_tables = torch.full((len(seq_lens), max(pages_per_seq) + extra_columns), NULL_PAGE, dtype=torch.int32)
    for row, table in enumerate(tables):
        block_tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return k_cache.to(DEVICE, dtype), v_cache.to(DEVICE, dtype), block_tables.to(DEVICE), tables


def reference(q, k_cache, v_cache, tables, query_lens, seq_lens, *, scale, window, sinks=None):
    """float64 attention of each sequence's new tokens over its keys, gathered page by page; each
    head's sink logit, if any, joins the softmax with no value."""
    kv_heads, _, page, head_dim = k_cache.shape
    group = q.shape[1] // kv_heads
    q, k_cache, v_cache = q.cpu().double(), k_cache.cpu().double(), v_cache.cpu().double()
    rows, start = [], 0
    for table, q_len, s_len in zip(tables, query_lens, seq_lens, strict=True):
        if s_len == 0:
            rows.append(torch.zeros(q_len, q.shape[1], head_dim, dtype=torch.float64))
        else:
            pages = torch.tensor(table, dtype=torch.long)
            k = k_cache[:, pages].flatten(1, 2)[:, :s_len].repeat_interleave(group, dim=0)  # [heads, keys, d]
            v = v_cache[:, pages].flatten(1, 2)[:, :s_len].repeat_interleave(group, dim=0)
            scores = torch.einsum("thd,hkd->htk", q[start : start + q_len], k) * scale
            query_pos = torch.arange(s_len - q_len, s_len)[:, None]
            key_pos = torch.arange(s_len)[None, :]
            visible = key_pos <= query_pos
            if window is not None:
                visible &= key_pos > query_pos - window
            scores = scores.masked_fill(~visible, float("-inf"))
            if sinks is not None:
                sink_column = sinks.cpu().double()[:, None, None].expand(-1, q_len, 1)
                scores = torch.cat([scores, sink_column], dim=-1)
            probs = scores.softmax(dim=-1)[..., :s_len]
            rows.append(torch.einsum("htk,hkd->thd", probs, v))
        start += q_len
    return torch.cat(rows)


def assert_matches(out, expected, dtype):
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu().double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def run_decode(seq_lens, *, heads, kv_heads, head_dim, page, dtype, window, seed=0, extra_columns=0, sinks=None):
    k_cache, v_cache, block_tables, tables = paged_cache(
        seq_lens, kv_heads=kv_heads, head_dim=head_dim, page=page, dtype=dtype, seed=seed, extra_columns=extra_columns
    )
    q = torch.randn(len(seq_lens), heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    q = q.to(DEVICE, dtype)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens_t, scale=scale, window=window, sinks=sinks)
    expected = reference(
        q, k_cache, v_cache, tables, [1] * len(seq_lens), seq_lens, scale=scale, window=window, sinks=sinks
    )
    assert out.dtype == dtype and out.shape == q.shape
    assert_matches(out, expected, dtype)
    return out


def run_prefill(seqs, *, heads, kv_heads, head_dim, page, dtype, window, seed=0, sinks=None):
    query_lens, seq_lens = [q for q, _ in seqs], [s for _, s in seqs]
    k_cache, v_cache, block_tables, tables = paged_cache(
        seq_lens, kv_heads=kv_heads, head_dim=head_dim, page=page, dtype=dtype, seed=seed
    )
    q = torch.randn(sum(query_lens), heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    q = q.to(DEVICE, dtype)
    query_start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start,
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        max_query_len=max(query_lens),
        scale=scale,
        window=window,
        sinks=sinks,
    )
    expected = reference(q, k_cache, v_cache, tables, query_lens, seq_lens, scale=scale, window=window, sinks=sinks)
    assert out.dtype == dtype and out.shape == q.shape
    assert_matches(out, expected, dtype)


# Ragged: a padding row, one key, a full page, one past it, and three splits (SPLIT_KEYS keys each).
DECODE_LENS = [0, 1, 8, 9, 45, 2 * SPLIT_KEYS + 88]
# (new tokens, tokens in context): extends of a cached prefix, fresh prompts, a lone decode token,
# and queries long enough for several query tiles.
PREFILL_SEQS = [(5, 300), (40, 40), (3, 16), (70, 90), (1, 37), (12, 12)]


# Head groups of 2 and 3 (tl.dot, padded to 16 rows) and 1 (broadcast-multiply).
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 2, None), (6, 2, 5), (2, 2, 300)])
def test_decode_matches_reference(heads, kv_heads, window):
    run_decode(DECODE_LENS, heads=heads, kv_heads=kv_heads, head_dim=32, page=8, dtype=torch.float32, window=window)


def head_sinks(heads, seed=11):
    """Sink logits on the scale of the scores (some above, some below), on the device."""
    return (torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2).to(DEVICE)


# A padding row (zeros with a sink too), several splits, a window that starts past the first split.
@pytest.mark.parametrize("heads,kv_heads,window", [(4, 2, None), (6, 2, SPLIT_KEYS + 5), (2, 2, 7)])
def test_decode_with_sinks_matches_reference(heads, kv_heads, window):
    out = run_decode(
        DECODE_LENS,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=32,
        page=8,
        dtype=torch.float32,
        window=window,
        sinks=head_sinks(heads),
    )
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.parametrize("heads,kv_heads,window", [(4, 2, None), (6, 2, 7)])
def test_prefill_with_sinks_matches_reference(heads, kv_heads, window):
    run_prefill(
        PREFILL_SEQS,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=32,
        page=8,
        dtype=torch.float32,
        window=window,
        sinks=head_sinks(heads),
    )


def test_sinks_in_half_precision_and_of_the_model_dtype():
    """bf16 sinks (a bf16 model's parameter) are read as float32 logits."""
    sinks = head_sinks(6).bfloat16()
    run_decode(
        [1, 17, SPLIT_KEYS + 1],
        heads=6,
        kv_heads=2,
        head_dim=64,
        page=16,
        dtype=torch.bfloat16,
        window=None,
        sinks=sinks,
    )
    run_prefill(
        [(5, 70), (30, 30)], heads=6, kv_heads=2, head_dim=64, page=16, dtype=torch.bfloat16, window=50, sinks=sinks
    )


def test_sinks_are_checked():
    q, k_cache, v_cache, block_tables, lens = decode_inputs()
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale=0.25, sinks=torch.zeros(2, device=DEVICE))
    start = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="float"):
        paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            start,
            lens,
            max_query_len=1,
            scale=0.25,
            sinks=torch.zeros(4, dtype=torch.int32, device=DEVICE),
        )


def test_prefill_skips_key_tiles_before_the_window():
    """Key tiles wholly before a query tile's earliest window are never loaded: their values are
    NaN here, and a kernel that only masked them would multiply a zero weight by NaN."""
    seq_len, window = 200, 40
    k_cache, v_cache, block_tables, tables = paged_cache(
        [seq_len], kv_heads=2, head_dim=32, page=8, dtype=torch.float32
    )
    first_tile = (seq_len - 4 - window + 1) // KEY_TILE * KEY_TILE  # the tile holding the earliest visible key
    assert first_tile >= 2 * KEY_TILE
    for page in tables[0][: first_tile // 8]:
        k_cache[:, page] = float("nan")
        v_cache[:, page] = float("nan")
    q = torch.randn(4, 4, 32, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out = paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        torch.tensor([0, 4], dtype=torch.int32, device=DEVICE),
        torch.tensor([seq_len], dtype=torch.int32, device=DEVICE),
        max_query_len=4,
        scale=0.2,
        window=window,
    )
    expected = reference(
        q, k_cache.nan_to_num(), v_cache.nan_to_num(), tables, [4], [seq_len], scale=0.2, window=window
    )
    assert_matches(out, expected, torch.float32)


def test_decode_never_loads_keys_before_the_window():
    """Decode skips whole splits before the window and masks its loads, so NaN there never shows."""
    seq_len, window = 3 * SPLIT_KEYS, 20
    k_cache, v_cache, block_tables, tables = paged_cache(
        [seq_len], kv_heads=2, head_dim=32, page=8, dtype=torch.float32
    )
    for page in tables[0][: (seq_len - window) // 8]:
        k_cache[:, page] = float("nan")
        v_cache[:, page] = float("nan")
    q = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    lens = torch.tensor([seq_len], dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale=0.2, window=window)
    expected = reference(
        q, k_cache.nan_to_num(), v_cache.nan_to_num(), tables, [1], [seq_len], scale=0.2, window=window
    )
    assert_matches(out, expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_half_precision(dtype):
    run_decode([0, 1, 17, SPLIT_KEYS + 1], heads=6, kv_heads=2, head_dim=64, page=16, dtype=dtype, window=None)


def test_decode_row_ignores_block_table_width_and_padding_rows():
    """Split boundaries sit at fixed key positions: a wider table (more, empty splits) or other rows
    in the batch leave a sequence's output bitwise unchanged; a padding row outputs zeros."""
    seq_lens = [SPLIT_KEYS + 40, 0, 17]
    k_cache, v_cache, block_tables, _ = paged_cache(seq_lens, kv_heads=2, head_dim=32, page=8, dtype=torch.float32)
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    narrow = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale=0.2)
    wide_table = torch.cat([block_tables, torch.zeros_like(block_tables).repeat(1, 2)], dim=1)
    out = torch.full_like(q, float("nan"))
    wide = paged_decode_attention(q, k_cache, v_cache, wide_table, lens, scale=0.2, out=out)
    alone = paged_decode_attention(q[:1], k_cache, v_cache, block_tables[:1], lens[:1], scale=0.2)
    assert wide is out
    assert torch.equal(narrow, wide) and torch.equal(alone[0], narrow[0])
    assert torch.equal(narrow[1], torch.zeros_like(narrow[1]))


def test_decode_accepts_strided_query():
    """q may be a view (e.g. a slice of a fused qkv projection) as long as its last dim is contiguous."""
    k_cache, v_cache, block_tables, tables = paged_cache([20, 9], kv_heads=2, head_dim=32, page=8, dtype=torch.float32)
    fused = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    q = fused[:, :4]
    lens = torch.tensor([20, 9], dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale=0.3, window=6)
    assert_matches(out, reference(q, k_cache, v_cache, tables, [1, 1], [20, 9], scale=0.3, window=6), torch.float32)


def test_decode_leaves_its_arrival_counters_at_zero_and_repeats_bitwise():
    """The last split program of each (sequence, kv head) merges and zeroes its counter, so the next
    launch (or graph replay) starts from zero and computes the same bits."""
    seq_lens = [2 * SPLIT_KEYS + 5, 0, 3, SPLIT_KEYS]
    k_cache, v_cache, block_tables, tables = paged_cache(seq_lens, kv_heads=2, head_dim=32, page=8, dtype=torch.float32)
    q = torch.randn(4, 6, 32, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)

    first = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale=0.2, window=SPLIT_KEYS + 3)
    assert (arrival_counters(q.device, 1) == 0).all()
    second = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale=0.2, window=SPLIT_KEYS + 3)

    assert torch.equal(first, second)
    assert (arrival_counters(q.device, 1) == 0).all()
    expected = reference(q, k_cache, v_cache, tables, [1] * 4, seq_lens, scale=0.2, window=SPLIT_KEYS + 3)
    assert_matches(first, expected, torch.float32)


def test_arrival_counters_grow_and_keep_earlier_buffers():
    """A captured graph holds the address of the buffer it ran with: growing never frees it."""
    current = arrival_counters(DEVICE, 1)
    grown = arrival_counters(DEVICE, current.numel() + 1)
    assert grown.numel() > current.numel() and (grown == 0).all()
    assert arrival_counters(DEVICE, 1) is grown
    assert current.data_ptr() != grown.data_ptr() and (current == 0).all()


@pytest.mark.parametrize("heads,kv_heads,window", [(4, 2, None), (6, 2, 7), (6, 2, 100)])
def test_prefill_matches_reference(heads, kv_heads, window):
    run_prefill(PREFILL_SEQS, heads=heads, kv_heads=kv_heads, head_dim=32, page=8, dtype=torch.float32, window=window)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_half_precision(dtype):
    run_prefill([(5, 70), (30, 30), (1, 20)], heads=6, kv_heads=2, head_dim=64, page=16, dtype=dtype, window=50)


def test_prefill_leaves_padding_rows_alone():
    """Rows past query_start[-1] (a graph bucket's padding) are not written."""
    k_cache, v_cache, block_tables, _ = paged_cache([10], kv_heads=1, head_dim=16, page=8, dtype=torch.float32)
    q = torch.randn(6, 2, 16).to(DEVICE)
    query_start = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([10], dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, 7.0)
    paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start, lens, max_query_len=4, scale=0.25, out=out)
    assert (out[4:] == 7.0).all() and not (out[:4] == 7.0).any()


@pytest.mark.parametrize("window", [None, 37])
def test_kernels_agree_with_blockwise_backend(window):
    """The engine's current backend, fed the same batch through AttentionMetadata."""
    seqs = [(1, 300), (5, 41), (40, 40), (1, 17), (24, 130)]
    query_lens, seq_lens = [q for q, _ in seqs], [s for _, s in seqs]
    # The blockwise backend reads padding pages and relies on them being finite (the engine zero-fills).
    k_cache, v_cache, block_tables, tables = paged_cache(
        seq_lens, kv_heads=2, head_dim=32, page=16, dtype=torch.float32, poison_null_page=False
    )
    q = torch.randn(sum(query_lens), 6, 32, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    metadata = AttentionMetadata.build(
        query_lens=query_lens, seq_lens=seq_lens, block_tables=tables, page_size=16, device=DEVICE
    )
    expected = paged_attention_blockwise(q, k_cache, v_cache, metadata, scale=0.2, window=window)
    query_start = torch.tensor(metadata.query_start, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    prefill = paged_prefill_attention(
        q, k_cache, v_cache, block_tables, query_start, lens, max_query_len=40, scale=0.2, window=window
    )
    torch.testing.assert_close(prefill, expected, atol=1e-4, rtol=1e-4)
    decode_rows = [0, 3]
    decode = paged_decode_attention(
        q[[metadata.query_start[b] for b in decode_rows]],
        k_cache,
        v_cache,
        block_tables[decode_rows],
        lens[decode_rows],
        scale=0.2,
        window=window,
    )
    torch.testing.assert_close(decode, expected[[metadata.query_start[b] for b in decode_rows]], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 37])
def test_prefill_with_first_readable_keys_agrees_with_blockwise_backend(window):
    """A window replay's segment (workers.engine.kv.window_replay): no query reads a key before its
    sequence's first readable key, on the kernels as on the engine's reference backend."""
    seqs = [(5, 41), (40, 100), (24, 130), (3, 3)]
    # A replay's queries start at its first readable key or, in a later chunk, past it: at the first
    # query, in the cached context before it, at a first query past a key tile, none.
    first_keys = [36, 50, 106, 0]
    query_lens, seq_lens = [q for q, _ in seqs], [s for _, s in seqs]
    k_cache, v_cache, block_tables, tables = paged_cache(
        seq_lens, kv_heads=2, head_dim=32, page=16, dtype=torch.float32, poison_null_page=False
    )
    q = torch.randn(sum(query_lens), 6, 32, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    metadata = AttentionMetadata.build(
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_tables=tables,
        page_size=16,
        device=DEVICE,
        first_keys=first_keys,
    )
    expected = paged_attention_blockwise(q, k_cache, v_cache, metadata, scale=0.2, window=window)
    prefill = paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        torch.tensor(metadata.query_start, dtype=torch.int32, device=DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        max_query_len=40,
        scale=0.2,
        window=window,
        first_keys=torch.tensor(first_keys, dtype=torch.int32, device=DEVICE),
    )
    torch.testing.assert_close(prefill, expected, atol=1e-4, rtol=1e-4)


def decode_inputs():
    k_cache, v_cache, block_tables, _ = paged_cache([12, 5], kv_heads=2, head_dim=16, page=8, dtype=torch.float32)
    q = torch.randn(2, 4, 16).to(DEVICE)
    return q, k_cache, v_cache, block_tables, torch.tensor([12, 5], dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize(
    "break_inputs,message",
    [
        (lambda q, k, v, t, s: (q, k, v, t, s.long()), "seq_lens must be int32"),
        (lambda q, k, v, t, s: (q, k, v, t.long(), s), "block_tables must be int32"),
        (lambda q, k, v, t, s: (q[..., :8].contiguous(), k, v, t, s), "head_dim"),
        (lambda q, k, v, t, s: (q[:, :3].contiguous(), k, v, t, s), "not a multiple"),
        (lambda q, k, v, t, s: (q, k, torch.cat([v, v], dim=1)[:, ::2], t, s), "contiguous"),
        (lambda q, k, v, t, s: (q, k, v.half(), t, s), "share a dtype"),
        (lambda q, k, v, t, s: (q.double(), k.double(), v.double(), t, s), "dtypes"),
        (lambda q, k, v, t, s: (q[:1], k, v, t, s), "rows for 2 sequences"),
        (lambda q, k, v, t, s: (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, t, s), "last dim"),
    ],
)
def test_decode_rejects_bad_inputs(break_inputs, message):
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(*break_inputs(*decode_inputs()), scale=0.25)


def test_rejects_cache_beyond_int32_offsets():
    k_cache = torch.empty(1, 2**20 + 1, 16, 128, device="meta")
    q = torch.empty(1, 2, 128, device="meta")
    table, lens = torch.ones(1, 1, dtype=torch.int32, device="meta"), torch.ones(1, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="int32 offsets"):
        paged_decode_attention(q, k_cache, k_cache, table, lens, scale=1.0)


def test_prefill_rejects_bad_inputs():
    q, k_cache, v_cache, block_tables, lens = decode_inputs()
    good_start = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="query_start must be int32"):
        paged_prefill_attention(q, k_cache, v_cache, block_tables, good_start.long(), lens, max_query_len=1, scale=1.0)
    with pytest.raises(ValueError, match=r"query_start must be \[B \+ 1\]"):
        paged_prefill_attention(q, k_cache, v_cache, block_tables, good_start[:2], lens, max_query_len=1, scale=1.0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_prefill_attention(q[..., :8], k_cache, v_cache, block_tables, good_start, lens, max_query_len=1, scale=1)


def test_check_supported_names_the_setting():
    check_supported(64, torch.bfloat16)
    with pytest.raises(ValueError, match="attention_backend='triton'.*head_dim=80"):
        check_supported(80, torch.float16)
    with pytest.raises(ValueError, match="attention_backend='triton'.*float64"):
        check_supported(64, torch.float64)


# SmolLM2-135M: 9 query heads over 3 kv heads of 64; engine pages of 16.
@pytest.mark.parametrize("window", [None, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_smollm2_sizes(dtype, window):
    lens = [0, 1, 600, *random.Random(1).choices(range(1, 601), k=61)]
    out = run_decode(lens, heads=9, kv_heads=3, head_dim=64, page=16, dtype=dtype, window=window)
    wide = run_decode(lens, heads=9, kv_heads=3, head_dim=64, page=16, dtype=dtype, window=window, extra_columns=40)
    assert torch.equal(out, wide)  # more (empty) splits change no bit


@pytest.mark.parametrize("window", [None, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.gpu
@needs_cuda
def test_gpu_prefill_smollm2_sizes(dtype, window):
    rng = random.Random(2)
    seqs = [(600, 600), (1, 600), (150, 600)]
    for _ in range(61):
        s_len = rng.randint(1, 600)
        seqs.append((rng.randint(1, s_len), s_len))
    run_prefill(seqs, heads=9, kv_heads=3, head_dim=64, page=16, dtype=dtype, window=window)


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_replays_in_a_cuda_graph():
    """One launch per call, replayable: new queries and shorter sequences in the captured buffers give
    the reference's output at every replay."""
    rng = random.Random(3)
    lens = [0, 1, 600, *rng.choices(range(1, 601), k=29)]
    k_cache, v_cache, block_tables, tables = paged_cache(
        lens, kv_heads=3, head_dim=64, page=16, dtype=torch.bfloat16, extra_columns=8
    )
    q = torch.randn(len(lens), 9, 64, device=DEVICE, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)
    paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=0.125, out=out)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=0.125, out=out)

    for _ in range(3):
        shorter = [max(length - rng.randrange(0, 300), 0) if length else 0 for length in lens]
        q.copy_(torch.randn_like(q))
        seq_lens.copy_(torch.tensor(shorter, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        expected = reference(q, k_cache, v_cache, tables, [1] * len(lens), shorter, scale=0.125, window=None)
        assert_matches(out, expected, torch.bfloat16)
        assert (arrival_counters(q.device, 1) == 0).all()


def test_mla_path_refuses_sinks():
    """A value cache narrower than the keys is MLA's latent, whose kernels have no sinks."""
    from kernels.attention.triton.backend import TritonBackend

    latent = torch.zeros(1, 4, 16, 48, device=DEVICE)
    q = torch.zeros(2, 4, 48, device=DEVICE)
    with pytest.raises(ValueError, match="MLA kernels have no attention sinks"):
        TritonBackend()(q, latent, latent[..., :32], None, scale=0.1, sinks=torch.zeros(4, device=DEVICE))
