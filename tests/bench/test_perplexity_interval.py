"""bench.perplexity's paired block bootstrap interval of a perplexity ratio."""

import math

import pytest

from bench.perplexity import BOOTSTRAP_BLOCK, ratio_interval


def test_a_constant_loss_difference_gives_its_exact_ratio_at_both_ends():
    baseline = [0.5 + (i % 7) / 10 for i in range(300)]
    assert ratio_interval(baseline, baseline) == [1.0, 1.0]
    low, high = ratio_interval([loss + 0.03 for loss in baseline], baseline)
    assert low == high == round(math.exp(0.03), 4)


def test_a_few_costly_tokens_widen_the_interval_around_the_ratio():
    baseline = [1.0] * (20 * BOOTSTRAP_BLOCK)
    variant = list(baseline)
    for position in (5, 700, 1100):  # three tokens in three blocks carry the whole increase
        variant[position] += 10.0
    ratio = math.exp((sum(variant) - sum(baseline)) / len(baseline))
    low, high = ratio_interval(variant, baseline)
    assert low < ratio < high
    assert low >= 1.0 and high - low > 0.01


def test_losses_of_another_length_than_the_baseline_are_refused():
    with pytest.raises(ValueError, match="3 scored tokens against the baseline's 4"):
        ratio_interval([1.0] * 3, [1.0] * 4)
