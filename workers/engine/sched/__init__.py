"""Scheduling: which requests run in a step and how many tokens each computes (scheduler), the one
message from the scheduler to the model runner, and the per-step time budget (step_budget)."""
