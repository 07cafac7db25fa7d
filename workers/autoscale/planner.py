"""The autoscaler's planner: one pool's demand and limits in, its desired instance count out, with the
rule that decided it and the figures it used. Pure: no clock, no I/O, no Django.

Demand against capacity:
- prefill: uncached prompt tokens per second against what one worker computes per second (from the
  fitted cost model: a full step's chunk over the step's predicted time);
- decode: requests in flight against `max_num_seqs` per worker, and KV tokens in use against each
  worker's KV capacity, whichever needs more workers;
- mixed: both;
- encode (vision encoders): image patches per second asked of the pool (those its encoders finished
  plus the growth of those they hold) against the patches per second one encoder measured; a pool
  none of whose encoders measured it yet has no signal and is left as it is.

Utilization is demand over the capacity of the pool's desired instances. Above `scale_up_above` the
pool grows to the count that brings it to `target_utilization`; below `scale_down_below` it shrinks
toward that count (the gap between the two thresholds is the hysteresis), at most `rate limit` instances
per window either way, never outside min..max, not within `scale_down_cooldown_s` of its last change,
and never when the *quota use* after the scale-down would pass `max_quota_use`: quota use is the peak
demand over the look-back divided by the capacity of the instances that would be left.
"""

import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum


class Rule(StrEnum):
    PAUSED = "paused"
    MANUAL_HOLD = "manual_hold"
    NO_SIGNAL = "no_signal"
    BELOW_MIN = "below_min"
    ABOVE_MAX = "above_max"
    SCALE_UP = "scale_up"
    SCALE_DOWN = "scale_down"
    WITHIN_BAND = "within_band"
    RATE_LIMITED = "rate_limited"
    QUOTA_GUARD = "quota_guard"
    COOLDOWN = "cooldown"


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    target_utilization: float = 0.6
    scale_up_above: float = 0.75
    scale_down_below: float = 0.4
    max_quota_use: float = 0.8
    scale_down_cooldown_s: float = 300.0
    manual_hold_s: float = 600.0
    # max_num_seqs of workers that have not reported theirs yet (EngineArgs' default).
    default_max_num_seqs: int = 64

    def __post_init__(self) -> None:
        if not 0 < self.scale_down_below < self.target_utilization < self.scale_up_above:
            raise ValueError("need 0 < scale_down_below < target_utilization < scale_up_above")
        if not 0 < self.max_quota_use <= 1:
            raise ValueError(f"max_quota_use must be in (0, 1], got {self.max_quota_use}")
        if self.scale_down_cooldown_s < 0 or self.manual_hold_s < 0:
            raise ValueError("cool-down and manual hold must be >= 0 s")


@dataclass(frozen=True, slots=True)
class Demand:
    """What a pool is asked for, in its own unit (prefill: uncached tokens/s; decode: requests in
    flight and KV tokens; encode: patches/s), and what one worker holds of it. `peak` is the highest of
    the look-back."""

    mean: float
    peak: float
    per_worker: float

    def __post_init__(self) -> None:
        if self.mean < 0 or self.peak < 0 or self.per_worker <= 0:
            raise ValueError(f"demand must be >= 0 and capacity > 0, got {self}")


@dataclass(frozen=True, slots=True)
class PoolInputs:
    kind: str
    min_instances: int
    max_instances: int
    target_instances: int  # the pool's desired count now
    live_instances: int  # starting, ready or draining: reported, not planned on
    scale_up_max_per_window: int
    scale_down_max_per_window: int
    added_in_window: int  # instances added (removed) by scaling in the current window
    removed_in_window: int
    paused: bool = False
    seconds_since_manual_scale: float | None = None
    seconds_since_last_change: float | None = None
    # One entry per signal ("uncached_tokens_per_s", "requests_in_flight", "kv_tokens", "patches_per_s");
    # empty: none.
    demands: dict[str, Demand] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Decision:
    target_instances: int
    rule: Rule
    wanted: int  # what the demand asks for, before bounds, rate limits and guards
    inputs: dict

    @property
    def changes(self) -> bool:
        return self.target_instances != self.inputs["target_instances"]

    def why(self) -> dict:
        """The ScalingEvent's `why`: the rule that fired and every figure it used."""
        return {"rule": str(self.rule), "wanted": self.wanted, "inputs": self.inputs}


def plan(pool: PoolInputs, config: PlannerConfig = PlannerConfig()) -> Decision:
    inputs = _inputs(pool)
    current = pool.target_instances

    def decide(target: int, rule: Rule, wanted: int = current) -> Decision:
        return Decision(target_instances=target, rule=rule, wanted=wanted, inputs=inputs)

    if pool.paused:
        return decide(current, Rule.PAUSED)
    if pool.seconds_since_manual_scale is not None and pool.seconds_since_manual_scale < config.manual_hold_s:
        return decide(current, Rule.MANUAL_HOLD)
    # Bounds first: an operator who moved them expects the pool to follow whatever its load.
    if current < pool.min_instances:
        return _limited(pool, pool.min_instances, Rule.BELOW_MIN, decide)
    if current > pool.max_instances:
        return _limited(pool, pool.max_instances, Rule.ABOVE_MAX, decide)
    if not pool.demands:
        return decide(current, Rule.NO_SIGNAL)
    utilization = max(_utilization(demand, current) for demand in pool.demands.values())
    inputs["utilization"] = None if math.isinf(utilization) else round(utilization, 4)
    wanted = max(math.ceil(d.mean / (d.per_worker * config.target_utilization) - 1e-9) for d in pool.demands.values())
    wanted = min(max(wanted, pool.min_instances), pool.max_instances)
    if utilization > config.scale_up_above and wanted > current:
        return _limited(pool, wanted, Rule.SCALE_UP, decide)
    if utilization < config.scale_down_below and wanted < current:
        since_change = pool.seconds_since_last_change
        if since_change is not None and since_change < config.scale_down_cooldown_s:
            return decide(current, Rule.COOLDOWN, wanted)
        limited = _limited(pool, wanted, Rule.SCALE_DOWN, decide)
        quota_use = _quota_use(pool.demands, limited.target_instances)
        inputs["quota_use_after"] = None if math.isinf(quota_use) else round(quota_use, 4)
        if quota_use > config.max_quota_use:
            return decide(current, Rule.QUOTA_GUARD, wanted)
        return limited
    return decide(current, Rule.WITHIN_BAND, wanted)


def _limited(pool: PoolInputs, wanted: int, rule: Rule, decide) -> Decision:
    """Toward `wanted` as far as the window's rate limit lets the pool move."""
    current = pool.target_instances
    if wanted > current:
        room = max(pool.scale_up_max_per_window - pool.added_in_window, 0)
        target = min(wanted, current + room)
    else:
        room = max(pool.scale_down_max_per_window - pool.removed_in_window, 0)
        target = max(wanted, current - room)
    if target == current:
        return decide(current, Rule.RATE_LIMITED, wanted)
    return decide(target, rule, wanted)


def _utilization(demand: Demand, instances: int) -> float:
    if instances <= 0:
        return math.inf if demand.mean > 0 else 0.0
    return demand.mean / (demand.per_worker * instances)


def _quota_use(demands: dict[str, Demand], instances: int) -> float:
    if instances <= 0:
        return math.inf if any(d.peak > 0 for d in demands.values()) else 0.0
    return max(d.peak / (d.per_worker * instances) for d in demands.values())


def _inputs(pool: PoolInputs) -> dict:
    return asdict(pool)  # nested Demands included
