"""Latency histograms with fixed buckets: what a one-minute rollup keeps of its latencies, so that the
rollups several gateways write for one minute can be merged (percentiles of percentiles cannot).

Bucket i holds latencies in [FLOOR_S * GROWTH**i, FLOOR_S * GROWTH**(i + 1)), from 0.1 ms up to
1000 s (faster ones count in the first bucket, slower ones in the last). A percentile read back is
its bucket's geometric middle, within GROWTH**0.5 - 1 (4.9%) of a latency in that bucket. A histogram
is a dict of bucket index (as a string, so that it is a JSON object as it is) to count, holding only
buckets with a count: a minute of similar requests fills a handful of them.

The buckets are part of the stored data: changing FLOOR_S or GROWTH needs a migration of the rows.
"""

import math
from collections.abc import Iterable

FLOOR_S = 1e-4
GROWTH = 1.1
NUM_BUCKETS = math.ceil(math.log(1e3 / FLOOR_S, GROWTH))

Histogram = dict[str, int]


def bucket(seconds: float) -> int:
    if seconds <= FLOOR_S:
        return 0
    return min(int(math.log(seconds / FLOOR_S, GROWTH)), NUM_BUCKETS - 1)


def histogram(latencies: Iterable[float]) -> Histogram:
    counts: Histogram = {}
    add(counts, latencies)
    return counts


def add(counts: Histogram, latencies: Iterable[float]) -> None:
    for seconds in latencies:
        name = str(bucket(seconds))
        counts[name] = counts.get(name, 0) + 1


def merge(histograms: Iterable[Histogram]) -> Histogram:
    merged: Histogram = {}
    for counts in histograms:
        for name, count in counts.items():
            merged[name] = merged.get(name, 0) + count
    return merged


def percentile(counts: Histogram, fraction: float) -> float | None:
    """Nearest rank, as windows.percentile: the bucket of the smallest latency with at least
    `fraction` of them at or below it, read as the bucket's geometric middle. None when empty."""
    total = sum(counts.values())
    if not total:
        return None
    rank = max(math.ceil(fraction * total), 1)
    seen = 0
    for index in sorted(int(name) for name in counts):
        seen += counts[str(index)]
        if seen >= rank:
            break
    return FLOOR_S * GROWTH ** (index + 0.5)
