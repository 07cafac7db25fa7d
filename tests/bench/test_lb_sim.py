import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.lb_sim import CONTEXT, load_requests, pace, plan_step
from bench.skewed_trace import SkewedTraceConfig, write_trace
from workers.cost_model import PrefillCostModel

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL = PrefillCostModel(a=0.05, b=0.002, d=3e-7, e=1e-6)
POLICIES = ["ours", "round_robin", "least_requests"]


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    """A reproducible trace in the Mooncake format (the shared one lives outside the repository)."""
    path = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    write_trace(path, SkewedTraceConfig(requests=600, prefixes=40, seed=3))
    return path


@pytest.fixture(scope="module")
def quick_result(tmp_path_factory, trace):
    path = tmp_path_factory.mktemp("lb") / "cost_model.json"
    MODEL.save(path)
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.lb_sim",
            "--quick",
            "--trace",
            str(trace),
            "--cost-model",
            str(path),
            "--prefill-workers",
            "4",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(completed.stdout)


def test_quick_run_reports_every_policy_for_both_pools(quick_result):
    assert [row["policy"] for row in quick_result["prefill"]] == POLICIES
    assert [row["policy"] for row in quick_result["decode"]] == POLICIES
    for row in quick_result["prefill"]:
        assert 0 <= row["ttft_p50_s"] <= row["ttft_p99_s"]
        assert row["imbalance_max_over_mean"] >= 1.0
        assert 0 < row["utilization"] <= 1.0
    for row in quick_result["decode"]:
        assert 0 < row["itl_p50_s"] <= row["itl_p99_s"]
        assert row["max_kv_fraction"] <= 1.0  # never over a worker's KV capacity
    assert quick_result["scaling"]["token_scale"] == CONTEXT / 131072


def test_trace_scaling_fits_the_context_and_keeps_one_token_to_compute(trace):
    requests, _ = load_requests(trace, 500)
    assert all(1 <= r.input_tokens and r.input_tokens + r.output_tokens <= CONTEXT for r in requests)
    assert all(0 <= r.hit_tokens < r.input_tokens for r in requests)
    assert any(r.hit_tokens for r in requests)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)


def test_pacing_gives_every_window_the_same_load(trace):
    requests, _ = load_requests(trace, 500)
    paced = pace(requests, [1.0] * len(requests), capacity_s_per_s=2.0, window_s=10.0)
    assert [r.arrival_s for r in paced] == sorted(r.arrival_s for r in paced)
    assert paced[-1].arrival_s <= len(requests) / 2.0


def test_plan_step_packs_requests_within_the_budget():
    budget = MODEL.predict(512, 0)
    plan = plan_step(MODEL, [(100, 0), (100, 50), (5000, 0), (40, 0)], budget)
    assert plan[:2] == [100, 50]
    assert len(plan) == 3  # the long prompt takes what is left; the last one waits
    cost = MODEL.a + sum(MODEL.predict(q, c) - MODEL.a for q, c in zip(plan, [0, 50, 0]))
    assert cost <= budget
    assert plan_step(MODEL, [(9000, 8000)], 0.0) == [1]  # over budget alone: still progress
