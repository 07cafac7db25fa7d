import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from bench.spec_budget import K, make_request

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_a_synthetic_request_depends_only_on_its_seed_and_index():
    first, again, other = make_request(0, 7), make_request(0, 7), make_request(0, 8)

    assert np.array_equal(first.raw, again.raw) and np.array_equal(first.accepted, again.accepted)
    assert not np.array_equal(first.raw[: other.length], other.raw[: first.length])
    assert first.raw.shape == (first.length, K) and ((first.raw >= 0) & (first.raw <= 1)).all()


def test_the_quick_run_labels_its_acceptance_synthetic_and_compares_the_policies(tmp_path):
    out = tmp_path / "spec_budget.json"

    completed = subprocess.run(
        [sys.executable, "-m", "bench.spec_budget", "--quick", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )

    result = json.loads(out.read_text())
    assert json.loads(completed.stdout) == result
    assert result["acceptance"].startswith("SYNTHETIC") and result["step_time"]["measured_curve"]
    for row in result["results"]:
        assert row["none"]["accepted_length"] == 1.0 and row["none"]["verified_draft_tokens_per_request_step"] == 0
        # Fixed verifies every draft; only drafts past a request's end are missing.
        assert 4.5 < row["fixed_k5"]["verified_draft_tokens_per_request_step"] <= K
        assert 0 < row["dspark"]["verified_draft_tokens_per_request_step"] <= K
        assert row["dspark"]["accepted_length"] > 1.0
    assert [row["concurrency"] for row in result["results"]] == [1, 16]
    assert len(result["targets"]) == 3 * 2  # three rows per concurrency; 64 was not run
