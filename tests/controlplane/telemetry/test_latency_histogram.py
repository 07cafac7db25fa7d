"""Fixed-bucket latency histograms: percentiles within a bucket's half-width of the exact ones, and
merging two histograms equals the histogram of both sets of latencies."""

import random

import pytest

from controlplane.telemetry.latency_histogram import FLOOR_S, GROWTH, bucket, histogram, merge, percentile
from controlplane.telemetry.windows import percentile as exact_percentile


def test_percentiles_are_within_half_a_bucket_of_the_exact_ones():
    # given latencies spread over five orders of magnitude
    generator = random.Random(0)
    latencies = [10 ** generator.uniform(-3.5, 1.5) for _ in range(5000)]
    ordered = sorted(latencies)

    # when
    counts = histogram(latencies)

    # then
    for fraction in (0.01, 0.5, 0.9, 0.99, 1.0):
        assert percentile(counts, fraction) == pytest.approx(exact_percentile(ordered, fraction), rel=GROWTH**0.5 - 1)


def test_merging_equals_the_histogram_of_both():
    first, second = [0.01, 0.2, 0.2, 3.0], [0.05, 0.2, 40.0]

    assert merge([histogram(first), histogram(second)]) == histogram(first + second)


def test_latencies_outside_the_range_count_in_the_end_buckets_and_an_empty_histogram_has_no_percentile():
    counts = histogram([0.0, FLOOR_S / 10, 1e6])

    assert counts == {"0": 2, str(bucket(1e6)): 1}
    assert bucket(1e6) == bucket(1e3 * 0.999)
    assert percentile({}, 0.5) is None
