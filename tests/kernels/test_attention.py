import importlib.util
import random

import pytest
import torch

from kernels.attention import (
    TORCH_BACKENDS,
    AttentionMetadata,
    batch_invariant,
    default_backend,
    get_backend,
    sdpa_is_batch_invariant,
    write_kv,
)

PAGE = 16
KV_HEADS, HEADS, HEAD_DIM = 2, 6, 32


def naive_attention(q, k, v, positions, window, sinks=None):
    """float64 softmax attention of queries at `positions` over keys 0..len(k)-1; with `sinks`, each
    head's sink logit joins its softmax and adds no value."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * HEAD_DIM**-0.5
    key_pos = torch.arange(k.shape[0])
    mask = key_pos[None, :] <= positions[:, None]
    if window is not None:
        mask &= key_pos[None, :] > positions[:, None] - window
    scores = scores.masked_fill(~mask[None], float("-inf"))
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    sink_column = sinks.double()[:, None, None].expand(-1, q.shape[0], 1)
    probs = torch.cat([scores, sink_column], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_batch(seqs, seed=0, first_keys=None):
    """Random keys/values per sequence scattered over shuffled pages; returns cache + metadata (with
    these first readable keys)."""
    gen = torch.Generator().manual_seed(seed)
    total_pages = 1 + sum(-(-s // PAGE) for _, s in seqs)
    free = list(range(1, total_pages))
    random.Random(seed).shuffle(free)
    k_cache = torch.zeros(KV_HEADS, total_pages, PAGE, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    tables, slots, queries, full_kv = [], [], [], []
    for q_len, s_len in seqs:
        table = [free.pop() for _ in range(-(-s_len // PAGE))]
        k = torch.randn(s_len, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(s_len, KV_HEADS, HEAD_DIM, generator=gen)
        # The cached context goes straight into the pages; the new tokens through write_kv below.
        for pos in range(s_len):
            k_cache[:, table[pos // PAGE], pos % PAGE] = k[pos]
            v_cache[:, table[pos // PAGE], pos % PAGE] = v[pos]
        tables.append(table)
        slots += [table[p // PAGE] * PAGE + p % PAGE for p in range(s_len - q_len, s_len)]
        queries.append(torch.randn(q_len, HEADS, HEAD_DIM, generator=gen))
        full_kv.append((k, v))
    metadata = AttentionMetadata.build(
        query_lens=[q for q, _ in seqs],
        seq_lens=[s for _, s in seqs],
        block_tables=tables,
        page_size=PAGE,
        device=torch.device("cpu"),
        first_keys=first_keys,
    )
    assert metadata.slot_mapping.tolist() == slots
    return torch.cat(queries), k_cache, v_cache, metadata, full_kv


MIXED = [(1, 1), (1, 37), (5, 300), (40, 40), (17, 530), (3, 16), (12, 12)]


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@pytest.mark.parametrize("window", [None, 7, 100])
def test_backends_match_naive_attention(backend, window):
    query, k_cache, v_cache, metadata, full_kv = paged_batch(MIXED)
    out = get_backend(backend)(query, k_cache, v_cache, metadata, scale=HEAD_DIM**-0.5, window=window)
    for b, (q_len, s_len) in enumerate(MIXED):
        rows = slice(metadata.query_start[b], metadata.query_start[b + 1])
        k, v = full_kv[b]
        expected = naive_attention(query[rows], k, v, torch.arange(s_len - q_len, s_len), window)
        torch.testing.assert_close(out[rows].double(), expected, atol=2e-5, rtol=1e-5)


def test_padding_rows_past_the_batch_are_left_zero():
    query, k_cache, v_cache, metadata, _ = paged_batch([(3, 20)])
    padded = torch.cat([query, torch.randn(13, HEADS, HEAD_DIM)])
    out = get_backend("torch_blockwise")(padded, k_cache, v_cache, metadata, scale=0.1)
    assert torch.count_nonzero(out[3:]) == 0


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@pytest.mark.parametrize("window", [None, 9])
def test_cpu_backends_are_bitwise_batch_invariant(backend, window):
    """A sequence's rows are bitwise equal alone, inside a mixed batch, decoded or prefilled."""
    attend = get_backend(backend)
    seq = (1, 300)
    alone = paged_batch([seq], seed=3)
    out_alone = attend(alone[0], alone[1], alone[2], alone[3], scale=0.2, window=window)

    batch = paged_batch([(7, 600), seq, (1, 5), (30, 30)], seed=4)
    # Put the same sequence's data into the batch's pages.
    _, k_cache, v_cache, metadata, _ = batch
    query = batch[0].clone()
    table_alone = alone[3].groups[0].block_tables[0]
    table_batch = metadata.groups[0].block_tables[1]  # group 0 = short-query sequences (b=1, b=2)
    for page_a, page_b in zip(table_alone.tolist(), table_batch.tolist()):
        k_cache[:, page_b] = alone[1][:, page_a]
        v_cache[:, page_b] = alone[2][:, page_a]
    row = metadata.query_start[1]
    query[row] = alone[0][0]
    out_batch = attend(query, k_cache, v_cache, metadata, scale=0.2, window=window)
    assert torch.equal(out_batch[row], out_alone[0])

    # The same token computed as the last row of a 300-token prefill.
    prefill = paged_batch([(300, 300)], seed=3)
    q_prefill = prefill[0].clone()
    q_prefill[-1] = alone[0][0]
    k_p, v_p = prefill[1], prefill[2]
    for page_a, page_b in zip(table_alone.tolist(), prefill[3].groups[0].block_tables[0].tolist()):
        k_p[:, page_b] = alone[1][:, page_a]
        v_p[:, page_b] = alone[2][:, page_a]
    out_prefill = attend(q_prefill, k_p, v_p, prefill[3], scale=0.2, window=window)
    assert torch.equal(out_prefill[-1], out_alone[0])


def test_write_kv_stores_at_slots():
    k_cache = torch.zeros(KV_HEADS, 3, PAGE, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(2, KV_HEADS, HEAD_DIM)
    write_kv(k_cache, v_cache, key, -key, torch.tensor([PAGE + 3, 2 * PAGE]))
    assert torch.equal(k_cache[:, 1, 3], key[0]) and torch.equal(k_cache[:, 2, 0], key[1])
    assert torch.equal(v_cache[:, 2, 0], -key[1])


def test_write_kv_skips_slot_minus_one():
    k_cache = torch.zeros(KV_HEADS, 3, PAGE, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(3, KV_HEADS, HEAD_DIM)
    write_kv(k_cache, v_cache, key, -key, torch.tensor([-1, PAGE + 3, -1]))
    assert torch.equal(k_cache[:, 1, 3], key[1]) and torch.equal(v_cache[:, 1, 3], -key[1])
    assert torch.count_nonzero(k_cache) == KV_HEADS * HEAD_DIM  # nothing else, the null page untouched


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@pytest.mark.parametrize("window", [None, 7])
def test_a_first_readable_key_hides_the_keys_before_it(backend, window):
    """A window replay's segment (kv.window_replay): queries read no key before the sequence's first."""
    seqs = [(12, 40), (3, 20)]
    first_keys = [20, 17]  # the first query of the second sequence is its first readable key
    query, k_cache, v_cache, replaying, full_kv = paged_batch(seqs, first_keys=first_keys)
    out = get_backend(backend)(query, k_cache, v_cache, replaying, scale=HEAD_DIM**-0.5, window=window)
    for b, ((q_len, s_len), first) in enumerate(zip(seqs, first_keys)):
        rows = slice(replaying.query_start[b], replaying.query_start[b + 1])
        k, v = full_kv[b]
        expected = naive_attention(
            query[rows], k[first:], v[first:], torch.arange(s_len - q_len, s_len) - first, window
        )
        torch.testing.assert_close(out[rows].double(), expected, atol=2e-5, rtol=1e-5)


def test_tokens_before_the_first_written_position_get_slot_minus_one():
    metadata = AttentionMetadata.build(
        query_lens=[6, 2],
        seq_lens=[10, 2],
        block_tables=[[3, 1, 4], [2]],
        page_size=4,
        device=torch.device("cpu"),
        first_written=[8, 0],
    )
    # Positions 4..9 of the first sequence, 0..1 of the second: 4..7 are a replay's, written nowhere.
    assert metadata.slot_mapping.tolist() == [-1, -1, -1, -1, 16, 17, 8, 9]


def test_shape_checks_name_the_problem():
    query, k_cache, v_cache, metadata, _ = paged_batch([(2, 4)])
    with pytest.raises(ValueError, match="query must be"):
        get_backend("torch_blockwise")(query[0], k_cache, v_cache, metadata, scale=1.0)
    with pytest.raises(ValueError, match="do not fit"):
        get_backend("torch_sdpa")(query[:, :5], k_cache, v_cache, metadata, scale=1.0)
    with pytest.raises(ValueError, match="unknown attention_backend"):
        get_backend("flash")
    with pytest.raises(ValueError, match="query_len"):
        AttentionMetadata.build(
            query_lens=[5], seq_lens=[3], block_tables=[[1]], page_size=PAGE, device=torch.device("cpu")
        )
    with pytest.raises(ValueError, match="fewer pages"):
        AttentionMetadata.build(
            query_lens=[5], seq_lens=[40], block_tables=[[1]], page_size=PAGE, device=torch.device("cpu")
        )


@pytest.mark.parametrize("window", [None, 37])
def test_startup_probe_passes_for_the_blockwise_backend(window):
    assert batch_invariant(get_backend("torch_blockwise"), window=window, seed=5)


@pytest.mark.parametrize("window", [None, 37])
def test_sdpa_over_several_key_splits_is_batch_invariant_where_the_probe_says_so(window):
    # torch's CPU flash kernel is batch-invariant past one key split only where the BLAS under it
    # gives rows that do not depend on the row count; CI once ran on a CPU where it did not.
    if not sdpa_is_batch_invariant():
        pytest.skip("torch's SDPA is not batch-invariant over several key splits on this CPU")
    assert batch_invariant(get_backend("torch_sdpa"), window=window, seed=5)


def test_defaults_per_device():
    assert default_backend(torch.device("cpu")) == "torch_blockwise"
    expected = "triton" if importlib.util.find_spec("triton") else "torch_sdpa"
    assert default_backend(torch.device("cuda")) == expected


def test_the_probe_catches_a_backend_that_is_not_invariant():
    def chunk_sensitive(query, k_cache, v_cache, metadata, *, scale, window=None):
        # Rounds differently depending on how many tokens share the call, as an unpadded BLAS would.
        out = get_backend("torch_blockwise")(query, k_cache, v_cache, metadata, scale=scale, window=window)
        return out + metadata.num_tokens * 1e-7

    assert not batch_invariant(chunk_sensitive, window=None, seed=0)


def test_blockwise_strategies_give_the_same_bits(monkeypatch):
    """Decode-sized groups attend all key blocks at once, prefill-sized ones block by block."""
    import kernels.attention.torch_blockwise.attention as blockwise

    query, k_cache, v_cache, metadata, _ = paged_batch(MIXED, seed=7)
    attend = get_backend("torch_blockwise")
    at_once = attend(query, k_cache, v_cache, metadata, scale=0.3, window=11)
    monkeypatch.setattr(blockwise, "BATCHED_ELEMENTS", 0)
    block_by_block = attend(query, k_cache, v_cache, metadata, scale=0.3, window=11)
    assert torch.equal(at_once, block_by_block)
