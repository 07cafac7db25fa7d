"""bench.swa_replay on a tiny hybrid model (sliding, full, sliding layers; window 6): its JSON says where
each condition's SWA state came from by what it replayed."""

import json
import subprocess
import sys

from tests.workers.engine.hf_reference import TINY_CONFIGS


def test_the_benchmark_times_each_source_of_swa_state_and_counts_what_each_replayed(tmp_path):
    config = tmp_path / "hybrid.json"
    config.write_text(json.dumps(TINY_CONFIGS["qwen3_qknorm_layer_types"]))

    printed = subprocess.run(
        [sys.executable, "-m", "bench.swa_replay", "--model", str(config), "--lengths", "100,200"]
        + ["--block-tokens", "32", "--kl", "2"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout

    result = json.loads(printed)
    assert [row["prompt_tokens"] for row in result["rows"]] == [100, 200]
    for row in result["rows"]:
        assert set(row["ttft_s"]) == {"state_held", "approximate_replay", "exact_replay", "no_cache"}
        assert all(seconds > 0 for seconds in row["ttft_s"].values())
        # The state in the writer's host cache: nothing replayed. Without it: the window (6), or 2
        # window layers × 5 for the exact replay; no store: nothing to replay.
        assert row["replayed_tokens"] == {"state_held": 0, "approximate_replay": 6, "exact_replay": 10, "no_cache": 0}
        assert row["recompute_avoided"] == 0.4
        kl = row["kl_approximate_from_exact"]
        assert kl["prompts"] == 2 and 0 <= kl["mean"] <= kl["max"]
