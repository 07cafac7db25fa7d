"""The planner on an encode pool: image patches per second asked of it against one encoder's measured
capacity, under the bounds, hysteresis, rate limits and cool-down every pool has."""

from workers.autoscale import Demand, PlannerConfig, PoolInputs, Rule, encode_demands, plan

CONFIG = PlannerConfig()
CAPACITY = 2000.0  # patches/s one encoder measured


def encode_pool(target: int, demands: dict[str, Demand], **fields) -> PoolInputs:
    return PoolInputs(
        **{
            "kind": "encode",
            "min_instances": 1,
            "max_instances": 8,
            "target_instances": target,
            "live_instances": target,
            "scale_up_max_per_window": 4,
            "scale_down_max_per_window": 2,
            "added_in_window": 0,
            "removed_in_window": 0,
            "demands": demands,
            **fields,
        }
    )


def test_patches_asked_beyond_the_encoders_capacity_at_the_target_utilization_scale_the_pool_up():
    # given 2 encoders asked 3,600 patches/s over the look-back: 0.9 of what they encode together
    demands = encode_demands(patches_per_s=[3000.0, 3600.0, 4200.0], patches_per_s_per_encoder=CAPACITY)

    decision = plan(encode_pool(2, demands), CONFIG)

    # then the pool grows to ceil(3600 / (2000 * 0.6)) = 3, and the event's why says from what
    assert (decision.rule, decision.target_instances) == (Rule.SCALE_UP, 3)
    assert decision.why()["inputs"]["demands"]["patches_per_s"] == {
        "mean": 3600.0,
        "peak": 4200.0,
        "per_worker": 2000.0,
    }
    assert decision.why()["inputs"]["utilization"] == 0.9


def test_an_idle_encode_pool_shrinks_toward_its_minimum():
    demands = encode_demands(patches_per_s=[0.0, 0.0, 0.0], patches_per_s_per_encoder=CAPACITY)

    decision = plan(encode_pool(4, demands), CONFIG)

    assert (decision.rule, decision.target_instances) == (Rule.SCALE_DOWN, 2)  # 2 per window
    # and a cool-down after that change it goes no further yet
    held = plan(encode_pool(2, demands, seconds_since_last_change=60.0), CONFIG)
    assert (held.rule, held.target_instances) == (Rule.COOLDOWN, 2)


def test_without_a_measured_capacity_the_pool_is_held_as_it_is():
    # given heavy demand, but no encoder has measured what it encodes per second yet
    demands = encode_demands(patches_per_s=[50_000.0], patches_per_s_per_encoder=0.0)

    decision = plan(encode_pool(2, demands), CONFIG)

    assert demands == {}
    assert (decision.rule, decision.target_instances) == (Rule.NO_SIGNAL, 2)
    # no minute of the look-back heard: the same
    assert encode_demands(patches_per_s=[], patches_per_s_per_encoder=CAPACITY) == {}


def test_load_between_the_thresholds_keeps_the_pool_and_a_burst_guards_a_scale_down():
    # 3 encoders at 0.5: within the band
    within = plan(encode_pool(3, encode_demands(patches_per_s=[3000.0], patches_per_s_per_encoder=CAPACITY)))
    assert within.rule == Rule.WITHIN_BAND
    # 6 encoders at a mean of 0.1 would shrink to 4, but a peak of 7,000 patches/s would run those at 0.875
    burst = encode_demands(patches_per_s=[0.0, 0.0, 0.0, 0.0, 7000.0], patches_per_s_per_encoder=CAPACITY)
    guarded = plan(encode_pool(6, burst))
    assert (guarded.rule, guarded.target_instances) == (Rule.QUOTA_GUARD, 6)
