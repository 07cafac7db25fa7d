import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from bench.skewed_trace import BLOCK_TOKENS, SkewedTraceConfig, generate, write_trace
from bench.trace_replay import run

REPO_ROOT = Path(__file__).resolve().parents[2]
SMALL = SkewedTraceConfig(requests=600, prefixes=60, seed=3, max_prefix_blocks=24)


def read_trace(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_format_shared_prefixes_and_unique_tails(tmp_path):
    path = tmp_path / "skewed.jsonl"
    assert write_trace(path, SMALL) == SMALL.requests
    trace = read_trace(path)
    assert len(trace) == SMALL.requests
    for request in trace:
        assert set(request) == {"timestamp", "input_length", "output_length", "hash_ids"}
        assert all(type(request[field]) is int for field in ("timestamp", "input_length", "output_length"))
        assert all(type(block_id) is int for block_id in request["hash_ids"])
        assert len(request["hash_ids"]) == -(-request["input_length"] // BLOCK_TOKENS)
        assert request["output_length"] >= 1
    timestamps = [request["timestamp"] for request in trace]
    assert timestamps == sorted(timestamps) and timestamps[0] == 0

    # Every id used by more than one request sits in a prefix, always at the same position and after
    # the same ids; ids used once are the tails, which come after the prefix and are never reused.
    uses = Counter(block_id for request in trace for block_id in request["hash_ids"])
    assert all(len(set(request["hash_ids"])) == len(request["hash_ids"]) for request in trace)
    before: dict[int, tuple[int, ...]] = {}
    shared_requests = 0
    for request in trace:
        ids = request["hash_ids"]
        shared = [uses[block_id] > 1 for block_id in ids]
        prefix_len = shared.index(False) if False in shared else len(ids)
        assert not any(shared[prefix_len:]), "a shared id after a unique one"
        assert prefix_len < len(ids), "every request has a unique tail"
        assert SMALL.min_prefix_blocks <= prefix_len <= SMALL.max_prefix_blocks or prefix_len == 0
        shared_requests += prefix_len > 0
        for position, block_id in enumerate(ids[:prefix_len]):
            assert before.setdefault(block_id, tuple(ids[:position])) == tuple(ids[:position])
    assert shared_requests > 0.9 * len(trace)  # only a prefix's single use leaves it unshared
    # Zipf: the most popular prefix (by its first block) takes a large share of the requests.
    first_block_uses = Counter(request["hash_ids"][0] for request in trace)
    assert first_block_uses.most_common(1)[0][1] > 0.1 * len(trace)


def test_deterministic_by_seed():
    assert generate(SMALL) == generate(SMALL)
    assert generate(SMALL) != generate(SkewedTraceConfig(**{**SMALL.__dict__, "seed": SMALL.seed + 1}))


def test_cli_writes_the_same_trace(tmp_path):
    out = tmp_path / "cli.jsonl"
    args = ["--requests", "600", "--prefixes", "60", "--seed", "3", "--max-prefix-blocks", "24"]
    subprocess.run([sys.executable, "-m", "bench.skewed_trace", "--out", str(out), *args], cwd=REPO_ROOT, check=True)
    assert read_trace(out) == generate(SMALL)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--requests", "0"], "--requests must be positive"),
        (["--zipf", "-1"], "--zipf must be"),
        (["--min-prefix-blocks", "10", "--max-prefix-blocks", "5"], "--max-prefix-blocks (5) must be >="),
        (["--rate", "0"], "--rate must be"),
    ],
)
def test_cli_rejects_bad_arguments(tmp_path, args, message):
    result = subprocess.run(
        [sys.executable, "-m", "bench.skewed_trace", "--out", str(tmp_path / "x.jsonl"), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert not (tmp_path / "x.jsonl").exists()


def test_segmented_lru_beats_lru_at_small_capacity(tmp_path):
    path = tmp_path / "skewed.jsonl"
    write_trace(path, SMALL)
    full_blocks = {
        block_id for request in read_trace(path) for block_id in request["hash_ids"][: request["input_length"] // 512]
    }
    result = run(path, capacity_blocks=len(full_blocks) // 20, policy="slru", block_tokens=BLOCK_TOKENS)
    assert result["unique_blocks"] == len(full_blocks)
    assert result["hit_rate"] > result["lru_hit_rate"] + 0.03
    assert result["hit_rate"] <= result["belady_hit_rate"] <= result["oracle_hit_rate"]
