import pytest

pytest.importorskip("recipe.api")  # skipped, with the import error, until it exists

from controlplane.gateway.rate_limit import RateLimiter  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_full_bucket_allows_a_burst_then_says_when_to_retry():
    clock = Clock()
    limiter = RateLimiter(clock)

    waits = [limiter.acquire(1, per_minute=3) for _ in range(4)]

    assert waits[:3] == [0.0, 0.0, 0.0]
    assert waits[3] == pytest.approx(20.0)  # one request every 20 s


def test_the_bucket_refills_with_time():
    clock = Clock()
    limiter = RateLimiter(clock)
    for _ in range(3):
        limiter.acquire(1, per_minute=3)

    clock.now += 15
    assert limiter.acquire(1, per_minute=3) == pytest.approx(5.0)
    clock.now += 5
    assert limiter.acquire(1, per_minute=3) == 0.0


def test_tenants_have_their_own_buckets():
    limiter = RateLimiter(Clock())

    assert limiter.acquire(1, per_minute=1) == 0.0
    assert limiter.acquire(1, per_minute=1) > 0
    assert limiter.acquire(2, per_minute=1) == 0.0


def test_a_lowered_limit_applies_at_once():
    limiter = RateLimiter(Clock())
    limiter.acquire(1, per_minute=600)

    assert limiter.acquire(1, per_minute=1) == 0.0
    assert limiter.acquire(1, per_minute=1) > 0
