"""The autoscaler's pure logic: demand signals and the per-pool planner (applied by the control plane)."""

from workers.autoscale.demand import (
    WorkerLoad,
    decode_demands,
    encode_demands,
    prefill_demands,
    prefill_tokens_per_s,
)
from workers.autoscale.planner import Decision, Demand, PlannerConfig, PoolInputs, Rule, plan

__all__ = [
    "Decision",
    "Demand",
    "PlannerConfig",
    "PoolInputs",
    "Rule",
    "WorkerLoad",
    "decode_demands",
    "encode_demands",
    "plan",
    "prefill_demands",
    "prefill_tokens_per_s",
]
