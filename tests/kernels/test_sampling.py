import re
from collections import Counter

import numpy as np
import pytest
import torch

from kernels import sampling


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def _tied_weights(rng: np.random.Generator, rows: int, vocab: int) -> torch.Tensor:
    """Small integer weights: many ties, and every sum is exact in float32."""
    return torch.tensor(rng.integers(0, 6, size=(rows, vocab)), dtype=torch.float32)


def _kept(mask_row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(mask_row).flatten().tolist())


def test_token_counts_match_a_counter(rng: np.random.Generator) -> None:
    sequences = [rng.integers(0, 9, size=rng.integers(0, 30)).tolist() for _ in range(5)]
    row_ids = torch.tensor([row for row, tokens in enumerate(sequences) for _ in tokens], dtype=torch.int64)
    token_ids = torch.tensor([token for tokens in sequences for token in tokens], dtype=torch.int64)

    counts = sampling.token_counts(row_ids, token_ids, num_rows=5, vocab_size=9)

    assert counts.dtype == torch.int32
    for row, tokens in enumerate(sequences):
        expected = Counter(tokens)
        assert counts[row].tolist() == [expected[token] for token in range(9)]


def test_add_logit_bias_adds_at_each_pair_only(rng: np.random.Generator) -> None:
    logits = torch.tensor(rng.normal(size=(3, 6)), dtype=torch.float32)
    pairs = {(0, 1): 2.5, (0, 5): -100.0, (2, 1): 0.5}

    biased = sampling.add_logit_bias(
        logits,
        torch.tensor([row for row, _ in pairs], dtype=torch.int64),
        torch.tensor([token for _, token in pairs], dtype=torch.int64),
        torch.tensor(list(pairs.values()), dtype=torch.float32),
    )

    expected = logits.clone()
    for (row, token), bias in pairs.items():
        expected[row, token] += bias
    assert torch.equal(biased, expected)


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits(rng: np.random.Generator) -> None:
    logits = torch.tensor(rng.normal(size=(4, 10)), dtype=torch.float32)
    seen = torch.tensor(rng.random(size=(4, 10)) < 0.4)
    penalty = torch.tensor([1.0, 1.5, 0.5, 3.0])

    penalised = sampling.apply_repetition_penalty(logits, seen, penalty)

    for row in range(4):
        for token in range(10):
            value = logits[row, token]
            if seen[row, token]:
                value = value / penalty[row] if value > 0 else value * penalty[row]
            assert penalised[row, token] == value


def test_frequency_presence_penalties_follow_openai(rng: np.random.Generator) -> None:
    logits = torch.tensor(rng.normal(size=(3, 7)), dtype=torch.float32)
    counts = torch.tensor(rng.integers(0, 4, size=(3, 7)), dtype=torch.int32)
    frequency = torch.tensor([0.0, 0.5, -1.0])
    presence = torch.tensor([2.0, 0.0, 1.5])

    penalised = sampling.apply_frequency_presence_penalties(logits, counts, frequency, presence)

    expected = (
        logits.numpy() - frequency.numpy()[:, None] * counts.numpy() - presence.numpy()[:, None] * (counts.numpy() > 0)
    )
    np.testing.assert_allclose(penalised.numpy(), expected, rtol=1e-6, atol=1e-6)


def test_temperature_softmax_matches_numpy_and_survives_tiny_temperatures(rng: np.random.Generator) -> None:
    logits = torch.tensor(rng.normal(scale=5, size=(3, 8)), dtype=torch.float32)
    temperature = torch.tensor([1.0, 0.3, 1e-30])

    probs = sampling.temperature_softmax(logits, temperature)

    for row in range(2):
        scaled = logits[row].numpy().astype(np.float64) / float(temperature[row])
        expected = np.exp(scaled - scaled.max())
        np.testing.assert_allclose(probs[row].numpy(), expected / expected.sum(), rtol=1e-5)
    assert probs[2].tolist() == torch.nn.functional.one_hot(logits[2].argmax(), 8).float().tolist()


def test_top_k_keeps_the_k_most_likely_and_every_tie_with_the_kth(rng: np.random.Generator) -> None:
    probs = _tied_weights(rng, rows=64, vocab=12)
    top_k = torch.tensor(rng.integers(-1, 15, size=64), dtype=torch.int64)

    masked = sampling.top_k_mask(probs, top_k)

    for row in range(64):
        weights, k = probs[row].tolist(), int(top_k[row])
        if k <= 0 or k >= 12:
            expected = set(range(12))
        else:
            kth = sorted(weights, reverse=True)[k - 1]
            expected = {token for token, weight in enumerate(weights) if weight >= kth}
        assert _kept(masked[row]) == {token for token in expected if weights[token] > 0}
        assert torch.equal(masked[row][sorted(expected)], probs[row][sorted(expected)])


def _top_p_reference(weights: list[float], top_p: float) -> set[int]:
    if top_p >= 1:
        return set(range(len(weights)))
    total, mass, threshold = sum(weights), 0.0, None
    for weight in sorted(weights, reverse=True):
        threshold = weight
        mass += weight
        if mass >= top_p * total:
            break
    return {token for token, weight in enumerate(weights) if weight >= threshold}


def test_top_p_matches_a_loop_reference_on_tied_weights(rng: np.random.Generator) -> None:
    probs = _tied_weights(rng, rows=64, vocab=10)
    probs[:, 0] += 1  # no all-zero rows
    # Dyadic top_p values keep p * total exact, so the boundary is the same in float32 and in Python.
    top_p = torch.tensor(rng.choice([0.0625, 0.25, 0.5, 0.75, 0.875, 1.0], size=64), dtype=torch.float32)

    masked = sampling.top_p_mask(probs, top_p)

    for row in range(64):
        expected = _top_p_reference(probs[row].tolist(), float(top_p[row]))
        nonzero_expected = {token for token in expected if probs[row, token] > 0}
        assert _kept(masked[row]) == nonzero_expected
        assert torch.equal(masked[row][sorted(expected)], probs[row][sorted(expected)])


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.5, {0}),  # the top token alone reaches exactly 0.5
        (0.75, {0, 1}),  # 0.5 + 0.25 reaches exactly 0.75: the next token is not needed
        (0.7500001, {1, 0, 2, 3}),  # needs the third, and the fourth ties with it
        (1e-6, {0}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_stops_once_the_mass_is_exactly_reached(top_p: float, kept: set[int]) -> None:
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]])

    masked = sampling.top_p_mask(probs, torch.tensor([top_p]))

    assert _kept(masked[0]) == kept


def test_top_p_is_relative_to_the_row_total() -> None:
    weights = torch.tensor([[4.0, 2.0, 1.0, 1.0], [0.0, 2.0, 4.0, 2.0]])

    masked = sampling.top_p_mask(weights, torch.tensor([0.75, 0.5]))

    assert _kept(masked[0]) == {0, 1}
    assert _kept(masked[1]) == {2}


def test_min_p_drops_tokens_below_a_fraction_of_the_most_likely(rng: np.random.Generator) -> None:
    probs = torch.tensor(rng.random(size=(16, 9)), dtype=torch.float32)
    min_p = torch.tensor(rng.choice([0.0, 0.1, 0.5, 0.9, 1.0], size=16), dtype=torch.float32)

    masked = sampling.min_p_mask(probs, min_p)

    for row in range(16):
        threshold = float(min_p[row]) * float(probs[row].max())
        expected = {token for token in range(9) if float(probs[row, token]) >= threshold}
        assert _kept(masked[row]) == expected


def _random_mask_call(rng: np.random.Generator, mask: str, probs: torch.Tensor) -> torch.Tensor:
    rows = probs.shape[0]
    if mask == "top_k":
        return sampling.top_k_mask(probs, torch.tensor(rng.integers(-1, 60, size=rows), dtype=torch.int64))
    choices = {"top_p": [1e-9, 1e-3, 0.5, 1.0], "min_p": [0.0, 0.5, 1.0]}[mask]
    per_row = torch.tensor(rng.choice(choices, size=rows), dtype=torch.float32)
    return sampling.top_p_mask(probs, per_row) if mask == "top_p" else sampling.min_p_mask(probs, per_row)


@pytest.mark.parametrize("mask", ["top_k", "top_p", "min_p"])
def test_masks_never_remove_the_most_likely_token(rng: np.random.Generator, mask: str) -> None:
    logits = torch.tensor(rng.normal(scale=rng.choice([0.01, 1, 30]), size=(256, 50)), dtype=torch.float32)
    temperature = torch.tensor(rng.choice([0.05, 1.0, 5.0], size=256), dtype=torch.float32)
    probs = sampling.temperature_softmax(logits, temperature)

    masked = _random_mask_call(rng, mask, probs)

    best = probs.argmax(dim=-1, keepdim=True)
    assert torch.equal(masked.gather(1, best), probs.gather(1, best))
    assert bool((masked.amax(dim=-1) > 0).all())


def test_exponential_race_is_argmax_of_probs_over_noise(rng: np.random.Generator) -> None:
    probs = torch.tensor(rng.random(size=(8, 20)), dtype=torch.float32)
    noise = torch.empty(8, 20).exponential_(generator=torch.Generator().manual_seed(0))

    tokens = sampling.exponential_race(probs, noise)

    assert tokens.tolist() == [int(np.argmax(probs[row].numpy() / noise[row].numpy())) for row in range(8)]


def test_exponential_race_never_picks_a_dropped_token_on_zero_noise() -> None:
    probs = torch.tensor([[0.0, 0.0, 0.3, 0.0]])

    tokens = sampling.exponential_race(probs, torch.zeros(1, 4))

    assert tokens.tolist() == [2]


def _ids(size: int) -> torch.Tensor:
    return torch.zeros(size, dtype=torch.int64)


ROWS = torch.ones(2, 5)
BAD_CALLS = [
    (lambda: sampling.top_k_mask(ROWS, torch.ones(3, dtype=torch.int64)), "top_k shape must be (2,), got (3,)"),
    (lambda: sampling.top_k_mask(ROWS, torch.ones(2, dtype=torch.int32)), "top_k dtype must be torch.int64"),
    (lambda: sampling.top_p_mask(ROWS, torch.ones(2, dtype=torch.float64)), "top_p dtype must be torch.float32"),
    (lambda: sampling.min_p_mask(torch.ones(5), torch.ones(5)), "probs must be [batch, vocab]"),
    (lambda: sampling.min_p_mask(torch.ones(2, 0), torch.ones(2)), "probs must be [batch, vocab] with vocab > 0"),
    (lambda: sampling.temperature_softmax(ROWS.long(), torch.ones(2)), "logits must be a floating-point"),
    (lambda: sampling.exponential_race(ROWS, torch.ones(2, 4)), "noise shape must be (2, 5), got (2, 4)"),
    (lambda: sampling.apply_repetition_penalty(ROWS, ROWS, torch.ones(2)), "seen dtype must be torch.bool"),
    (
        lambda: sampling.apply_frequency_presence_penalties(ROWS, ROWS.int(), torch.ones(2), torch.ones(1)),
        "presence shape must be (2,), got (1,)",
    ),
    (
        lambda: sampling.token_counts(_ids(3), _ids(2), num_rows=1, vocab_size=4),
        "token_ids shape must be (3,), got (2,)",
    ),
    (
        lambda: sampling.add_logit_bias(ROWS, _ids(1), _ids(1), torch.ones(1).double()),
        "bias dtype must be torch.float32",
    ),
]


@pytest.mark.parametrize(("call", "message"), BAD_CALLS)
def test_ops_reject_mismatched_inputs_naming_them(call, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


@pytest.mark.parametrize("vocab", [7, 96, 4096, 49152])
def test_argmax_rows_is_torch_argmax_ties_included(vocab):
    generator = torch.Generator().manual_seed(vocab)
    x = torch.randn(5, vocab, generator=generator)
    x[1] = 0.0  # every entry tied: the first wins
    x[2, vocab // 2] = x[2, vocab - 1] = 50.0  # two maxima in different chunks
    x[3, -1] = torch.inf
    assert torch.equal(sampling.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(sampling.argmax_rows(x[:, : vocab - 1]), x[:, : vocab - 1].argmax(dim=-1))
