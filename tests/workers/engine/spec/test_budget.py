"""The verification budget: the total maximises expected tokens per second (checked against a search
over every total), the per-request split takes the largest expected gains (checked against a sort in
Python) as a prefix of each row, the valve turns speculation off when it does not pay, and bad input
is refused by name."""

import itertools

import numpy as np
import pytest
import torch

from workers.cost_model import DecodeCostModel, PrefillCostModel
from workers.engine.spec.budget import (
    DSparkBudget,
    FixedBudget,
    VerifyStepCurve,
    allocate_greedy,
    best_total,
    make_spec_budget,
)
from workers.engine.spec.confidence import NO_DRAFT, expected_accepted_prefix


def random_prefix(rows: int, k: int, generator: torch.Generator, *, levels: int = 0, missing: bool = True):
    """An expected-prefix matrix; with `levels`, probabilities are rounded to that many values so
    ties are frequent; with `missing`, some rows have fewer drafts."""
    probability = torch.rand(rows, k, generator=generator)
    if levels:
        probability = (probability * levels).round() / levels
    if missing:
        drafts = torch.randint(0, k + 1, (rows, 1), generator=generator)
        probability = torch.where(torch.arange(k) < drafts, probability, NO_DRAFT)
    return expected_accepted_prefix(probability)


def reference_allocation(prefix: torch.Tensor, total: int, min_confidence: float) -> list[int]:
    rows, k = prefix.shape
    entries = [
        (-float(prefix[r, j]), r, j)
        for r, j in itertools.product(range(rows), range(k))
        if float(prefix[r, j]) >= max(min_confidence, 0.0)
    ]
    counts = [0] * rows
    for _, r, _ in sorted(entries)[:total]:
        counts[r] += 1
    return counts


def reference_total(prefix: np.ndarray, step_seconds, min_confidence: float, margin: float) -> int:
    rows = prefix.shape[0]
    gains = sorted((g for g in prefix.flatten().tolist() if g >= max(min_confidence, 0.0)), reverse=True)
    rates = [(rows + sum(gains[:t])) / float(step_seconds(np.array([rows + t]))[0]) for t in range(prefix.size + 1)]
    best = max(range(len(rates)), key=lambda t: (rates[t], -t))
    return best if rates[best] > rates[0] * (1 + margin) else 0


def random_curve(generator: np.random.Generator):
    """A linear, a convex or a bucketed (CUDA-graph-like) step-time curve."""
    a, b = generator.uniform(0.002, 0.03), generator.uniform(1e-5, 4e-4)
    kind = generator.integers(3)
    if kind == 0:
        return lambda tokens: a + b * tokens
    if kind == 1:
        return lambda tokens: a + b * tokens + b * 0.01 * tokens**2
    return lambda tokens: a + b * 16 * np.ceil(tokens / 16)


def test_allocation_takes_the_largest_expected_gains_like_a_sort_does():
    generator = torch.Generator().manual_seed(0)
    for case in range(300):
        rows, k = (
            int(torch.randint(1, 9, (1,), generator=generator)),
            int(torch.randint(1, 7, (1,), generator=generator)),
        )
        prefix = random_prefix(rows, k, generator, levels=(0, 2, 4)[case % 3])
        total = int(torch.randint(0, rows * k + 3, (1,), generator=generator))
        min_confidence = (0.0, 0.3)[case % 2]

        counts = allocate_greedy(prefix, total, min_confidence=min_confidence)

        assert counts.dtype == torch.int64
        assert counts.tolist() == reference_allocation(prefix, total, min_confidence), (prefix, total)


def test_allocation_is_a_prefix_of_each_row_with_ties_broken_by_row_then_position():
    # Every entry ties: three are taken, in row order, each row from its first draft.
    prefix = torch.full((2, 3), 0.5)

    assert allocate_greedy(prefix, 3).tolist() == [3, 0]
    assert allocate_greedy(prefix, 4).tolist() == [3, 1]
    # Row 0 ends in a tie with row 1's best: the lower row wins it, and row 1 keeps its prefix.
    prefix = torch.tensor([[0.9, 0.6, 0.6], [0.6, 0.6, 0.1]])
    assert allocate_greedy(prefix, 3).tolist() == [3, 0]
    assert allocate_greedy(prefix, 4).tolist() == [3, 1]


def test_missing_drafts_are_never_allocated():
    prefix = torch.tensor([[0.9, NO_DRAFT, NO_DRAFT], [0.2, 0.1, 0.05]])

    assert allocate_greedy(prefix, 6).tolist() == [1, 3]
    assert FixedBudget(3).allocate(prefix, 6).tolist() == [1, 3]


def test_entries_below_the_minimum_confidence_are_never_allocated():
    prefix = torch.tensor([[0.9, 0.5, 0.2], [0.4, 0.3, 0.29]])

    assert allocate_greedy(prefix, 6, min_confidence=0.3).tolist() == [2, 2]


def test_the_total_may_be_a_device_tensor():
    prefix = random_prefix(6, 4, torch.Generator().manual_seed(1))

    assert torch.equal(allocate_greedy(prefix, torch.tensor(7)), allocate_greedy(prefix, 7))


def test_the_total_maximises_expected_tokens_per_second_like_a_search_over_every_total():
    generator = np.random.default_rng(2)
    torch_generator = torch.Generator().manual_seed(2)
    chosen = set()
    for case in range(200):
        rows, k = int(generator.integers(1, 12)), int(generator.integers(1, 7))
        prefix = random_prefix(rows, k, torch_generator, levels=(0, 3)[case % 2]).double().numpy()
        curve = random_curve(generator)
        min_confidence, margin = (0.0, 0.25)[case % 2], (0.0, 0.02)[case % 3 == 0]

        total = best_total(prefix, batch=rows, step_seconds=curve, min_confidence=min_confidence, margin=margin)

        assert total == reference_total(prefix, curve, min_confidence, margin)
        chosen.add(total == 0 or total == rows * k)
    assert chosen == {True, False}  # the cases include interior optima, not only all or nothing


def test_a_profile_stands_for_a_batch_of_rows_like_it():
    profile = np.array([[0.9, 0.7, 0.4, 0.2, 0.1]])
    curve = VerifyStepCurve(batch=40, decode_step_s=0.02, per_draft_token_s=0.0002)

    from_profile = best_total(profile, batch=40, step_seconds=curve)
    from_rows = best_total(np.repeat(profile, 40, axis=0), batch=40, step_seconds=curve)

    assert from_profile == from_rows
    assert 0 < from_profile < 200


def test_a_batch_that_repeats_the_lagged_rows_gets_the_total_of_the_repeated_matrix():
    generator = np.random.default_rng(7)
    torch_generator = torch.Generator().manual_seed(7)
    for _ in range(30):
        lagged = random_prefix(int(generator.integers(1, 6)), 4, torch_generator).double().numpy()
        repeat = int(generator.integers(2, 5))
        batch = lagged.shape[0] * repeat
        curve = VerifyStepCurve(batch=batch, decode_step_s=0.01, per_draft_token_s=float(generator.uniform(1e-5, 2e-3)))

        total = best_total(lagged, batch=batch, step_seconds=curve, margin=0.0)

        assert total == reference_total(np.tile(lagged, (repeat, 1)), curve, 0.0, 0.0)


def test_the_total_shrinks_per_request_as_the_batch_grows():
    # A memory-bound step: a large fixed cost shared by the batch, a small cost per token.
    profile = np.array([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4]])
    model = PrefillCostModel(a=0.0, b=0.0, d=0.0, e=0.0, decode=DecodeCostModel(a=0.015, b=2e-4, e=1e-8))
    per_request = []
    for batch in (1, 16, 64, 128):
        curve = VerifyStepCurve.from_cost_model(model, batch=batch, total_kv=batch * 1000)
        per_request.append(best_total(profile, batch=batch, step_seconds=curve) / batch)

    assert per_request == sorted(per_request, reverse=True)
    assert per_request[0] == 6 and per_request[-1] < 6


def test_the_valve_turns_speculation_off_when_step_time_grows_faster_than_the_gain():
    prefix = np.array([[0.3, 0.1], [0.2, 0.05]])
    # Each draft token costs as much as a whole step: no draft pays for itself.
    costly = VerifyStepCurve(batch=2, decode_step_s=0.01, per_draft_token_s=0.01)

    assert best_total(prefix, batch=2, step_seconds=costly, margin=0.0) == 0


def test_the_valve_margin_requires_a_real_gain():
    prefix = np.array([[0.5]])
    # One draft: 1.5 tokens in 1.45 s against 1 token in 1 s, 3.4% better.
    curve = VerifyStepCurve(batch=1, decode_step_s=1.0, per_draft_token_s=0.45)

    assert best_total(prefix, batch=1, step_seconds=curve, margin=0.0) == 1
    assert best_total(prefix, batch=1, step_seconds=curve, margin=0.05) == 0


def test_the_verify_curve_extends_the_fitted_decode_step():
    model = PrefillCostModel(a=0.01, b=1e-4, d=1e-6, e=1e-7)

    curve = VerifyStepCurve.from_cost_model(model, batch=8, total_kv=8000)

    assert curve(np.array([8]))[0] == pytest.approx(model.predict_decode_step(8, 8000))
    # A draft token costs one more row of the step, without more context to read.
    one_more = model.predict_decode_step(9, 8000) - model.predict_decode_step(8, 8000)
    assert curve(np.array([12]))[0] - curve(np.array([8]))[0] == pytest.approx(4 * one_more)


def test_the_policies_behind_one_face():
    curve = VerifyStepCurve(batch=4, decode_step_s=0.02, per_draft_token_s=0.0001)
    fixed = make_spec_budget("fixed", max_draft_tokens=5)
    dspark = make_spec_budget("dspark", max_draft_tokens=5, min_confidence=0.1)
    prefix = torch.tensor([[0.9, 0.8, 0.05, NO_DRAFT, NO_DRAFT]]).expand(4, 5)

    assert fixed.plan_total(batch=4, step_seconds=None, lagged_prefix=None) == 20  # needs no cost model
    assert fixed.allocate(prefix, 20).tolist() == [3, 3, 3, 3]
    # Nothing lagged yet: DSpark verifies everything, so every position gets outcomes.
    assert dspark.plan_total(batch=4, step_seconds=curve, lagged_prefix=None) == 20
    assert dspark.plan_total(batch=4, step_seconds=curve, lagged_prefix=prefix.numpy()) == 8
    assert dspark.allocate(prefix, 8).tolist() == [2, 2, 2, 2]
    assert isinstance(dspark, DSparkBudget) and isinstance(fixed, FixedBudget)


@pytest.mark.parametrize(
    ("call", "names"),
    [
        (lambda: make_spec_budget("adaptive", max_draft_tokens=5), "spec budget"),
        (lambda: FixedBudget(-1), "max_draft_tokens"),
        (lambda: DSparkBudget(0), "max_draft_tokens"),
        (lambda: DSparkBudget(5, min_confidence=1.5), "min_confidence"),
        (lambda: DSparkBudget(5, margin=-0.1), "margin"),
        (lambda: DSparkBudget(5).plan_total(batch=2, step_seconds=None, lagged_prefix=None), "cost_model"),
        (lambda: VerifyStepCurve(batch=0, decode_step_s=0.01, per_draft_token_s=0.0), "batch"),
        (lambda: VerifyStepCurve(batch=1, decode_step_s=-1.0, per_draft_token_s=0.0), "decode_step_s"),
        (
            lambda: VerifyStepCurve.from_cost_model(PrefillCostModel(0.01, 0, 0, 0), batch=2, total_kv=-1),
            "total_kv",
        ),
        (lambda: allocate_greedy(torch.rand(4), 2), "expected_prefix"),
        (lambda: allocate_greedy(torch.tensor([[0.5, 1.5]]), 2), "expected_prefix"),
        (lambda: allocate_greedy(torch.tensor([[float("nan")]]), 2), "expected_prefix"),
        (lambda: allocate_greedy(torch.rand(2, 2), -1), "total"),
        (lambda: allocate_greedy(torch.rand(2, 2), 1.5), "total"),
        (lambda: allocate_greedy(torch.rand(2, 2), torch.tensor([1, 2])), "total"),
        (lambda: DSparkBudget(2).allocate(torch.rand(2, 3), 2), "max_draft_tokens"),
        (lambda: best_total(np.array([0.5, 0.2]), batch=1, step_seconds=lambda t: t + 1.0), "lagged_prefix"),
        (lambda: best_total(np.array([[0.5, 1.2]]), batch=1, step_seconds=lambda t: t + 1.0), "lagged_prefix"),
        (lambda: best_total(np.array([[0.5]]), batch=-2, step_seconds=lambda t: t + 1.0), "batch"),
        (lambda: best_total(np.array([[0.5]]), batch=1, step_seconds=lambda t: t - 5.0), "step_seconds"),
        (lambda: best_total(np.array([[0.5]]), batch=1, step_seconds=lambda t: 1.0), "step_seconds"),
        (lambda: best_total(np.array([[0.5]]), batch=1, step_seconds=lambda t: t, min_confidence=2), "min_confidence"),
    ],
)
def test_bad_input_is_refused_by_name(call, names):
    with pytest.raises(ValueError, match=names):
        call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_allocation_on_the_device_never_syncs_and_matches_the_cpu():
    prefix = random_prefix(32, 5, torch.Generator().manual_seed(3), levels=4)
    on_device, total = prefix.cuda(), torch.tensor(70, device="cuda")
    torch.cuda.synchronize()

    torch.cuda.set_sync_debug_mode("error")
    try:
        counts = DSparkBudget(5, min_confidence=0.1).allocate(on_device, total)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    assert counts.cpu().tolist() == allocate_greedy(prefix, 70, min_confidence=0.1).tolist()
