"""bench.mla_prefill_forms times equal computations: on tiny float32 shapes the decompressed form
(kv_b_proj expansion, then SDPA) and the absorbed form (W_UK and W_UV around the Triton prefill
kernel, in Triton's interpreter without CUDA) give the same output, with and without a cached
prefix; and the benchmark's CPU run prints a row per configuration."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.mla_prefill_forms import TINY_MLA, absorbed_attention, decompressed_attention, make_step

ROOT = Path(__file__).resolve().parents[2]
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HEADS = 3  # not a power of two: the kernel's head block is partly idle


# Pages of 8: the prefixes end mid-page and the chunks cross page boundaries.
@pytest.mark.parametrize(("batch", "prefix", "chunk"), [(1, 0, 13), (2, 0, 5), (1, 21, 7), (2, 37, 12)])
def test_decompressed_form_matches_absorbed(batch, prefix, chunk):
    step = make_step(
        HEADS, TINY_MLA, batch=batch, prefix=prefix, chunk=chunk, page=8, dtype=torch.float32, device=DEVICE, seed=3
    )

    absorbed = absorbed_attention(step, TINY_MLA)
    decompressed = decompressed_attention(step, TINY_MLA)

    assert decompressed.shape == absorbed.shape == (batch * chunk, HEADS, TINY_MLA.v_head_dim)
    assert absorbed.abs().max() > 0.1
    torch.testing.assert_close(decompressed, absorbed, atol=1e-4, rtol=1e-4)


def test_cpu_run_reports_both_forms_per_configuration():
    completed = subprocess.run(
        [sys.executable, "-m", "bench.mla_prefill_forms", "--device=cpu", "--batch-sizes=1,2", "--repeats=1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )

    report = json.loads(completed.stdout)
    assert report["device"] == "cpu" and report["shapes"]["tiny"]["heads"] == 2
    assert [(r["batch"], r["chunk"], r["prefix"]) for r in report["rows"]] == [
        (batch, chunk, prefix) for batch in (1, 2) for chunk in (4, 16) for prefix in (0, 20)
    ]
    for row in report["rows"]:
        assert row["absorbed_us"] > 0 and row["decompressed_us"] > 0
        assert row["winner"] in ("absorbed", "decompressed")
        assert row["max_abs_difference"] < 1e-4
        assert row["sdpa_ops"]
