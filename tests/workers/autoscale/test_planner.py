"""The autoscaler's planner on its own: synthetic demand against a fake clock, the pool's scaling
history kept by the test the way the control plane keeps it (pool_scaled events in a window)."""

import math
from dataclasses import dataclass, field, replace

import pytest

from workers.autoscale import (
    Demand,
    PlannerConfig,
    PoolInputs,
    Rule,
    WorkerLoad,
    decode_demands,
    plan,
    prefill_demands,
    prefill_tokens_per_s,
)
from workers.cost_model import PrefillCostModel

CONFIG = PlannerConfig()
WINDOW_S = 300.0
TICK_S = 15.0
TOKENS_PER_WORKER = 1000.0  # uncached tokens/s one prefill worker computes
SEQS = 32


@dataclass
class SimulatedPool:
    """A pool as the control plane would hold it: target, bounds, rate limits and the scale history."""

    kind: str
    min_instances: int = 1
    max_instances: int = 10
    target: int = 1
    up_per_window: int = 4
    down_per_window: int = 2
    changes: list[tuple[float, int]] = field(default_factory=list)  # (time, change of target)
    paused: bool = False
    manual_at: float | None = None

    def inputs(self, now: float, demands: dict[str, Demand]) -> PoolInputs:
        recent = [change for at, change in self.changes if at >= now - WINDOW_S]
        return PoolInputs(
            kind=self.kind,
            min_instances=self.min_instances,
            max_instances=self.max_instances,
            target_instances=self.target,
            live_instances=self.target,
            scale_up_max_per_window=self.up_per_window,
            scale_down_max_per_window=self.down_per_window,
            added_in_window=sum(c for c in recent if c > 0),
            removed_in_window=-sum(c for c in recent if c < 0),
            paused=self.paused,
            seconds_since_manual_scale=None if self.manual_at is None else now - self.manual_at,
            seconds_since_last_change=now - self.changes[-1][0] if self.changes else None,
            demands=demands,
        )

    def tick(self, now: float, demands: dict[str, Demand]):
        decision = plan(self.inputs(now, demands), CONFIG)
        if decision.changes:
            self.changes.append((now, decision.target_instances - self.target))
            self.target = decision.target_instances
        return decision


def ramp(t: float) -> float:
    """Uncached tokens/s: up from 0 to 9,000 over 20 minutes, flat for 10, back down over 20, then 0."""
    minutes = t / 60
    if minutes < 20:
        return 9000 * minutes / 20
    if minutes < 30:
        return 9000.0
    if minutes < 50:
        return 9000 * (50 - minutes) / 20
    return 0.0


def prefill(rate: float, peak: float | None = None) -> dict[str, Demand]:
    peak = rate if peak is None else peak
    return {"uncached_tokens_per_s": Demand(mean=rate, peak=peak, per_worker=TOKENS_PER_WORKER)}


def decode(in_flight: int) -> dict[str, Demand]:
    return {"requests_in_flight": Demand(mean=in_flight, peak=in_flight, per_worker=SEQS)}


def run(pool: SimulatedPool, demand_at, minutes: int = 80):
    return [(t, pool.tick(t, demand_at(t))) for t in (i * TICK_S for i in range(int(minutes * 60 / TICK_S)))]


def assert_within_limits(pool: SimulatedPool) -> None:
    for at, _ in pool.changes:
        recent = [c for t, c in pool.changes if at - WINDOW_S < t <= at]
        assert sum(c for c in recent if c > 0) <= pool.up_per_window
        assert -sum(c for c in recent if c < 0) <= pool.down_per_window


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_a_ramp_up_and_down_scales_within_bounds_and_rate_limits(kind):
    # given a pool of 1..10 instances and demand that ramps up to 9x one worker's share and back
    pool = SimulatedPool(kind=kind)
    if kind == "prefill":
        demand_at = lambda t: prefill(ramp(t))  # noqa: E731
    else:
        demand_at = lambda t: decode(round(ramp(t) / TOKENS_PER_WORKER * SEQS))  # noqa: E731

    # when the planner runs every 15 s for 80 minutes
    timeline = run(pool, demand_at)

    # then the pool grew to its max, came back to its min, and never broke a bound or a window's limit
    targets = [decision.target_instances for _, decision in timeline]
    assert max(targets) == pool.max_instances
    assert targets[-1] == pool.min_instances
    assert all(pool.min_instances <= target <= pool.max_instances for target in targets)
    assert_within_limits(pool)
    rules = {decision.rule for _, decision in timeline}
    assert {Rule.SCALE_UP, Rule.SCALE_DOWN, Rule.RATE_LIMITED} <= rules
    # at the top the demand (9,000 tokens/s: 15 workers at 0.6 each, capped at 10) held it at its max
    at_peak = [decision for t, decision in timeline if 25 * 60 <= t < 30 * 60]
    assert all(decision.target_instances == pool.max_instances for decision in at_peak)
    # every scale-down came at least a cool-down after the change before it
    for (before, _), (at, change) in zip(pool.changes, pool.changes[1:]):
        if change < 0:
            assert at - before >= CONFIG.scale_down_cooldown_s


def test_every_decision_carries_its_rule_and_inputs():
    pool = SimulatedPool(kind="prefill", target=2)

    decision = pool.tick(0.0, prefill(3000))

    why = decision.why()
    assert (why["rule"], why["wanted"], decision.target_instances) == ("scale_up", 5, 5)
    assert why["inputs"]["demands"]["uncached_tokens_per_s"] == {"mean": 3000, "peak": 3000, "per_worker": 1000}
    assert why["inputs"]["target_instances"] == 2
    assert why["inputs"]["utilization"] == 1.5


def test_a_scale_down_is_refused_while_the_quota_use_after_it_would_pass_0_8():
    # given 6 instances whose mean demand asks for 2, while the look-back's peak fills 3 workers
    pool = SimulatedPool(kind="prefill", target=6)

    decision = pool.tick(0.0, prefill(1000, peak=3000))

    # then shrinking to 4 (the window allows 2 fewer) would leave a quota use of 3000/4000 = 0.75: allowed
    assert (decision.rule, decision.target_instances) == (Rule.SCALE_DOWN, 4)
    # a cool-down later the mean still asks for 2, but the peak of 3,300 would run the 2 left at 1.65
    later = pool.tick(CONFIG.scale_down_cooldown_s + 1, prefill(1000, peak=3300))
    assert (later.rule, later.target_instances) == (Rule.QUOTA_GUARD, 4)
    assert later.inputs["quota_use_after"] == pytest.approx(3300 / (2 * 1000))


def test_the_quota_guard_also_covers_decode_kv():
    demands = {
        "requests_in_flight": Demand(mean=8, peak=8, per_worker=SEQS),
        "kv_tokens": Demand(mean=1000, peak=7000, per_worker=4096),
    }
    decision = plan(SimulatedPool(kind="decode", target=4).inputs(0.0, demands))

    assert decision.rule == Rule.QUOTA_GUARD and decision.target_instances == 4


def test_a_paused_pool_and_a_manual_scale_are_left_alone():
    paused = SimulatedPool(kind="decode", target=2, paused=True)
    assert paused.tick(0.0, decode(300)).rule == Rule.PAUSED
    assert paused.target == 2

    # an operator scaled it 5 minutes ago: the hold (10 minutes) keeps the planner off it
    manual = SimulatedPool(kind="decode", target=2, manual_at=0.0)
    held = manual.tick(300.0, decode(300))
    assert (held.rule, manual.target) == (Rule.MANUAL_HOLD, 2)
    # once the hold is over, the demand wins again
    resumed = manual.tick(CONFIG.manual_hold_s + 1, decode(300))
    assert (resumed.rule, manual.target) == (Rule.SCALE_UP, 6)


def test_hysteresis_keeps_a_pool_between_the_thresholds_as_it_is():
    pool = SimulatedPool(kind="decode", target=4)
    # 4 workers of 32 at 50%: neither above 0.75 nor below 0.4
    decision = pool.tick(0.0, decode(64))

    assert (decision.rule, decision.target_instances) == (Rule.WITHIN_BAND, 4)


def test_bounds_moved_by_an_operator_are_followed_before_demand():
    below = SimulatedPool(kind="prefill", min_instances=3, target=1)
    assert (below.tick(0.0, prefill(0)).rule, below.target) == (Rule.BELOW_MIN, 3)
    above = SimulatedPool(kind="prefill", max_instances=2, target=5)
    assert (above.tick(0.0, prefill(0)).rule, above.target) == (Rule.ABOVE_MAX, 3)  # 2 per window


def test_no_signal_and_an_empty_pool():
    assert plan(SimulatedPool(kind="mixed").inputs(0.0, {})).rule == Rule.NO_SIGNAL
    # an empty pool with demand starts one even though its utilization is infinite
    empty = SimulatedPool(kind="prefill", min_instances=0, target=0)
    decision = empty.tick(0.0, prefill(100))
    assert decision.target_instances == 1 and decision.inputs["utilization"] is None
    idle = SimulatedPool(kind="prefill", min_instances=0, target=0)
    assert idle.tick(0.0, prefill(0)).rule == Rule.WITHIN_BAND


def test_demand_signals_from_worker_reports_and_the_cost_model():
    workers = [WorkerLoad(10, 2, 0.5, max_num_seqs=16, kv_capacity_tokens=1000), WorkerLoad(4, 0, 0.25)]
    demands = decode_demands(workers, CONFIG)
    assert demands["requests_in_flight"] == Demand(mean=16, peak=16, per_worker=16)
    # only the worker that reported its KV capacity counts toward KV
    assert demands["kv_tokens"] == Demand(mean=500, peak=500, per_worker=1000)
    assert decode_demands([], CONFIG) == {}
    # the look-back's peak raises the peak, never the mean; one below the load now changes nothing
    burst = decode_demands(workers, CONFIG, peak_requests_in_flight=40, peak_kv_tokens=300)
    assert burst["requests_in_flight"] == Demand(mean=16, peak=40, per_worker=16)
    assert burst["kv_tokens"] == Demand(mean=500, peak=500, per_worker=1000)
    # 2 ms a step plus 1 ms a token: a 1 s budget fits 998 tokens, computed in 1.0 s
    model = PrefillCostModel(a=0.002, b=0.001, d=0.0, e=0.0)
    assert prefill_tokens_per_s(model, budget_s=1.0, limit=4096) == pytest.approx(998 / 1.0)
    assert prefill_demands(uncached_tokens_per_s=[], tokens_per_s_per_worker=1.0) == {}


def test_invalid_configuration_and_demand_are_refused():
    with pytest.raises(ValueError):
        replace(CONFIG, scale_down_below=0.7)
    with pytest.raises(ValueError):
        replace(CONFIG, max_quota_use=1.5)
    with pytest.raises(ValueError):
        Demand(mean=1.0, peak=1.0, per_worker=0.0)
    with pytest.raises(ValueError):
        Demand(mean=-1.0, peak=1.0, per_worker=1.0)
    assert math.isfinite(plan(SimulatedPool(kind="decode").inputs(0.0, decode(0))).inputs["utilization"])
