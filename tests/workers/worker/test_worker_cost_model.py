"""A worker given a fitted cost model plans its steps with it and reports, in its heartbeats, how far
its predictions are off; a bad model file or option stops it at start with a clear error."""

import asyncio
import subprocess

import pytest

from tests.workers.worker_process import (
    collect,
    connected_client,
    start_worker,
    wait_for_heartbeat,
    worker_command,
)
from workers.args import EngineArgs
from workers.cost_model import PrefillCostModel
from workers.engine import SamplingParams
from workers.protocol.messages import GenerateRequest


def test_the_heartbeat_reports_the_cost_models_prediction_error(tmp_path):
    model_path = tmp_path / "cost_model.json"
    PrefillCostModel(a=0.0, b=0.001, d=0.0, e=0.0).save(model_path)
    worker = start_worker(tmp_path, "costed", "--cost-model", str(model_path), "--step-budget-ms", "20")
    try:

        async def run():
            client = await connected_client(worker.endpoints)
            try:
                params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
                outputs = await collect(client, GenerateRequest("r", list(range(5, 105)), params))
                beats = await wait_for_heartbeat(client, lambda beats: beats[0].cost_model_error_p50 > 0)
                return outputs, beats[0]
            finally:
                await client.close()

        outputs, beat = asyncio.run(run())
    finally:
        assert worker.stop() == 0
    assert outputs[-1].finish_reason == "length"
    assert 0 < beat.cost_model_error_p50 <= beat.cost_model_error_p90


def test_an_unreadable_cost_model_stops_the_worker_at_start(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "a": -1, "b": 0, "d": 0, "e": 0}')

    completed = subprocess.run(
        worker_command(tmp_path, "bad", "--cost-model", str(bad)), capture_output=True, text=True, timeout=120
    )

    assert completed.returncode == 1
    assert "cost model" in completed.stderr and str(bad) in completed.stderr


def test_a_step_budget_needs_a_cost_model():
    with pytest.raises(ValueError, match="cost_model"):
        EngineArgs(model="m", step_budget_ms=50)
