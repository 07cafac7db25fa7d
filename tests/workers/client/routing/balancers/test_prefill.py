import pytest

from workers.client.routing.balancers.prefill import PrefillBalancer, allocate_workers
from workers.cost_model import PrefillCostModel

# Linear in new tokens only: a request's predicted cost is exactly proportional to its uncached tokens.
LINEAR = PrefillCostModel(a=0.0, b=0.001, d=0.0, e=0.0)


def balancer(workers=4, tiers=(1024, 4096), **options):
    return PrefillBalancer(
        [f"p{i}" for i in range(workers)], LINEAR, tiers=tiers, step_budget_s=1.0, chunk_limit=2048, **options
    )


def test_tier_of_uses_input_length_boundaries():
    lb = balancer()
    assert [lb.tier_of(n) for n in (1, 1023, 1024, 4095, 4096, 8000)] == [0, 0, 1, 1, 2, 2]


def test_starts_with_workers_spread_over_tiers():
    assert balancer(workers=6).tier_sizes() == [2, 2, 2]


def test_choose_stays_in_tier_and_picks_most_remaining_quota():
    lb = balancer(workers=6, spill_s=float("inf"))
    short = [w.worker_id for w in lb.workers.values() if w.tier == 0]
    first = lb.choose(500, 0)
    second = lb.choose(100, 0)
    assert {first, second} == set(short)  # the second goes to the untouched worker of the tier
    third = lb.choose(100, 0)
    assert third == second  # 0.1 s queued beats 0.5 s queued
    assert lb.workers[first].queued_s == pytest.approx(0.5)
    assert lb.workers[second].queued_s == pytest.approx(0.2)


def test_hit_tokens_lower_the_predicted_work():
    lb = balancer()
    worker = lb.choose(1000, 900)
    assert lb.workers[worker].queued_s == pytest.approx(0.1)


def test_progress_and_done_return_quota():
    lb = balancer()
    worker = lb.choose(1000, 0)
    lb.on_progress(worker, 0.4)
    assert lb.workers[worker].queued_s == pytest.approx(0.6)
    lb.on_done(worker, 0.6)
    assert lb.workers[worker].queued_s == 0.0
    lb.on_done(worker, 5.0)
    assert lb.workers[worker].queued_s == 0.0  # never negative


def test_spills_to_the_pool_when_the_tier_is_far_behind():
    lb = balancer(workers=3, spill_s=1.0)
    long_worker = next(w for w in lb.workers.values() if w.tier == 2)
    long_worker.queued_s = 5.0
    chosen = lb.choose(5000, 0)
    assert lb.workers[chosen].tier != 2


def test_rebalance_waits_for_the_window_then_sizes_tiers_by_demand():
    lb = balancer(workers=8, window_s=10.0, spill_s=float("inf"))
    for _ in range(30):
        lb.choose(2000, 0)  # medium: 2 s each, 60 s in all
    lb.choose(100, 0)  # short: 0.1 s
    assert not lb.rebalance(5.0)
    assert lb.rebalance(10.0)
    assert lb.tier_sizes() == [1, 7, 0]
    assert not lb.rebalance(15.0)  # a new window has begun
    # No demand for the long tier: its requests borrow from the whole pool.
    assert lb.choose(6000, 0) in lb.workers


def test_rebalance_moves_the_least_loaded_workers():
    lb = balancer(workers=4, tiers=(1024,), window_s=1.0, spill_s=float("inf"))
    busy = lb.choose(100, 0)
    lb.workers[busy].queued_s = 3.0
    lb.choose(2000, 0)
    lb.demand_s = [1.0, 3.0]
    lb.rebalance(1.0)
    assert lb.tier_sizes() == [1, 3]
    assert lb.workers[busy].tier == 0


def test_allocate_workers_is_proportional_with_one_per_demanding_tier():
    assert allocate_workers([1.0, 1.0, 2.0], 8) == [2, 2, 4]
    assert allocate_workers([0.01, 10.0, 0.0], 5) == [1, 4, 0]
    assert allocate_workers([1.0, 5.0, 3.0], 2) == [0, 1, 1]
    assert sum(allocate_workers([0.3, 0.2, 0.5], 7)) == 7


def test_rejects_bad_configuration():
    with pytest.raises(ValueError, match="ascending"):
        balancer(tiers=(4096, 1024))
    with pytest.raises(ValueError, match="at least one worker"):
        PrefillBalancer([], LINEAR, step_budget_s=1.0, chunk_limit=16)
