"""The Triton MLA kernels (absorbed multi-head latent attention decode and prefill, and the rope plus
latent-cache write) against float64 / plain-torch references, and the Triton backend's MLA dispatch.

Without CUDA the kernels run in Triton's interpreter on the CPU, so latents stay tiny (32 + 16); the
`gpu` tests repeat the comparisons at DeepSeek's 512 + 64 with 16 and 128 heads on a CUDA device.
"""

import os
import random
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated, so set it first
triton = pytest.importorskip("triton")

from kernels.attention import NULL_PAGE  # noqa: E402
from kernels.attention.backend import DeviceStepTensors  # noqa: E402
from kernels.attention.triton import check_mla_supported, paged_mla_decode, paged_mla_prefill  # noqa: E402
from kernels.attention.triton.backend import TritonBackend  # noqa: E402
from kernels.attention.triton.decode import arrival_counters  # noqa: E402
from kernels.attention.triton.mla_decode import DECODE_CONFIG, MIN_SPLIT_KEYS, MlaDecodeConfig  # noqa: E402
from kernels.fused.mla_rotary import mla_rope_and_cache_write, mla_rope_and_cache_write_reference  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
V_DIM, ROPE_DIM = 32, 16  # the CPU tests' latent: compressed 32 + rope 16
DEEPSEEK_V_DIM, DEEPSEEK_ROPE_DIM = 512, 64


def latent_cache(seq_lens, *, latent_dim, page, dtype, seed=0, extra_columns=0):
    """A random latent cache [1, pages, page, latent_dim] with each sequence's pages shuffled over the
    pool, and int32 block tables padded with NULL_PAGE (plus `extra_columns`, like a graph bucket's
    wider table). Page 0 holds NaN: a kernel that reads a padding entry poisons its output."""
    pages_per_seq = [-(-s // page) for s in seq_lens]
    num_pages = 1 + sum(pages_per_seq) + 3
    cache = torch.randn(1, num_pages, page, latent_dim, generator=torch.Generator().manual_seed(seed))
    cache[:, NULL_PAGE] = float("nan")
    free = list(range(1, num_pages))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in pages_per_seq]
    block_tables = torch.full((len(seq_lens), max(pages_per_seq) + extra_columns), NULL_PAGE, dtype=torch.int32)
    for row, table in enumerate(tables):
        block_tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return cache.to(DEVICE, dtype), block_tables.to(DEVICE), tables


def reference(q, cache, tables, query_lens, seq_lens, *, v_dim, scale):
    """float64 absorbed MLA: every head attends to the gathered latents, values their first v_dim columns."""
    q, cache = q.cpu().double(), cache.cpu().double()
    rows, start = [], 0
    for table, q_len, s_len in zip(tables, query_lens, seq_lens, strict=True):
        if s_len == 0:
            rows.append(torch.zeros(q_len, q.shape[1], v_dim, dtype=torch.float64))
        else:
            latents = cache[0, torch.tensor(table, dtype=torch.long)].flatten(0, 1)[:s_len]  # [keys, Dk]
            scores = torch.einsum("thd,kd->htk", q[start : start + q_len], latents) * scale
            visible = torch.arange(s_len)[None, :] <= torch.arange(s_len - q_len, s_len)[:, None]
            probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
            rows.append(torch.einsum("htk,kd->thd", probs, latents[:, :v_dim]))
        start += q_len
    return torch.cat(rows)


def assert_matches(out, expected, dtype):
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu().double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def run_decode(seq_lens, *, heads, v_dim, rope_dim, page, dtype, seed=0, extra_columns=0, config=None):
    cache, block_tables, tables = latent_cache(
        seq_lens, latent_dim=v_dim + rope_dim, page=page, dtype=dtype, seed=seed, extra_columns=extra_columns
    )
    q = torch.randn(len(seq_lens), heads, v_dim + rope_dim, generator=torch.Generator().manual_seed(seed + 1))
    q = q.to(DEVICE, dtype)
    scale = (v_dim + rope_dim) ** -0.5
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = paged_mla_decode(q, cache, block_tables, lens, v_dim=v_dim, scale=scale, config=config)
    expected = reference(q, cache, tables, [1] * len(seq_lens), seq_lens, v_dim=v_dim, scale=scale)
    assert out.dtype == dtype and out.shape == (len(seq_lens), heads, v_dim)
    assert_matches(out, expected, dtype)
    return out


def run_prefill(seqs, *, heads, v_dim, rope_dim, page, dtype, seed=0):
    query_lens, seq_lens = [q for q, _ in seqs], [s for _, s in seqs]
    cache, block_tables, tables = latent_cache(seq_lens, latent_dim=v_dim + rope_dim, page=page, dtype=dtype, seed=seed)
    q = torch.randn(sum(query_lens), heads, v_dim + rope_dim, generator=torch.Generator().manual_seed(seed + 1))
    q = q.to(DEVICE, dtype)
    query_start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    scale = (v_dim + rope_dim) ** -0.5
    out = paged_mla_prefill(
        q,
        cache,
        block_tables,
        query_start,
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        max_query_len=max(query_lens),
        v_dim=v_dim,
        scale=scale,
    )
    expected = reference(q, cache, tables, query_lens, seq_lens, v_dim=v_dim, scale=scale)
    assert out.dtype == dtype and out.shape == (sum(query_lens), heads, v_dim)
    assert_matches(out, expected, dtype)


# Ragged: a padding row, one key, a full page, one past it, and rows of two and three splits.
DECODE_LENS = [0, 1, 8, 9, 45, MIN_SPLIT_KEYS + 1, 2 * MIN_SPLIT_KEYS + 88]
# (new tokens, tokens in context): extends of a cached prefix, fresh prompts, a lone decode token,
# and queries long enough for several query tiles.
PREFILL_SEQS = [(5, 300), (40, 40), (3, 16), (1, 37), (12, 12)]


# 4 heads: one block of 16 rows, mostly idle; 20: a full block and a partial one.
@pytest.mark.parametrize("heads", [4, 20])
def test_decode_matches_reference(heads):
    run_decode(DECODE_LENS, heads=heads, v_dim=V_DIM, rope_dim=ROPE_DIM, page=8, dtype=torch.float32)


def test_decode_with_few_splits_of_many_keys():
    """Two splits over 700 keys: a split of 352 keys, longer than MIN_SPLIT_KEYS, ending mid-page."""
    config = replace(DECODE_CONFIG, num_splits=2)
    run_decode([700, 3, 0], heads=4, v_dim=V_DIM, rope_dim=ROPE_DIM, page=16, dtype=torch.float32, config=config)


# 64 heads a program on 70 heads: a full block and one mostly idle; and partials kept in bfloat16,
# short key tiles, one pipeline stage.
@pytest.mark.parametrize(
    "config, dtype",
    [
        (MlaDecodeConfig(64, 32, 8, 2, num_splits=4, partial_dtype=torch.float32), torch.float32),
        (MlaDecodeConfig(16, 16, 4, 1, num_splits=3, partial_dtype=torch.bfloat16), torch.bfloat16),
    ],
    ids=["64 heads a program", "bf16 partials"],
)
def test_decode_matches_reference_in_every_config(config, dtype):
    run_decode(DECODE_LENS, heads=70, v_dim=V_DIM, rope_dim=ROPE_DIM, page=8, dtype=dtype, config=config)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_half_precision(dtype):
    run_decode([0, 1, 17, MIN_SPLIT_KEYS + 5], heads=6, v_dim=64, rope_dim=ROPE_DIM, page=16, dtype=dtype)


def test_decode_row_ignores_block_table_width_and_batch():
    """A row's splits follow its own length: a wider table or other rows in the batch leave its
    output bitwise unchanged; a padding row outputs zeros, whatever `out` held."""
    seq_lens = [MIN_SPLIT_KEYS + 40, 0, 17]
    cache, block_tables, _ = latent_cache(seq_lens, latent_dim=V_DIM + ROPE_DIM, page=8, dtype=torch.float32)
    q = torch.randn(3, 4, V_DIM + ROPE_DIM, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    narrow = paged_mla_decode(q, cache, block_tables, lens, v_dim=V_DIM, scale=0.2)
    wide_table = torch.cat([block_tables, torch.zeros_like(block_tables).repeat(1, 2)], dim=1)
    out = torch.full((3, 4, V_DIM), float("nan"), device=DEVICE)
    wide = paged_mla_decode(q, cache, wide_table, lens, v_dim=V_DIM, scale=0.2, out=out)
    alone = paged_mla_decode(q[:1], cache, block_tables[:1], lens[:1], v_dim=V_DIM, scale=0.2)
    assert wide is out
    assert torch.equal(narrow, wide) and torch.equal(alone[0], narrow[0])
    assert torch.equal(narrow[1], torch.zeros_like(narrow[1]))


def test_decode_accepts_strided_query():
    """The query may be a view (its heads a slice of a wider projection) with a contiguous last dim."""
    seq_lens = [20, 9]
    cache, block_tables, tables = latent_cache(seq_lens, latent_dim=V_DIM + ROPE_DIM, page=8, dtype=torch.float32)
    wider = torch.randn(2, 10, V_DIM + ROPE_DIM, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    q = wider[:, 2:7]
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = paged_mla_decode(q, cache, block_tables, lens, v_dim=V_DIM, scale=0.3)
    assert_matches(out, reference(q, cache, tables, [1, 1], seq_lens, v_dim=V_DIM, scale=0.3), torch.float32)


def test_decode_leaves_its_arrival_counters_at_zero_and_repeats_bitwise():
    seq_lens = [2 * MIN_SPLIT_KEYS + 5, 0, 3, MIN_SPLIT_KEYS]
    cache, block_tables, tables = latent_cache(seq_lens, latent_dim=V_DIM + ROPE_DIM, page=8, dtype=torch.float32)
    q = torch.randn(4, 20, V_DIM + ROPE_DIM, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    first = paged_mla_decode(q, cache, block_tables, lens, v_dim=V_DIM, scale=0.2)
    assert (arrival_counters(q.device, 1) == 0).all()
    second = paged_mla_decode(q, cache, block_tables, lens, v_dim=V_DIM, scale=0.2)
    assert torch.equal(first, second)
    assert (arrival_counters(q.device, 1) == 0).all()
    assert_matches(first, reference(q, cache, tables, [1] * 4, seq_lens, v_dim=V_DIM, scale=0.2), torch.float32)


@pytest.mark.parametrize("heads", [4, 20])
def test_prefill_matches_reference(heads):
    run_prefill(PREFILL_SEQS, heads=heads, v_dim=V_DIM, rope_dim=ROPE_DIM, page=8, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_half_precision(dtype):
    run_prefill([(5, 70), (30, 30), (1, 20)], heads=6, v_dim=64, rope_dim=ROPE_DIM, page=16, dtype=dtype)


def test_prefill_leaves_rows_past_the_last_sequence_alone():
    """Rows past query_start[-1] (a graph bucket's padding) are not written."""
    cache, block_tables, _ = latent_cache([10], latent_dim=V_DIM + ROPE_DIM, page=8, dtype=torch.float32)
    q = torch.randn(6, 2, V_DIM + ROPE_DIM).to(DEVICE)
    query_start = torch.tensor([0, 4], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([10], dtype=torch.int32, device=DEVICE)
    out = torch.full((6, 2, V_DIM), 7.0, device=DEVICE)
    paged_mla_prefill(q, cache, block_tables, query_start, lens, max_query_len=4, v_dim=V_DIM, scale=0.25, out=out)
    assert (out[4:] == 7.0).all() and not (out[:4] == 7.0).any()


def step_tensors(query_lens, seq_lens, block_tables):
    query_start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    return DeviceStepTensors(
        positions=torch.zeros(sum(query_lens), dtype=torch.int64, device=DEVICE),  # the kernels do not read them
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        query_start=query_start,
        block_tables=block_tables,
        max_query_len=max(query_lens),
        decode_only=all(q == 1 for q in query_lens),
    )


def test_backend_sends_a_narrow_value_view_to_the_mla_kernels():
    """v_cache = k_cache[..., :Dv] means MLA: a decode step and a mixed step both match the reference."""
    backend = TritonBackend()
    for seqs in ([(1, 300), (1, 9), (1, 0)], [(1, 300), (6, 40), (12, 12)]):
        query_lens, seq_lens = [q for q, _ in seqs], [s for _, s in seqs]
        cache, block_tables, tables = latent_cache(seq_lens, latent_dim=V_DIM + ROPE_DIM, page=8, dtype=torch.float32)
        q = torch.randn(sum(query_lens), 4, V_DIM + ROPE_DIM, generator=torch.Generator().manual_seed(2)).to(DEVICE)
        out = backend(q, cache, cache[..., :V_DIM], step_tensors(query_lens, seq_lens, block_tables), scale=0.2)
        assert_matches(out, reference(q, cache, tables, query_lens, seq_lens, v_dim=V_DIM, scale=0.2), torch.float32)


def test_backend_refuses_a_value_cache_that_is_not_the_latent_view():
    cache, block_tables, _ = latent_cache([9], latent_dim=V_DIM + ROPE_DIM, page=8, dtype=torch.float32)
    q = torch.randn(1, 4, V_DIM + ROPE_DIM).to(DEVICE)
    metadata = step_tensors([1], [9], block_tables)
    with pytest.raises(ValueError, match=r"k_cache\[\.\.\., :v_dim\]"):
        TritonBackend()(q, cache, cache[..., :V_DIM].clone(), metadata, scale=0.2)
    with pytest.raises(ValueError, match="latent cache is"):
        TritonBackend()(q, cache.expand(2, -1, -1, -1), cache.expand(2, -1, -1, -1)[..., :V_DIM], metadata, scale=0.2)
    with pytest.raises(ValueError, match="sliding window"):
        TritonBackend()(q, cache, cache[..., :V_DIM], metadata, scale=0.2, window=4)


def test_check_model_accepts_mla_widths_with_value_dim():
    backend = TritonBackend()
    backend.check_model(head_dim=576, value_dim=512, dtype=torch.bfloat16, device=DEVICE)
    backend.check_model(head_dim=64, value_dim=64, dtype=torch.bfloat16, device=DEVICE)  # plain attention
    with pytest.raises(ValueError, match="attention_backend='triton'.*head_dim=576"):
        backend.check_model(head_dim=576, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="rope dim.*got 48"):
        check_mla_supported(560, 512, torch.bfloat16)
    with pytest.raises(ValueError, match="kv_lora_rank.*got 500"):
        check_mla_supported(564, 500, torch.bfloat16)
    with pytest.raises(ValueError, match="float64"):
        check_mla_supported(576, 512, torch.float64)


def decode_inputs():
    cache, block_tables, _ = latent_cache([12, 5], latent_dim=V_DIM + ROPE_DIM, page=8, dtype=torch.float32)
    q = torch.randn(2, 4, V_DIM + ROPE_DIM).to(DEVICE)
    return q, cache, block_tables, torch.tensor([12, 5], dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize(
    "break_inputs,message",
    [
        (lambda q, c, t, s: (q, c, t, s.long()), "seq_lens must be int32"),
        (lambda q, c, t, s: (q, c, t.long(), s), "block_tables must be int32"),
        (lambda q, c, t, s: (q[..., :40].contiguous(), c, t, s), "does not match"),
        (lambda q, c, t, s: (q, c.expand(2, -1, -1, -1), t, s), r"\[1, pages, page_size"),
        (lambda q, c, t, s: (q, torch.cat([c, c], dim=2)[:, :, ::2], t, s), "contiguous"),
        (lambda q, c, t, s: (q, c.half(), t, s), "share a dtype"),
        (lambda q, c, t, s: (q.double(), c.double(), t, s), "dtypes"),
        (lambda q, c, t, s: (q[:1], c, t, s), "rows for 2 sequences"),
        (lambda q, c, t, s: (q.transpose(1, 2).contiguous().transpose(1, 2), c, t, s), "last dim"),
    ],
)
def test_decode_rejects_bad_inputs(break_inputs, message):
    with pytest.raises(ValueError, match=message):
        paged_mla_decode(*break_inputs(*decode_inputs()), v_dim=V_DIM, scale=0.25)


def test_decode_rejects_bad_value_dim_and_out():
    q, cache, tables, lens = decode_inputs()
    with pytest.raises(ValueError, match="kv_lora_rank.*power of two"):
        paged_mla_decode(q, cache, tables, lens, v_dim=40, scale=0.25)
    with pytest.raises(ValueError, match="out must be"):
        paged_mla_decode(q, cache, tables, lens, v_dim=V_DIM, scale=0.25, out=torch.empty_like(q))


def test_rejects_cache_beyond_int32_offsets():
    cache = torch.empty(1, 2**16, 64, 576, device="meta")
    q = torch.empty(1, 2, 576, device="meta")
    table, lens = torch.ones(1, 1, dtype=torch.int32, device="meta"), torch.ones(1, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="int32 offsets"):
        paged_mla_decode(q, cache, table, lens, v_dim=512, scale=1.0)


def test_prefill_rejects_bad_inputs():
    q, cache, block_tables, lens = decode_inputs()
    good_start = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    kwargs = {"max_query_len": 1, "v_dim": V_DIM, "scale": 1.0}
    with pytest.raises(ValueError, match="query_start must be int32"):
        paged_mla_prefill(q, cache, block_tables, good_start.long(), lens, **kwargs)
    with pytest.raises(ValueError, match=r"query_start must be \[B \+ 1\]"):
        paged_mla_prefill(q, cache, block_tables, good_start[:2], lens, **kwargs)
    with pytest.raises(ValueError, match="max_query_len"):
        paged_mla_prefill(q, cache, block_tables, good_start, lens, max_query_len=-1, v_dim=V_DIM, scale=1.0)


# --- rope + latent-cache write ---


def rope_tables(max_pos, rope_dim):
    """RotaryEmbedding's layout: [max_pos, R] angles, the R/2 frequencies repeated twice."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rope_dim, 2).float() / rope_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(DEVICE), angles.sin().to(DEVICE)


def rope_inputs(dtype, *, tokens=5, heads=3, compressed_dim=24, rope_dim=ROPE_DIM, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # The query as the model holds it: [T, H, nope + rope]; q_rope is its strided tail.
    query = torch.randn(tokens, heads, 8 + rope_dim, generator=generator).to(DEVICE, dtype)
    kv = torch.randn(tokens, compressed_dim + rope_dim, generator=generator).to(DEVICE, dtype)
    cache = torch.full((1, 4, 4, compressed_dim + rope_dim), float("nan"), dtype=dtype, device=DEVICE)
    positions = torch.tensor([0, 3, 17, 2, 40][:tokens], dtype=torch.int64, device=DEVICE)
    slots = torch.tensor([5, -1, 0, 15, 9][:tokens], dtype=torch.int64, device=DEVICE)
    return query, kv, cache, positions, slots


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_and_cache_write_matches_reference(interleave, dtype):
    cos, sin = rope_tables(64, ROPE_DIM)
    query, kv, cache, positions, slots = rope_inputs(dtype)
    results = []
    for write in (mla_rope_and_cache_write, mla_rope_and_cache_write_reference):
        q, c = query.clone(), cache.clone()
        write(q[..., 8:], kv[:, 24:], kv[:, :24], positions, cos, sin, c, slots, interleave=interleave)
        results.append((q, c))
    (q_kernel, cache_kernel), (q_ref, cache_ref) = results
    assert torch.equal(q_kernel[..., :8], query[..., :8])  # the no-rope part is left alone
    assert not torch.equal(q_kernel[..., 8:], query[..., 8:])
    torch.testing.assert_close(q_kernel, q_ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    torch.testing.assert_close(cache_kernel, cache_ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype], equal_nan=True)
    rows = cache_kernel.view(-1, cache.shape[-1])
    written = torch.tensor([0, 5, 9, 15])
    assert not rows[written].isnan().any()
    assert rows[[s for s in range(rows.shape[0]) if s not in written.tolist()]].isnan().all()  # nothing else
    assert torch.equal(rows[5, :24], kv[0, :24])  # the compressed part is copied as it is


def test_rope_reference_rotates_like_hf_deepseek_and_the_model():
    """interleave=True is HF DeepSeek-V3's apply_rotary_pos_emb_interleave, False the model's apply_rotary."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    from workers.engine.layers.rotary import apply_rotary

    cos, sin = rope_tables(64, ROPE_DIM)
    query, kv, cache, positions, slots = rope_inputs(torch.float32)
    for interleave in (True, False):
        q = query.clone()
        mla_rope_and_cache_write_reference(
            q[..., 8:], kv[:, 24:], kv[:, :24], positions, cos, sin, cache, slots, interleave=interleave
        )
        angle_cos, angle_sin = cos[positions], sin[positions]  # [T, R]
        if interleave:
            # HF's layout is [batch, heads, seq, dim]: tokens stand in for the batch here.
            expected, _ = apply_rotary_pos_emb_interleave(
                query[..., 8:], kv[:, None, 24:], angle_cos, angle_sin, unsqueeze_dim=1
            )
        else:
            expected = apply_rotary(query[..., 8:], angle_cos[:, None], angle_sin[:, None])
        torch.testing.assert_close(q[..., 8:], expected)


def test_rope_and_cache_write_rejects_bad_inputs():
    cos, sin = rope_tables(64, ROPE_DIM)
    query, kv, cache, positions, slots = rope_inputs(torch.float32)
    q_rope, k_rope, compressed = query[..., 8:], kv[:, 24:], kv[:, :24]
    cases = [
        ((q_rope[..., :15], k_rope, compressed, positions, cos, sin, cache, slots), "even"),
        ((q_rope, k_rope[:3], compressed, positions, cos, sin, cache, slots), "k_rope must be"),
        ((q_rope, k_rope, compressed[:, :20], positions, cos, sin, cache, slots), "compressed \\+ rope"),
        ((q_rope, k_rope, compressed, positions.int(), cos, sin, cache, slots), "positions must be int64"),
        ((q_rope, k_rope, compressed, positions, cos.double(), sin, cache, slots), "cos must be float32"),
        ((q_rope, k_rope, compressed, positions, cos, sin, cache.half(), slots), "latent_cache is"),
        ((q_rope, k_rope.t().contiguous().t(), compressed, positions, cos, sin, cache, slots), "k_rope's last"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            mla_rope_and_cache_write(*args, interleave=True)


# --- on a CUDA device, at DeepSeek's sizes ---


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_deepseek_sizes(heads):
    lens = [0, 1, 2000, *random.Random(1).choices(range(1, 2001), k=29)]
    kwargs = {"heads": heads, "v_dim": DEEPSEEK_V_DIM, "rope_dim": DEEPSEEK_ROPE_DIM, "page": 16}
    out = run_decode(lens, dtype=torch.bfloat16, **kwargs)
    wide = run_decode(lens, dtype=torch.bfloat16, extra_columns=40, **kwargs)
    assert torch.equal(out, wide)  # a wider table changes no bit
    run_decode(lens[:8], dtype=torch.float32, **kwargs)


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.gpu
@needs_cuda
def test_gpu_prefill_deepseek_sizes(heads):
    rng = random.Random(2)
    seqs = [(300, 300), (1, 600), (150, 600)]
    for _ in range(13):
        s_len = rng.randint(1, 600)
        seqs.append((rng.randint(1, s_len), s_len))
    kwargs = {"heads": heads, "v_dim": DEEPSEEK_V_DIM, "rope_dim": DEEPSEEK_ROPE_DIM, "page": 16}
    run_prefill(seqs, dtype=torch.bfloat16, **kwargs)
    run_prefill(seqs[:4], dtype=torch.float32, **kwargs)


@pytest.mark.gpu
@needs_cuda
def test_gpu_rope_and_cache_write_deepseek_sizes():
    cos, sin = rope_tables(4096, DEEPSEEK_ROPE_DIM)
    tokens, heads = 64, 128
    query = torch.randn(tokens, heads, 128 + DEEPSEEK_ROPE_DIM, device=DEVICE, dtype=torch.bfloat16)
    kv = torch.randn(tokens, DEEPSEEK_V_DIM + DEEPSEEK_ROPE_DIM, device=DEVICE, dtype=torch.bfloat16)
    cache = torch.zeros(1, 8, 16, DEEPSEEK_V_DIM + DEEPSEEK_ROPE_DIM, device=DEVICE, dtype=torch.bfloat16)
    positions = torch.randint(0, 4096, (tokens,), device=DEVICE)
    slots = torch.randperm(128, device=DEVICE)[:tokens]
    slots[::7] = -1
    results = []
    for write in (mla_rope_and_cache_write, mla_rope_and_cache_write_reference):
        q, c = query.clone(), cache.clone()
        write(q[..., 128:], kv[:, 512:], kv[:, :512], positions, cos, sin, c, slots, interleave=True)
        results.append((q, c))
    torch.testing.assert_close(results[0][0], results[1][0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(results[0][1], results[1][1], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_replays_in_a_cuda_graph():
    """One launch per call, replayable: new queries and shorter sequences in the captured buffers give
    the reference's output at every replay."""
    rng = random.Random(3)
    lens = [0, 1, 1500, *rng.choices(range(1, 1501), k=13)]
    latent_dim = DEEPSEEK_V_DIM + DEEPSEEK_ROPE_DIM
    cache, block_tables, tables = latent_cache(
        lens, latent_dim=latent_dim, page=16, dtype=torch.bfloat16, extra_columns=8
    )
    q = torch.randn(len(lens), 128, latent_dim, device=DEVICE, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = torch.empty(len(lens), 128, DEEPSEEK_V_DIM, device=DEVICE, dtype=torch.bfloat16)
    scale = latent_dim**-0.5
    paged_mla_decode(q, cache, block_tables, seq_lens, v_dim=DEEPSEEK_V_DIM, scale=scale, out=out)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_mla_decode(q, cache, block_tables, seq_lens, v_dim=DEEPSEEK_V_DIM, scale=scale, out=out)

    for _ in range(3):
        shorter = [max(length - rng.randrange(0, 700), 0) if length else 0 for length in lens]
        q.copy_(torch.randn_like(q))
        seq_lens.copy_(torch.tensor(shorter, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        expected = reference(q, cache, tables, [1] * len(lens), shorter, v_dim=DEEPSEEK_V_DIM, scale=scale)
        assert_matches(out, expected, torch.bfloat16)
        assert (arrival_counters(q.device, 1) == 0).all()
