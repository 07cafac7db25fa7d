"""Attention sinks in the torch backends: one logit per query head in every row's softmax
denominator, with no value; the rows stay batch-invariant on the CPU."""

import functools

import pytest
import torch

from kernels.attention import TORCH_BACKENDS, batch_invariant, get_backend, sdpa_is_batch_invariant
from tests.kernels.test_attention import HEAD_DIM, HEADS, MIXED, naive_attention, paged_batch


def test_sinks_change_the_output():
    query, k_cache, v_cache, metadata, _ = paged_batch([(4, 20)])
    attend = get_backend("torch_blockwise")
    plain = attend(query, k_cache, v_cache, metadata, scale=HEAD_DIM**-0.5)
    # A sink of -inf takes no weight; a large one takes almost all of it.
    silent = attend(query, k_cache, v_cache, metadata, scale=HEAD_DIM**-0.5, sinks=torch.full((HEADS,), -torch.inf))
    loud = attend(query, k_cache, v_cache, metadata, scale=HEAD_DIM**-0.5, sinks=torch.full((HEADS,), 30.0))
    assert torch.equal(silent, plain)
    assert loud.abs().max() < 1e-6 < plain.abs().max()


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@pytest.mark.parametrize("window", [None, 7, 100])
def test_backends_match_naive_attention(backend, window):
    query, k_cache, v_cache, metadata, full_kv = paged_batch(MIXED)
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(2)) * 2
    out = get_backend(backend)(query, k_cache, v_cache, metadata, scale=HEAD_DIM**-0.5, window=window, sinks=sinks)
    for b, (q_len, s_len) in enumerate(MIXED):
        rows = slice(metadata.query_start[b], metadata.query_start[b + 1])
        k, v = full_kv[b]
        expected = naive_attention(query[rows], k, v, torch.arange(s_len - q_len, s_len), window, sinks)
        torch.testing.assert_close(out[rows].double(), expected, atol=2e-5, rtol=1e-5)


def test_sdpa_sink_slot_fits_a_sequence_filling_its_key_blocks():
    """A 512-key sequence (CPU SDPA's key split) needs one more block for the sink's slot."""
    seqs = [(3, 512), (1, 511)]
    query, k_cache, v_cache, metadata, full_kv = paged_batch(seqs, seed=5)
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(6))
    out = get_backend("torch_sdpa")(query, k_cache, v_cache, metadata, scale=HEAD_DIM**-0.5, sinks=sinks)
    for b, (q_len, s_len) in enumerate(seqs):
        rows = slice(metadata.query_start[b], metadata.query_start[b + 1])
        expected = naive_attention(query[rows], *full_kv[b], torch.arange(s_len - q_len, s_len), None, sinks)
        torch.testing.assert_close(out[rows].double(), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@pytest.mark.parametrize("window", [None, 37])
def test_cpu_backends_with_sinks_are_bitwise_batch_invariant(backend, window):
    if backend == "torch_sdpa" and not sdpa_is_batch_invariant():
        pytest.skip("torch's SDPA is not batch-invariant over several key splits on this CPU")
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(3))  # batch_invariant's 6 query heads
    assert batch_invariant(functools.partial(get_backend(backend), sinks=sinks), window=window, seed=5)


def test_blockwise_strategies_give_the_same_bits_with_sinks(monkeypatch):
    import kernels.attention.torch_blockwise.attention as blockwise

    query, k_cache, v_cache, metadata, _ = paged_batch(MIXED, seed=7)
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(8))
    attend = get_backend("torch_blockwise")
    at_once = attend(query, k_cache, v_cache, metadata, scale=0.3, window=11, sinks=sinks)
    monkeypatch.setattr(blockwise, "BATCHED_ELEMENTS", 0)
    block_by_block = attend(query, k_cache, v_cache, metadata, scale=0.3, window=11, sinks=sinks)
    assert torch.equal(at_once, block_by_block)


@pytest.mark.parametrize("backend", TORCH_BACKENDS)
@pytest.mark.parametrize(
    "sinks, message", [(torch.zeros(HEADS - 1), r"shape \(6,\)"), (torch.zeros(HEADS, dtype=torch.long), "float")]
)
def test_bad_sinks_are_refused(backend, sinks, message):
    query, k_cache, v_cache, metadata, _ = paged_batch([(2, 4)])
    with pytest.raises(ValueError, match=message):
        get_backend(backend)(query, k_cache, v_cache, metadata, scale=1.0, sinks=sinks)
