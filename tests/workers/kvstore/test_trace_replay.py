import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from bench.trace_replay import load_chains, policy_costs, run

REPO_ROOT = Path(__file__).resolve().parents[3]


def write_trace(path: Path, requests: list[dict]) -> Path:
    path.write_text("".join(json.dumps(request) + "\n" for request in requests))
    return path


@pytest.fixture
def tiny_trace(tmp_path: Path) -> Path:
    """Three requests sharing a prefix; the first one ends with a partial block (id 4)."""
    return write_trace(
        tmp_path / "tiny.jsonl",
        [
            {"timestamp": 0, "input_length": 3 * 512 + 300, "output_length": 1, "hash_ids": [1, 2, 3, 4]},
            {"timestamp": 1000, "input_length": 2 * 512, "output_length": 1, "hash_ids": [1, 2]},
            {"timestamp": 2000, "input_length": 4 * 512, "output_length": 1, "hash_ids": [1, 2, 3, 5]},
        ],
    )


@pytest.fixture
def skewed_trace(tmp_path: Path) -> Path:
    """Shared prefixes with Zipf-like popularity, each request adding a unique tail and a partial block."""
    rng = random.Random(7)
    next_id = 0
    prefixes = []
    for _ in range(8):
        length = rng.randint(2, 6)
        prefixes.append(list(range(next_id, next_id + length)))
        next_id += length
    requests = []
    for i in range(80):
        ids = list(rng.choices(prefixes, weights=[1 / (rank + 1) for rank in range(8)])[0])
        tail = rng.randint(0, 3)
        ids += list(range(next_id, next_id + tail + 1))  # + 1: the partial last block
        next_id += tail + 1
        requests.append(
            {"timestamp": i * 700, "input_length": (len(ids) - 1) * 512 + 100, "output_length": 5, "hash_ids": ids}
        )
    return write_trace(tmp_path / "skewed.jsonl", requests)


def test_tiny_trace_exact_hit_rates(tiny_trace):
    result = run(tiny_trace, capacity_blocks=2, policy="best", block_tokens=512)
    # Full blocks 3 + 2 + 4. Unbounded: 0 + 2 + 3 hits. Two blocks: the first request keeps 1, 2
    # (its tail goes first), so 0 + 2 + 2.
    assert result["oracle_hit_rate"] == pytest.approx(5 / 9)
    assert result["belady_hit_rate"] == pytest.approx(4 / 9)
    assert result["lru_hit_rate"] == pytest.approx(4 / 9)
    assert result["hit_rate"] == pytest.approx(4 / 9)
    assert result["unique_blocks"] == 4
    assert result["requests"] == 3


def test_block_tokens_split_and_merge_trace_blocks(tiny_trace):
    split = load_chains(tiny_trace, 256)
    # 1836 tokens = 7 full 256-token blocks: the partial trace block 4 contributes its first half.
    assert [len(keys) for _, keys in split] == [7, 4, 8]
    assert split[0][1][:6] == split[2][1][:6]
    merged = load_chains(tiny_trace, 1024)
    assert [len(keys) for _, keys in merged] == [1, 1, 2]
    assert merged[0][1][0] == merged[1][1][0] == merged[2][1][0]
    assert run(tiny_trace, capacity_blocks=100, policy="lru", block_tokens=256)["oracle_hit_rate"] == pytest.approx(
        10 / 19
    )
    assert run(tiny_trace, capacity_blocks=100, policy="lru", block_tokens=1024)["oracle_hit_rate"] == 0.5


@pytest.mark.parametrize("block_tokens", [0, 384, 700])
def test_block_tokens_must_divide_or_be_a_multiple_of_512(tiny_trace, block_tokens):
    with pytest.raises(ValueError, match="divide 512 or be a multiple"):
        load_chains(tiny_trace, block_tokens)


@pytest.mark.parametrize("capacity_blocks", [4, 10, 20])
def test_replay_invariants(skewed_trace, capacity_blocks):
    result = run(skewed_trace, capacity_blocks=capacity_blocks, policy="best", block_tokens=512)
    for name in ("hit_rate", "lru_hit_rate", "belady_hit_rate", "oracle_hit_rate"):
        assert 0 <= result[name] <= 1
    assert result["oracle_hit_rate"] >= result["belady_hit_rate"]
    assert result["belady_hit_rate"] >= max(result["hit_rate"], result["lru_hit_rate"])
    assert result["ratio_to_belady"] == pytest.approx(result["hit_rate"] / result["belady_hit_rate"])
    assert result["lru_ratio_to_belady"] == pytest.approx(result["lru_hit_rate"] / result["belady_hit_rate"])


def test_unbounded_capacity_matches_the_oracle(skewed_trace):
    result = run(skewed_trace, capacity_blocks=10_000, policy="best", block_tokens=512)
    assert result["hit_rate"] == result["lru_hit_rate"] == result["belady_hit_rate"] == result["oracle_hit_rate"]
    assert result["oracle_hit_rate"] > 0.5


def test_cli_prints_one_json_object(tiny_trace):
    completed = subprocess.run(
        [sys.executable, "-m", "bench.trace_replay", "--trace", str(tiny_trace), "--capacity-blocks", "2"]
        + ["--policy", "lru", "--block-tokens", "512"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(completed.stdout)
    assert {
        "policy",
        "capacity_blocks",
        "unique_blocks",
        "hit_rate",
        "lru_hit_rate",
        "belady_hit_rate",
        "oracle_hit_rate",
        "ratio_to_belady",
        "lru_ratio_to_belady",
    } <= result.keys()
    assert result["policy"] == "lru"
    assert result["hit_rate"] == pytest.approx(4 / 9)


def test_cli_rejects_an_unknown_policy(tiny_trace):
    completed = subprocess.run(
        [sys.executable, "-m", "bench.trace_replay", "--trace", str(tiny_trace), "--capacity-blocks", "2"]
        + ["--policy", "nope"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 2
    assert "unknown eviction policy" in completed.stderr


def test_policy_costs_time_every_policy_on_both_indexes_and_clean_up_redis():
    client = redis.Redis.from_url("redis://127.0.0.1:6379/9")
    before = set(client.scan_iter(match="bench:trace_replay:*", count=1000))

    costs = policy_costs(["lru", "best"], blocks=200, redis_url="redis://127.0.0.1:6379/9", rounds=1)

    assert set(costs["ranking"]) == {"lru", "best"}
    timings = [cost for policy in costs["ranking"].values() for cost in policy.values()]
    timings += [cost for backend in costs["removal"].values() for cost in backend.values()]
    assert len(timings) == 8 and all(0 < cost < float("inf") for cost in timings)
    assert set(client.scan_iter(match="bench:trace_replay:*", count=1000)) == before
    client.close()
