"""`python -m bench.serve` against the real stack: a small random load through each API, and a tiny
Mooncake trace whose repeated hash ids the server's prefix cache hits. Checks the report's shape and
counts, never its timings."""

import json
import subprocess
import sys

import pytest

from tests.e2e.conftest import MODEL, ROOT

pytestmark = pytest.mark.slow

PROMPTS = 3
OUTPUT_LEN = 4
STATS = ("mean", "median", "p95", "p99")


def bench(stack, tmp_path, *flags: str) -> dict:
    output = tmp_path / "report.json"
    completed = subprocess.run(
        [sys.executable, "-m", "bench.serve", "--base-url", stack.base_url, "--api-key", stack.api_key]
        + ["--model", MODEL, "--no-progress", "--output", str(output), *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert json.loads(output.read_text()) == report
    return report


@pytest.mark.parametrize("api", ["chat", "completions", "messages"])
def test_random_prompts_through_each_api(stack, tmp_path, api):
    report = bench(
        stack,
        tmp_path,
        *("--api", api, "--dataset", "random", "--num-prompts", str(PROMPTS), "--max-concurrency", "2"),
        *("--random-input-len", "24", "--random-output-len", str(OUTPUT_LEN), "--ignore-eos"),
        *("--slo", "ttft=600000,tpot=600000"),
    )

    assert (report["completed"], report["failed"], report["errors"]) == (PROMPTS, 0, [])
    assert report["total_output_tokens"] == PROMPTS * OUTPUT_LEN
    assert [request["output_tokens"] for request in report["requests"]] == [OUTPUT_LEN] * PROMPTS
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert all(isinstance(report[metric][stat], float) for stat in STATS), metric
    assert report["goodput"]["good_requests"] == PROMPTS
    # The gateway counts each finished request's prompt in its Prometheus counters, as usage reports it.
    cache = report["prefix_cache"]
    assert cache["server_queried_tokens"] == report["total_input_tokens"] > 0
    assert {"server_hit_rate", "usage_hit_rate", "ideal_hit_rate"} <= cache.keys()
    assert report["settings"]["api"] == api and stack.api_key not in json.dumps(report["settings"])


def test_a_mooncake_trace_hits_its_repeated_blocks(stack, tmp_path):
    # Blocks of 128 tokens (the store's block size); the second and third requests repeat the first's
    # first two blocks, the third all of the first's prompt.
    trace = [
        {"timestamp": 0, "input_length": 300, "output_length": 2, "hash_ids": [100, 101, 102]},
        {"timestamp": 50, "input_length": 300, "output_length": 2, "hash_ids": [100, 101, 103]},
        {"timestamp": 100, "input_length": 400, "output_length": 2, "hash_ids": [100, 101, 102, 104]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in trace))

    report = bench(
        stack,
        tmp_path,
        *("--api", "completions", "--dataset", "mooncake", "--dataset-path", str(path), "--block-size", "128"),
        *("--max-concurrency", "1", "--ignore-eos", "--seed", "7"),
    )

    assert (report["completed"], report["failed"]) == (3, 0)
    assert [request["prompt_tokens"] for request in report["requests"]] == [300, 300, 400]
    cache = report["prefix_cache"]
    # In blocks of 16: the second request can hit 256 tokens, the third the first's 18 whole blocks.
    assert cache["ideal_hit_rate"] == pytest.approx((256 + 288) / 1000)
    # No other test sends these tokens (the seed's), so the cache was cold for them: the ideal bounds the hits.
    assert 0 < cache["server_hit_rate"] <= cache["ideal_hit_rate"]
    assert cache["usage_hit_rate"] == pytest.approx(cache["server_hit_rate"])
