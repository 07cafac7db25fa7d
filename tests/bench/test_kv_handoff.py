"""bench.kv_handoff on the CPU: a sender and a receiver process hand the same KV over both backends,
every byte checked by the receiver, and the report names both; a latent (MLA) shape's too."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_frames_and_pages_both_deliver_every_run_and_are_reported():
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.kv_handoff",
            "--device=cpu",
            "--shapes=smollm2_135m,deepseek_v3",
            "--tokens=64",
            "--runs=2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(completed.stdout)
    row, latent = report["rows"]
    assert report["device"] == "cpu" and row["model_shape"] == "smollm2_135m"
    assert row["pages_backend"] == "host_memory"
    assert row["kv_bytes"] == 30 * 2 * 3 * 64 * 64 * 2
    assert row["zmq_s"] > 0 and row["pages_s"] > 0
    assert (latent["model_shape"], latent["planes"], latent["heads"], latent["width"]) == ("deepseek_v3", 1, 1, 576)
    assert latent["kv_bytes"] == 61 * 576 * 64 * 2
    assert latent["zmq_s"] > 0 and latent["pages_s"] > 0
